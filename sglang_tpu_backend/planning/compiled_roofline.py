"""A roofline of a compiled program: every op of its HLO charged at the hardware's peaks.

``compiled_timeline.program_cost(hlo_text, ...)`` walks every computation reachable from ENTRY of a compiled
(post-optimisation) XLA:TPU program and charges each instruction, per device:

- fusions and XLA ops: the HBM bytes of their operands and results (a fused slice,
  dynamic-slice or gather reads only the rows it takes; an in-place dynamic-update-slice or
  scatter writes only its update), and the FLOPs of their dots and convolutions (2 per
  multiply-add; elementwise arithmetic is left at 0);
- Pallas (Mosaic) calls: the ``CostEstimate`` their ``backend_config`` carries (flops,
  bytes_accessed, remote_bytes_transferred; a kernel's remote bytes are spread evenly over
  its peers, those on its chip over the die-to-die link: for the hierarchical reduce-scatter,
  whose first stage is all die-to-die, that over-charges ICI);
- collectives (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute and
  their async ``-start`` forms, also when offloaded to the SparseCores): the bytes each
  device receives, the share from its own chip's other die over the die-to-die link and the
  rest over the chip's ICI links (shared by its dies);
- async copies and slices between memories (``copy-start`` / ``slice-start``, VMEM
  prefetches): their HBM side;
- structural ops (parameter, tuple, get-tuple-element, bitcast, constant, async ``-done``
  halves, ...): an explicit zero-cost list. Any other opcode or custom-call target raises
  :class:`UnchargedOpError`: nothing is skipped silently.

A while loop's body (the layer scan) is charged once per iteration, its trip count read from
the loop's ``known_trip_count`` or from its condition (``i < N`` on a counter that starts at
a constant and steps by 1; any other loop raises). XLA's own ``cost_analysis()`` counts a
loop body once per program.

Each op's time is max(FLOPs / peak, HBM bytes / bandwidth, link bytes / link bandwidth), the
peak the FP8 one for dots of two FP8 operands and the bf16 one otherwise (Pallas calls too:
their cost estimates do not say which unit they use); the serial step time
(``ProgramCost.total.seconds``) is their sum (no overlap between ops).

The overlap-aware step time (``ProgramCost.overlap_seconds``, ``compiled_timeline.py``) walks
each computation in its schedule order (compiled HLO lists a scheduled computation's
instructions in that order) on a timeline: ops run one after another on the TensorCore,
except the transfers of async windows, which run beside them:
- an XLA async collective (``all-gather-start``, ``all-reduce-start``,
  ``collective-permute-start``, and a ``call-start`` / ``async-start`` whose computation holds
  a collective, such as a collective offloaded to the SparseCore) costs the TensorCore
  nothing at its start; its transfer takes its charged time;
- a Pallas call with remote bytes whose kernel is named ``*_start`` (``reduce_scatter_start``,
  ``reduce_scatter_ici_start`` of ``kernels/collectives_async.py``) costs the TensorCore its
  time without the remote DMAs (FLOPs; HBM bytes less the remote bytes, which the DMA engines
  read); its transfer takes max(link time, remote bytes / HBM bandwidth);
- an op that uses a window's result (its ``-done``, or a kernel reading the start kernel's
  buffers or semaphores, traced through tuples, get-tuple-element and optimization barriers)
  waits until that transfer has finished.
So one window costs max(its communication time, the compute time of the ops scheduled inside
it) instead of their sum. Transfers queue on the device's links (ICI + die-to-die seconds,
as ``Device.seconds`` adds them): two in flight at once run one after the other. Everything
else (prefetch copies, SparseCore gathers) stays serial. A loop body's timeline is charged
once per trip (windows do not cross trips).

Each op is attributed to a layer kind by the ``jax.named_scope`` of its metadata
(``models/qwen3_5_moe.py``), collectives and communicating kernels to
"communication".

Link figures (per chip; a TPU7x chip holds two TensorCores, each one JAX device):
- ``ICI_BANDWIDTH``: 1,200 GB/s bidirectional ICI bandwidth per chip (Google Cloud TPU7x
  documentation, system architecture table), so 600 GB/s into a chip.
- ``D2D_BANDWIDTH``: the die-to-die link between a chip's two TensorCores. No figure is
  published; set to one die's HBM bandwidth (3.69 TB/s), an assumption: a die reads its peer's
  memory no faster than its own.
"""

