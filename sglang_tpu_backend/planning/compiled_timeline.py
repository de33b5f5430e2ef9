"""The overlap-aware step time of a compiled program (``ProgramCost.overlap_seconds``), and
``program_cost``, a compiled program's charges and both step times.

The rules are in ``compiled_roofline.py``'s docstring: each computation is walked in its
schedule order on a timeline; ops run one after another on the TensorCore, except the
transfers of async windows (XLA async collectives; Pallas calls named ``*_start`` with remote
bytes), which run beside them until the op that uses their result, so a window costs
max(transfer, compute inside it).
"""

from __future__ import annotations

from sglang_tpu_backend.planning.compiled_roofline import (
    COLLECTIVES, KINDS, TPU7X, ZERO_COST, Charge, Device, ProgramCost, _target, _Walk, trip_count)
from sglang_tpu_backend.planning.hlo_text import Computation, Instruction, parse_module

def program_cost(hlo: str, device: Device = TPU7X) -> ProgramCost:
    """Charge every op of compiled HLO text (``compiled_roofline.py``'s docstring), with the
    serial and the overlap-aware step time. Here, above both the charges and the timeline."""
    comps, entry = parse_module(hlo)
    kinds = {k: Charge() for k in KINDS}
    _Walk(comps, device, kinds).computation(comps[entry], 1.0)
    return ProgramCost(kinds, Timeline(comps, device).seconds(comps[entry]))


ASYNC_COLLECTIVE_STARTS = frozenset({
    "all-gather-start", "all-reduce-start", "collective-permute-start"})
_FORWARDING = frozenset({"get-tuple-element", "tuple", "opt-barrier", "bitcast"})


def _kernel_name(instr: Instruction) -> str:
    """A Pallas call's kernel name: the op_name component before ``pallas_call``."""
    parts = instr.op_name.split("/")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "pallas_call" else ""


def sources(comp: Computation, name: str, index: int | None = None) -> set[str]:
    """The instructions whose results the value ``name`` (its tuple element ``index``)
    forwards, through get-tuple-element, tuple, opt-barrier and bitcast."""
    ins = comp.instructions.get(name)
    if ins is None:
        return set()
    if ins.opcode == "get-tuple-element":
        return sources(comp, ins.operands[0], int(ins.attr("index")))
    if ins.opcode == "tuple":
        ops = ins.operands if index is None else ins.operands[index:index + 1]
        return set().union(*(sources(comp, o) for o in ops)) if ops else set()
    if ins.opcode == "opt-barrier":
        return sources(comp, ins.operands[0], index)
    if ins.opcode == "bitcast":
        return sources(comp, ins.operands[0])
    return {name}


class Timeline:
    """The overlap-aware time of a computation (module docstring)."""

    def __init__(self, comps: dict[str, Computation], device: Device):
        self.comps, self.device = comps, device
        self.walk = _Walk(comps, device, {k: Charge() for k in KINDS})
        self.memo: dict[str, float] = {}

    def serial(self, comp: Computation) -> Charge:
        """The serial charge of a computation run once, summed over its ops."""
        kinds = {k: Charge() for k in KINDS}
        _Walk(self.comps, self.device, kinds).computation(comp, 1.0)
        return ProgramCost(kinds).total

    def seconds(self, comp: Computation) -> float:
        if comp.name in self.memo:
            return self.memo[comp.name]
        dev = self.device
        t, finish, links_free = 0.0, {}, 0.0

        def transfer(c: Charge, other_s: float) -> float:
            """Queue the link bytes of ``c``, issued at t; returns when the transfer ends."""
            nonlocal links_free
            links = c.ici_bytes / dev.ici_bandwidth + c.d2d_bytes / dev.d2d_bandwidth
            links_free = max(t, links_free) + links
            return max(links_free, t + other_s)

        for ins in comp.instructions.values():
            op, called = ins.opcode, ins.called()
            if op in _FORWARDING or op in ("parameter", "constant"):
                continue
            waits = [finish[s] for o in ins.operands for s in sources(comp, o) if s in finish]
            t = max([t, *waits])
            if op in ZERO_COST:
                continue
            if op == "while":
                trips = trip_count(self.comps, comp, ins)
                t += trips * self.seconds(self.comps[called["body"]])
                t += (trips + 1) * self.seconds(self.comps[called["condition"]])
            elif op == "conditional":
                t += max(self.seconds(self.comps[v]) for k, v in called.items()
                         if k.startswith("branch"))
            elif op in ("call", "call-start", "async-start"):
                body = self.comps[called.get("to_apply") or called["calls"]]
                if op != "call" and self._has_collective(body):
                    c = self.serial(body)
                    finish[ins.name] = transfer(c, dev.seconds(c))
                else:
                    t += self.seconds(body)
            else:
                charge, _ = self.walk.charge(comp, ins)
                remote = self._async_remote_bytes(ins)
                if op in ASYNC_COLLECTIVE_STARTS or remote is not None:
                    remote = remote or 0.0
                    local = Charge(charge.flops, charge.fp8_flops,
                                   max(charge.hbm_bytes - remote, 0.0))
                    t += dev.seconds(local)
                    finish[ins.name] = transfer(charge, remote / dev.hbm_bandwidth)
                else:
                    t += dev.seconds(charge)
        t = max([t, *finish.values()])
        self.memo[comp.name] = t
        return t

    def _has_collective(self, comp: Computation) -> bool:
        for ins in comp.instructions.values():
            if ins.opcode in COLLECTIVES or ins.opcode in ASYNC_COLLECTIVE_STARTS:
                return True
            for name in ins.called().values():
                if name in self.comps and self._has_collective(self.comps[name]):
                    return True
        return False

    @staticmethod
    def _async_remote_bytes(ins: Instruction) -> float | None:
        """Remote bytes of a Pallas call that starts an async transfer (its kernel named
        ``*_start``, with remote bytes in its cost estimate); None for any other op."""
        if ins.opcode != "custom-call" or _target(ins) != "tpu_custom_call":
            return None
        if not _kernel_name(ins).endswith("_start"):
            return None
        est = ins.backend_config().get("custom_call_config", {}).get("cost_estimate") or {}
        remote = float(est.get("remote_bytes_transferred", 0))
        return remote if remote else None
