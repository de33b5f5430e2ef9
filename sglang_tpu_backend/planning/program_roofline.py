"""Program efficiency: a compiled step's charged cost (``compiled_roofline.py``) against the
roofline's ideal step (``roofline.step_terms``) for the same batch, per layer kind.

The ideal counts only what a step must do: its matmul FLOPs and the bytes it must move
(weights once, touched experts, KV pages, GDN state, lm_head). The charged cost is every op of
the compiled program. Their ratio, ideal / charged, is the program efficiency: of HBM bytes
for a decode step (memory-bound), of FLOPs for a prefill step (compute-bound), and of time.

The dense weights of ``step_terms`` are split over the kinds by module: ``self_attn`` ->
attention, ``linear_attn`` -> GDN, the router (``mlp.gate``) -> routed experts,
``shared_expert`` and its gate -> shared expert, norms -> other.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.models.param_shapes import layer_param_shapes
from sglang_tpu_backend.planning.compiled_roofline import KINDS, Charge, Device, ProgramCost
from sglang_tpu_backend.planning.roofline import step_terms

_MODULE_KINDS = {"self_attn": "attention", "linear_attn": "gdn", "gate": "routed experts",
                 "shared_expert": "shared expert", "shared_expert_gate": "shared expert"}


def _dense_by_kind(cfg: ModelConfig, expert_dtype: str) -> dict[str, tuple[float, float]]:
    """{kind: (bytes, matmul params)} of the non-expert weights of all layers."""
    out = {k: [0.0, 0.0] for k in KINDS}
    for layer in range(cfg.num_hidden_layers):
        p = layer_param_shapes(cfg, layer, jnp.bfloat16, fp8_experts=expert_dtype == "fp8")
        mlp = {k: v for k, v in p.pop("mlp").items() if k != "experts"}
        modules = {**p, **mlp}  # a dense layer's MLP (gate_up, down) is "other"
        for name, tree in modules.items():
            kind = _MODULE_KINDS.get(name, "other")
            for leaf in jax.tree.leaves(tree):
                out[kind][0] += leaf.size * jnp.dtype(leaf.dtype).itemsize
                out[kind][1] += leaf.size if len(leaf.shape) >= 2 else 0
    return {k: (b, n) for k, (b, n) in out.items()}


def ideal_by_kind(cfg: ModelConfig, *, tokens: int, seqs: int, kv_len: int, devices: int,
                  decode: bool, logits_rows: int, expert_dtype: str = "fp8",
                  state_dtype: str = "bf16", kv_dtype: str = "bf16") -> dict[str, Charge]:
    """The roofline's ideal step on one device, as charges per layer kind (``fp8_flops``:
    the expert FLOPs when the experts are FP8). Totals equal ``step_terms``'s."""
    t = step_terms(cfg, tokens=tokens, seqs=seqs, kv_len=kv_len, devices=devices,
                   logits_rows=logits_rows, decode=decode, expert_dtype=expert_dtype,
                   state_dtype=state_dtype, kv_dtype=kv_dtype)
    kinds = {k: Charge() for k in KINDS}
    for kind, (nbytes, params) in _dense_by_kind(cfg, expert_dtype).items():
        kinds[kind].add(Charge(flops=2.0 * tokens * params, hbm_bytes=nbytes))
    fp8 = t["expert_flops"] if expert_dtype == "fp8" else 0.0
    kinds["attention"].add(Charge(flops=t["attention_flops"], hbm_bytes=t["kv_bytes"]))
    kinds["gdn"].add(Charge(flops=t["gdn_flops"], hbm_bytes=t["gdn_state_bytes"]))
    kinds["routed experts"].add(Charge(flops=t["expert_flops"], fp8_flops=fp8,
                                       hbm_bytes=t["expert_weight_bytes"]))
    kinds["head"].add(Charge(flops=t["lm_head_flops"], hbm_bytes=t["lm_head_bytes"]))
    return kinds


@dataclasses.dataclass(frozen=True)
class BucketEfficiency:
    """One compiled bucket (``name``: "decode" | "prefill") against its ideal, per device."""

    name: str
    charged: ProgramCost
    ideal: dict[str, Charge]
    device: Device

    @property
    def ideal_total(self) -> Charge:
        return Charge.sum(self.ideal.values())

    @property
    def ideal_seconds(self) -> float:
        """The roofline's step time: max(compute, memory) of the whole step."""
        return self.device.seconds(self.ideal_total)

    def ratios(self) -> dict[str, float]:
        """ideal / charged of HBM bytes, FLOPs and time."""
        c, i = self.charged.total, self.ideal_total
        return {"bytes": i.hbm_bytes / c.hbm_bytes, "flops": i.flops / c.flops,
                "time": self.ideal_seconds / c.seconds}

    @property
    def efficiency(self) -> float:
        """The ratio that bounds this bucket: bytes for decode, FLOPs for prefill."""
        return self.ratios()["bytes" if self.name == "decode" else "flops"]


def format_efficiency(b: BucketEfficiency) -> str:
    """A per-kind table: charged vs ideal GFLOP, HBM GB, link MB and time (ms)."""
    head = (f"  {b.name:<15}{'GFLOP':>10}{'ideal':>9}{'HBM GB':>9}{'ideal':>8}{'ICI MB':>9}"
            f"{'D2D MB':>8}{'ms':>8}{'ideal':>8}{'ops':>7}")
    rows = [head]
    for kind in (*KINDS, "total"):
        c = b.charged.total if kind == "total" else b.charged.kinds[kind]
        i = b.ideal_total if kind == "total" else b.ideal[kind]
        ideal_s = b.ideal_seconds if kind == "total" else b.device.seconds(i)
        rows.append(f"  {kind:<15}{c.flops / 1e9:>10.1f}{i.flops / 1e9:>9.1f}"
                    f"{c.hbm_bytes / 1e9:>9.3f}{i.hbm_bytes / 1e9:>8.3f}{c.ici_bytes / 1e6:>9.1f}"
                    f"{c.d2d_bytes / 1e6:>8.1f}{c.seconds * 1e3:>8.3f}{ideal_s * 1e3:>8.3f}"
                    f"{c.ops:>7.0f}")
    r = b.ratios()
    rows.append(f"  program efficiency (ideal / charged): bytes {r['bytes']:.3f}, "
                f"FLOPs {r['flops']:.3f}, time {r['time']:.3f}")
    rows.append(f"  step time: serial {b.charged.total.seconds * 1e3:.2f} ms, overlap-aware "
                f"{b.charged.overlap_seconds * 1e3:.2f} ms (async windows overlapped)")
    return "\n".join(rows)


def bucket_efficiency(name: str, hlo: str, cfg: ModelConfig, *, tokens: int, seqs: int,
                      kv_len: int, devices: int, device: Device, expert_dtype: str = "fp8",
                      state_dtype: str = "bf16", kv_dtype: str = "bf16") -> BucketEfficiency:
    """Charge compiled HLO text of one DP step (``tokens`` rows, ``seqs`` requests per rank,
    one logits row per request) and set it beside the roofline's ideal for that batch."""
    from sglang_tpu_backend.planning.compiled_timeline import program_cost

    ideal = ideal_by_kind(cfg, tokens=tokens, seqs=seqs, kv_len=kv_len, devices=devices,
                          decode=name == "decode", logits_rows=seqs, expert_dtype=expert_dtype,
                          state_dtype=state_dtype, kv_dtype=kv_dtype)
    return BucketEfficiency(name, program_cost(hlo, device), ideal, device)