from __future__ import annotations

import dataclasses
import math
import re

from sglang_tpu_backend.planning.hlo_text import Computation, Instruction
from sglang_tpu_backend.planning.roofline import HARDWARE, Hardware

ICI_BANDWIDTH = 1200e9 / 2  # B/s into one TPU7x chip (1,200 GB/s bidirectional)
D2D_BANDWIDTH = 7380e9 / 2  # B/s between a TPU7x chip's two dies (assumed; see docstring)

KINDS = ("attention", "gdn", "routed experts", "shared expert", "communication", "head", "other")
# jax.named_scope names (a path component of an op's metadata op_name) -> layer kind.
SCOPE_KINDS = {"attention": "attention", "gdn": "gdn", "routed_experts": "routed experts",
               "shared_expert": "shared expert", "lm_head": "head"}

ZERO_COST = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
    "copy-done", "slice-done", "call-done", "async-done", "all-gather-done", "all-reduce-done",
    "collective-permute-done", "send-done", "recv-done"})
ZERO_COST_TARGETS = frozenset({  # custom calls that move no data: hints and async bookkeeping
    "AllocateBuffer", "AssumeGatherIndicesInBound", "ConcatBitcast", "PrepareAsyncCallStart",
    "PrepareAsyncCallDone"})
MEMORY_TARGETS = frozenset({"GatherScatterIndicesBitpacked"})  # charged operands + result
ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "bitcast-convert", "cbrt", "ceil", "clamp", "clz", "compare",
    "convert", "cosine", "divide", "erf", "exponential", "exponential-minus-one", "floor",
    "imag", "is-finite", "log", "log-plus-one", "logistic", "maximum", "minimum", "multiply",
    "negate", "not", "or", "popcnt", "power", "real", "remainder", "round-nearest-afz",
    "round-nearest-even", "rsqrt", "select", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "sign", "sine", "sqrt", "stochastic-convert", "subtract", "tan",
    "tanh", "xor"})
DATA_MOVEMENT = frozenset({
    "broadcast", "concatenate", "copy", "dynamic-slice", "dynamic-update-slice", "gather",
    "iota", "pad", "reduce", "reduce-precision", "reduce-window", "reshape", "reverse",
    "rng", "rng-bit-generator", "scatter", "select-and-scatter", "slice", "sort", "transpose"})
MATMUL = frozenset({"dot", "convolution"})
COLLECTIVES = frozenset({
    "all-gather", "all-gather-start", "all-reduce", "all-reduce-start", "reduce-scatter",
    "all-to-all", "ragged-all-to-all", "collective-permute", "collective-permute-start",
    "collective-broadcast"})
_FP8 = re.compile(r"^f8")


class UnchargedOpError(ValueError):
    """An instruction the walk has no cost rule for."""


@dataclasses.dataclass
class Charge:
    """What ops cost, summed: FLOPs (``fp8_flops`` of them at the FP8 peak), HBM bytes, bytes
    over ICI into the chip and over the die-to-die link, predicted seconds, op count."""

    flops: float = 0.0
    fp8_flops: float = 0.0
    hbm_bytes: float = 0.0
    ici_bytes: float = 0.0
    d2d_bytes: float = 0.0
    seconds: float = 0.0
    ops: float = 0.0

    def add(self, other: "Charge", times: float = 1.0) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + times * getattr(other, f.name))

    @classmethod
    def sum(cls, charges) -> "Charge":
        """A new Charge holding the sum of ``charges``."""
        out = cls()
        for c in charges:
            out.add(c)
        return out


@dataclasses.dataclass(frozen=True)
class Device:
    """One device (TensorCore) of the target: its peaks and how the program spans chips.
    ``devices``: devices of the program; ``devices_per_chip``: partitions ``i`` and ``j`` share
    a chip when ``i // devices_per_chip == j // devices_per_chip`` (``make_mesh``'s order)."""

    bf16_flops: float
    fp8_flops: float
    hbm_bandwidth: float
    devices: int
    devices_per_chip: int = 2
    ici_bandwidth: float = ICI_BANDWIDTH
    d2d_bandwidth: float = D2D_BANDWIDTH

    @classmethod
    def of(cls, hw: Hardware, devices: int) -> "Device":
        d = hw.devices_per_chip
        return cls(hw.bf16_flops / d, hw.fp8_flops / d, hw.hbm_bandwidth / d, devices, d)

    def seconds(self, c: Charge) -> float:
        compute = (c.flops - c.fp8_flops) / self.bf16_flops + c.fp8_flops / self.fp8_flops
        links = c.ici_bytes / self.ici_bandwidth + c.d2d_bytes / self.d2d_bandwidth
        return max(compute, c.hbm_bytes / self.hbm_bandwidth, links)


TPU7X = Device.of(HARDWARE["tpu7x"], 8)


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """A compiled program's charges per layer kind (``KINDS``), per device."""

    kinds: dict[str, Charge]
    overlap_seconds: float = math.nan  # the step time with async windows overlapped

    @property
    def total(self) -> Charge:
        return Charge.sum(self.kinds.values())


def kind_of(instr: Instruction) -> str:
    """The layer kind of an op: the innermost known named scope of its op_name."""
    if instr.opcode in COLLECTIVES:
        return "communication"
    kind = "other"
    for part in instr.op_name.split("/"):
        kind = SCOPE_KINDS.get(part, kind)
    return kind


def _consumer_kind(comp: Computation, start: Instruction) -> str:
    """The kind of an async copy (which carries no scope): that of the ops using its result."""
    for done in comp.users(start.name):
        for user in comp.users(done.name):
            if (kind := kind_of(user)) != "other":
                return kind
    return kind_of(start)


def _nbytes(instr: Instruction) -> float:
    """HBM bytes of an instruction's result (arrays in other memory spaces are on-chip)."""
    return sum(a.nbytes for a in instr.arrays if a.memory_space == 0)


class _Walk:
    def __init__(self, comps: dict[str, Computation], device: Device, kinds: dict[str, Charge]):
        self.comps, self.device, self.kinds = comps, device, kinds

    def computation(self, comp: Computation, times: float) -> None:
        for instr in comp.instructions.values():
            self.instruction(comp, instr, times)

    def instruction(self, comp: Computation, instr: Instruction, times: float) -> None:
        op, called = instr.opcode, instr.called()
        if op in ZERO_COST:
            return
        if op == "while":
            trips = trip_count(self.comps, comp, instr)
            self.computation(self.comps[called["body"]], times * trips)
            self.computation(self.comps[called["condition"]], times * (trips + 1))
        elif op in ("call", "call-start", "async-start"):
            self.computation(self.comps[called.get("to_apply") or called["calls"]], times)
        elif op == "conditional":  # the costliest branch
            branches = [v for k, v in called.items() if k.startswith("branch")]
            worst = max(branches, key=lambda b: _seconds(self.comps, b, self.device))
            self.computation(self.comps[worst], times)
        else:
            charge, kind = self.charge(comp, instr)
            charge.seconds, charge.ops = self.device.seconds(charge), 1.0
            self.kinds[kind].add(charge, times)

    def charge(self, comp: Computation, instr: Instruction) -> tuple[Charge, str]:
        op = instr.opcode
        if op == "fusion":
            body = self.comps[instr.called()["calls"]]
            flops, fp8 = fused_flops(self.comps, body)
            return Charge(flops, fp8, fusion_bytes(self.comps, comp, instr, body)), kind_of(instr)
        if op in MATMUL:
            flops = matmul_flops(comp, instr)
            fp8 = flops if _is_fp8_matmul(comp, instr) else 0.0
            return Charge(flops, fp8, memory_op_bytes(comp, instr)), kind_of(instr)
        if op in ELEMENTWISE or op in DATA_MOVEMENT:
            return Charge(hbm_bytes=memory_op_bytes(comp, instr)), kind_of(instr)
        if op in ("copy-start", "slice-start"):  # async copies between memories (prefetches)
            return Charge(hbm_bytes=async_copy_bytes(comp, instr)), _consumer_kind(comp, instr)
        if op in COLLECTIVES:
            return collective_charge(comp, instr, self.device), "communication"
        if op == "custom-call":
            return custom_call_charge(comp, instr, self.device)
        raise UnchargedOpError(f"no cost rule for {op!r} ({instr.name} in {comp.name})")


def _seconds(comps: dict[str, Computation], name: str, device: Device) -> float:
    """Predicted seconds of one computation run once."""
    kinds = {k: Charge() for k in KINDS}
    _Walk(comps, device, kinds).computation(comps[name], 1.0)
    return ProgramCost(kinds).total.seconds


# Bytes ------------------------------------------------------------------------------------
def _operand_bytes(comp: Computation, instr: Instruction, index: int) -> float:
    return _nbytes(comp.instructions[instr.operands[index]])


def memory_op_bytes(comp: Computation, instr: Instruction) -> float:
    """HBM bytes an unfused op reads and writes: a slice or gather reads what it returns, an
    in-place update writes (and reads) only its update; otherwise operands + result."""
    op, out = instr.opcode, _nbytes(instr)
    rest = lambda first: sum(_operand_bytes(comp, instr, i)  # noqa: E731
                             for i in range(first, len(instr.operands)))
    if op in ("slice", "dynamic-slice", "gather"):
        return 2 * out + rest(1)
    if op == "dynamic-update-slice":
        return 2 * _operand_bytes(comp, instr, 1) + rest(2)
    if op == "scatter":  # operand, indices, updates: read indices + updates, write updates
        return rest(1) + _operand_bytes(comp, instr, 2)
    return rest(0) + out


def async_copy_bytes(comp: Computation, instr: Instruction) -> float:
    """HBM bytes of an async copy or slice between memory spaces (result ``(source,
    destination, context)``): the destination's bytes read from and / or written to HBM."""
    src, dest = comp.instructions[instr.operands[0]].arrays[0], instr.arrays[1]
    return dest.nbytes * ((src.memory_space == 0) + (dest.memory_space == 0))


# Ops inside a fusion that only change an operand's layout, tiling or type: a slice after
# them still reads only the rows it takes.
_RELAYOUT = frozenset({"bitcast", "copy", "convert", "bitcast-convert"})


def _source(body: Computation, name: str) -> Instruction:
    """The instruction ``name`` is a layout change of (itself if none)."""
    instr = body.instructions[name]
    while instr.opcode in _RELAYOUT and instr.operands:
        instr = body.instructions[instr.operands[0]]
    return instr


def _parameters(body: Computation) -> dict[int, Instruction]:
    return {int(p.args): p for p in body.instructions.values() if p.opcode == "parameter"}


def _read_bytes(comps: dict[str, Computation], body: Computation, name: str, full: float,
                parent: tuple[Computation, str] | None = None) -> float:
    """Bytes a fusion reads of the value ``name`` (a parameter of ``body``, whose operand
    holds ``full`` bytes): only the slices or gathered rows if that is all it uses (also
    inside nested fusions: ``parent`` is the enclosing body and the nested fusion's name
    there), nothing if it only updates it in place, else all of it."""
    root = body.instructions[body.root]
    if name == body.root or (root.opcode == "tuple" and name in root.operands):
        if parent is None or root.opcode == "tuple":  # the fusion's output: read it all
            return full
        return _read_bytes(comps, parent[0], parent[1], full)  # what the parent reads of it
    total = 0.0
    for u in body.users(name):
        if u.opcode in _RELAYOUT:
            total += _read_bytes(comps, body, u.name, full, parent)
        elif u.opcode == "fusion":
            nested = comps[u.called()["calls"]]
            params = _parameters(nested)
            total += sum(_read_bytes(comps, nested, params[j].name, full, (body, u.name))
                         for j, op in enumerate(u.operands) if op == name)
        elif u.opcode in ("slice", "dynamic-slice", "gather") and u.operands[0] == name:
            total += sum(a.nbytes for a in u.arrays)
        elif not (u.opcode in ("dynamic-update-slice", "scatter") and u.operands[0] == name):
            return full
        if total >= full:
            return full
    return total


def _written_bytes(body: Computation, instr: Instruction) -> float:
    """Bytes a fusion output element writes: an in-place update writes only its update."""
    src = _source(body, instr.name)
    base = _source(body, src.operands[0]) if src.operands else None
    if base is not None and base.opcode == "parameter":
        if src.opcode == "dynamic-update-slice":
            return sum(a.nbytes for a in body.instructions[src.operands[1]].arrays)
        if src.opcode == "scatter":
            return sum(a.nbytes for a in body.instructions[src.operands[2]].arrays)
    return sum(a.nbytes for a in instr.arrays)


def fusion_bytes(comps: dict[str, Computation], comp: Computation, instr: Instruction,
                 body: Computation) -> float:
    """HBM bytes of one fusion: what it reads of each operand plus what it writes."""
    params = _parameters(body)
    read = 0.0
    for i, name in enumerate(instr.operands):
        full = _nbytes(comp.instructions[name])
        read += _read_bytes(comps, body, params[i].name, full) if full else 0.0
    root = body.instructions[body.root]
    outs = ([body.instructions[n] for n in root.operands] if root.opcode == "tuple" else [root])
    spaces = [a.memory_space for a in instr.arrays]
    written = sum(_written_bytes(body, o) for o, s in zip(outs, spaces) if s == 0)
    return read + written


# FLOPs ------------------------------------------------------------------------------------
def matmul_flops(comp: Computation, instr: Instruction) -> float:
    """2 x multiply-adds of a dot (output elements x contracted size) or a convolution."""
    out = math.prod(instr.arrays[0].dims)
    lhs = comp.instructions[instr.operands[0]].arrays[0].dims
    if instr.opcode == "dot":
        dims = instr.attr("lhs_contracting_dims") or "{}"
        k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", dims))
        return 2.0 * out * k
    return conv_flops(instr, lhs, comp.instructions[instr.operands[1]].arrays[0].dims)


def conv_flops(instr: Instruction, lhs: tuple[int, ...], kernel: tuple[int, ...]) -> float:
    """2 x multiply-adds of a convolution, counting only kernel taps that land on input (XLA
    writes a batched matmul as a convolution whose window slides over padding)."""
    lhs_l, rest = (instr.attr("dim_labels") or "").split("_")
    ker_l, out_l = rest.split("->")
    out = instr.arrays[0].dims
    window = _window(instr.attr("window") or "")
    taps = 1
    for d in range(sum(c.isdigit() for c in out_l)):
        w = {k: v[d] for k, v in window.items()}
        taps *= _valid_taps(lhs[lhs_l.index(str(d))], kernel[ker_l.index(str(d))],
                            out[out_l.index(str(d))], w)
    return (2.0 * out[out_l.index("b")] * out[out_l.index("f")] * kernel[ker_l.index("i")]
            * taps)


def _window(text: str) -> dict[str, list]:
    """``window={size=3x3 stride=1x1 pad=1_1x1_1 ...}`` -> {field: [per spatial dim]}."""
    out: dict[str, list] = {}
    for key, val in re.findall(r"(\w+)=([\d_x]+)", text):
        parts = val.split("x")
        out[key] = [tuple(int(p) for p in v.split("_")) if "_" in v else int(v) for v in parts]
    return out


def _valid_taps(in_size: int, k_size: int, out_size: int, w: dict) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read an input
    element rather than padding."""
    stride, (pad_lo, _) = w.get("stride", 1), w.get("pad", (0, 0))
    lhs_dil, rhs_dil = w.get("lhs_dilate", 1), w.get("rhs_dilate", 1)
    count = 0
    for k in range(k_size):
        if lhs_dil == 1:  # o * stride + k * rhs_dil - pad_lo in [0, in_size)
            lo = max(0, -(-(pad_lo - k * rhs_dil) // stride))
            hi = min(out_size - 1, (in_size - 1 + pad_lo - k * rhs_dil) // stride)
            count += max(0, hi - lo + 1)
        else:
            count += sum(1 for o in range(out_size)
                         if (p := o * stride + k * rhs_dil - pad_lo) >= 0 and p % lhs_dil == 0
                         and p // lhs_dil < in_size)
    return count


def _is_fp8_matmul(comp: Computation, instr: Instruction) -> bool:
    return all(_FP8.match(comp.instructions[n].arrays[0].dtype) for n in instr.operands[:2])


def fused_flops(comps: dict[str, Computation], body: Computation) -> tuple[float, float]:
    """(FLOPs, FP8 FLOPs) of a fusion body's dots and convolutions; raises on an op with no
    rule (a fused op is elementwise, data movement, a matmul or a known custom call)."""
    flops = fp8 = 0.0
    for instr in body.instructions.values():
        op = instr.opcode
        if op in MATMUL:
            f = matmul_flops(body, instr)
            flops += f
            fp8 += f if _is_fp8_matmul(body, instr) else 0.0
        elif op == "fusion":
            f, f8 = fused_flops(comps, comps[instr.called()["calls"]])
            flops, fp8 = flops + f, fp8 + f8
        elif op == "custom-call":
            if _target(instr) not in ZERO_COST_TARGETS | MEMORY_TARGETS:
                raise UnchargedOpError(f"fused custom call {_target(instr)!r} in {body.name}")
        elif op not in ZERO_COST and op not in ELEMENTWISE and op not in DATA_MOVEMENT:
            raise UnchargedOpError(f"no cost rule for fused {op!r} ({instr.name} in {body.name})")
    return flops, fp8


# Communication and custom calls -------------------------------------------------------------
def group_size(instr: Instruction, devices: int) -> int:
    """Devices per replica group: ``{{0,1,..}}`` lists, ``[G,n]<=[..]`` iota form, or all."""
    groups = instr.attr("replica_groups")
    if groups is None or groups.strip() in ("{}", "{{}}"):
        return devices
    iota = re.match(r"\[(\d+),(\d+)\]", groups)
    if iota:
        return int(iota.group(2))
    first = re.search(r"\{([\d,]+)\}", groups)
    return len(first.group(1).split(",")) if first else devices


def link_charge(received: float, n: int, device: Device) -> Charge:
    """``received`` bytes into one device, from ``n - 1`` peers spread evenly: those on its
    chip over the die-to-die link, the others over the chip's ICI, which its dies share."""
    if n <= 1:
        return Charge()
    d = min(device.devices_per_chip, n)
    same_chip = received * (d - 1) / (n - 1)
    return Charge(ici_bytes=d * (received - same_chip), d2d_bytes=same_chip)


def collective_charge(comp: Computation, instr: Instruction, device: Device) -> Charge:
    """Bytes one device receives in a collective of ``n`` devices (ring algorithms)."""
    n = group_size(instr, device.devices)
    op = instr.opcode.replace("-start", "")
    first = _operand_bytes(comp, instr, 0) if instr.operands else 0.0
    result = sum(a.nbytes for a in instr.arrays if a.memory_space == 0)
    if op == "all-gather":  # a -start result is (operand, result): the larger is the result
        out = max((a.nbytes for a in instr.arrays), default=0.0)
        received = out * (n - 1) / n
    elif op in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        received = first * (n - 1) / n
    elif op == "all-reduce":
        received = 2 * first * (n - 1) / n
    else:  # collective-permute / -broadcast: one peer's whole buffer
        received, n = max(first, result), 2
    return link_charge(received, n, device)


def _target(instr: Instruction) -> str:
    return (instr.attr("custom_call_target") or "").strip('"')


def custom_call_charge(comp: Computation, instr: Instruction, device: Device
                       ) -> tuple[Charge, str]:
    """A Pallas call's CostEstimate (remote bytes over the links: a communicating kernel is
    "communication"), a known data-moving call's operands + result, a hint's nothing."""
    target = _target(instr)
    if target in ZERO_COST_TARGETS:
        return Charge(), kind_of(instr)
    if target in MEMORY_TARGETS:
        return Charge(hbm_bytes=memory_op_bytes(comp, instr)), kind_of(instr)
    if target != "tpu_custom_call":
        raise UnchargedOpError(f"no cost rule for custom call {target!r} ({instr.name})")
    est = instr.backend_config().get("custom_call_config", {}).get("cost_estimate")
    if est is None:
        raise UnchargedOpError(f"Pallas call {instr.name} carries no cost estimate")
    charge = Charge(float(est.get("flops", 0)), 0.0, float(est.get("bytes_accessed", 0)))
    remote = float(est.get("remote_bytes_transferred", 0))
    if remote:
        charge.add(link_charge(remote, device.devices, device))
        return charge, "communication"
    return charge, kind_of(instr)


# Loops ------------------------------------------------------------------------------------
def trip_count(comps: dict[str, Computation], comp: Computation, loop: Instruction) -> int:
    """Iterations of a while loop: its ``known_trip_count``, else from a condition
    ``counter <cmp> N`` whose counter (a tuple element) starts at a constant and steps by 1."""
    known = loop.backend_config().get("known_trip_count", {}).get("n")
    if known is not None:
        return int(known)
    cond = comps[loop.called()["condition"]]
    root = cond.instructions[cond.root]
    direction = (root.attr("direction") or "").strip()
    if root.opcode != "compare" or len(root.operands) != 2:
        raise UnchargedOpError(f"while {loop.name}: condition is not a compare")
    a, b = (_source(cond, n) for n in root.operands)
    if a.opcode == "constant":  # N > i  ->  i < N
        a, b = b, a
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    if (a.opcode != "get-tuple-element" or b.opcode != "constant"
            or direction not in ("LT", "LE", "NE")):
        raise UnchargedOpError(f"while {loop.name}: no counter compare in its condition")
    index = int(a.attr("index"))
    init = _source(comp, comp.instructions[loop.operands[0]].operands[index])
    if init.opcode != "constant" or _counter_step(comps[loop.called()["body"]], index) != 1:
        raise UnchargedOpError(f"while {loop.name}: counter does not run from a constant by 1")
    return max(0, int(b.args) - int(init.args) + (direction == "LE"))


def _counter_step(body: Computation, index: int) -> int | None:
    """The constant a loop body adds to tuple element ``index`` (None if it does not)."""
    root = body.instructions[body.root]
    if root.opcode != "tuple":
        return None
    nxt = _source(body, root.operands[index])
    if nxt.opcode != "add":
        return None
    x, y = (_source(body, n) for n in nxt.operands)
    if x.opcode == "constant":
        x, y = y, x
    if (x.opcode, y.opcode) != ("get-tuple-element", "constant") or x.attr("index") != str(index):
        return None
    return int(y.args)
