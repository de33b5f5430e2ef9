"""Roofline: ceilings on serving throughput (tokens/s per chip) from a model config and a
hardware table; nothing is fitted to measured numbers.

    python -m sglang_tpu_backend.planning.roofline \
        --model-config sglang_tpu_backend/assets/configs/qwen3.5-397b-a17b.json \
        --hardware tpu7x --input-len 8192 --output-len 1024 --concurrency 64

System: ``num_chips`` chips with ``devices_per_chip`` devices each; every device is one
data-parallel attention rank holding a full copy of the non-expert weights, and the routed
experts are split evenly over all devices (DP = EP = devices). ``concurrency`` requests run
at once, spread evenly over the ranks.

Terms, per device and step (FLOPs count a multiply-add as 2; bytes are HBM bytes):

- weights (``weight_bytes``): every step reads the device's copy of the non-expert matmul
  weights (attention / GDN projections, router, shared expert, norms, lm_head for the rows
  that need logits) and the routed experts its tokens touch. With B tokens routed over the
  whole system, K experts each, uniformly over E experts, expert e is touched with
  probability ``1 - (1 - K/E)^B``, so ``coverage * E / devices`` local experts are read.
- KV cache: attention layers read every request's K and V (``kv_len`` tokens) once and
  write the new rows; GDN layers read and write each request's recurrent state
  ``[Hv, Dk, Dv]`` and conv state once.
- FLOPs: ``2 * params`` per token for the dense matmuls and K experts per token (a device
  multiplies its share of the routed rows, ``T * K`` under balanced routing: the EP step's
  kernels skip the gathered rows of other devices' experts); attention
  ``4 * Hq * D * kv_len`` per token; GDN per the kernel cost model (``kernels/gdn.py``).

Step time = max(FLOPs / peak, bytes / bandwidth) (bf16 peak; FP8 peak for FP8 expert matmuls).
A request cycle is prefill of ``concurrency * input_len`` tokens (in steps of
``prefill_tokens_per_device`` per device) then ``output_len`` decode steps at batch
``concurrency`` (mean context ``input_len + output_len / 2``); the ceiling is
``concurrency * (input_len + output_len) / cycle time / num_chips`` total tokens/s per chip.
Communication (all-gathers, reduce-scatter) and host overhead are left out: they only lower
real throughput, so the ceiling stays an upper bound.

Speculative decoding (``--speculative-num-draft-tokens n``, ``--accept-length a``): each
decode step is a TARGET_VERIFY step over n = k+1 rows per request (logits for every row;
GDN layers read each request's state once and write none, then the commit reads it again,
re-applies the accepted positions and writes it into the slot), followed by k MTP draft
steps (the MTP layer, one full-attention MoE layer behind its ``fc``, with the shared LM
head: the first over the n verified rows, which writes the MTP KV of every position, then
k-1 chain steps of one row per request). A request gains ``a`` tokens per step
(1 <= a <= n: the accepted drafts plus the token sampled after them), so the decode phase
takes ``output_len / a`` steps. ``a`` is an input: it depends on the MTP layer and the text,
not on the hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from sglang_tpu_backend.config import FULL_ATTENTION, ModelConfig, model_config_from_dict
from sglang_tpu_backend.kernels.gdn import gated_delta_net_cost
from sglang_tpu_backend.kernels.gdn_verify import (gated_delta_net_commit_cost,
                                                  gated_delta_net_verify_cost)
from sglang_tpu_backend.models.param_shapes import layer_param_shapes

CONFIG_397B = Path(__file__).resolve().parents[1] / "assets" / "configs" / "qwen3.5-397b-a17b.json"
DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp8": 1, "f32": 4, "float32": 4}
# Published Ironwood serving results, concurrency 64, one host (4 chips, 8 TensorCores):
# total (input + output) tokens/s per chip.
PUBLISHED = {(8192, 1024): 3707.0, (1024, 8192): 677.0}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-chip peaks: ``bf16_flops`` / ``fp8_flops`` (FLOP/s), ``hbm_bandwidth`` (B/s),
    ``hbm_bytes``; ``devices_per_chip`` (JAX devices), ``chips_per_host``."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    devices_per_chip: int = 1
    chips_per_host: int = 1


HARDWARE = {
    # Ironwood: 2 TensorCores per chip, 4 chips per VM.
    "tpu7x": Hardware("tpu7x", 2307e12, 4614e12, 7.4e12, 192 * 2**30, 2, 4),
    # Earlier TPU generations (published per-chip peaks; 4 chips per VM as the ct5lp / ct6e /
    # v5p hosts with 4 chips). No fp8 MXU before Ironwood: FP8 weights are dequantised and
    # multiplied in bf16, so their peak is bf16's (the bytes still halve).
    "v5e": Hardware("v5e", 197e12, 197e12, 819e9, 16 * 2**30, 1, 4),
    "v6e": Hardware("v6e", 918e12, 918e12, 1640e9, 32 * 2**30, 1, 4),
    "v5p": Hardware("v5p", 459e12, 459e12, 2765e9, 95 * 2**30, 1, 4),
    # NVIDIA SXM parts, dense (no sparsity) tensor-core peaks, 8 GPUs per host.
    "h100": Hardware("h100", 989e12, 1979e12, 3.35e12, 80e9, 1, 8),
    "h200": Hardware("h200", 989e12, 1979e12, 4.8e12, 141e9, 1, 8),
}


# JAX's ``device_kind`` of each generation's TensorCore -> its HARDWARE entry.
DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e", "TPU v6e": "v6e",
                "TPU v5": "v5p", "TPU v5p": "v5p", "TPU7x": "tpu7x", "TPU 7x": "tpu7x"}


def hardware_for(device_kind: str) -> Hardware:
    """The peaks of the TPU generation a JAX ``device_kind`` names (``jax.devices()[0]
    .device_kind``: "TPU v5 lite" on a v5e); ValueError naming the kind for one not known."""
    name = DEVICE_KINDS.get(device_kind)
    if name is None:
        raise ValueError(f"no peaks known for device_kind {device_kind!r} "
                         f"(known: {sorted(DEVICE_KINDS)})")
    return HARDWARE[name]


def this_hardware() -> Hardware:
    """The peaks of the TPU this process runs on (``hardware_for``); off a TPU this machine
    measured as one chip (``measure_cpu``)."""
    dev = jax.devices()[0]
    return hardware_for(dev.device_kind) if dev.platform == "tpu" else measure_cpu()


def measure_cpu(size: int = 1024, stream_mb: int = 256) -> Hardware:
    """This machine as one chip: matmul peak (jax f32 [size]^3, best of 3) and memory
    bandwidth (a numpy copy of ``stream_mb`` MiB: read + write, best of 3)."""
    import numpy as np

    x = jnp.ones((size, size), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm(x).block_until_ready()
    best = min(_timed(lambda: mm(x).block_until_ready()) for _ in range(3))
    flops = 2 * size**3 / best
    a = np.ones(stream_mb * 2**20 // 8)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(3))
    bw = 2 * a.nbytes / best
    return Hardware("cpu (measured)", flops, flops, bw, 0.0, 1, 1)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# Model sizes ----------------------------------------------------------------------------------
def _nbytes(tree) -> int:
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """Byte and parameter counts of one model, from its config.

    dense_bytes: non-expert weights of all layers (one DP replica), without embedding / lm_head.
    dense_params: matmul parameters a token multiplies in those layers.
    expert_bytes: one routed expert of one layer (gate_up + down, + FP8 scales).
    expert_params: matmul parameters of one routed expert.
    lm_head_bytes / lm_head_params: the output projection.
    """

    dense_bytes: int
    dense_params: int
    expert_bytes: int
    expert_params: int
    lm_head_bytes: int
    lm_head_params: int


def model_sizes(cfg: ModelConfig, dtype: str = "bf16", expert_dtype: str = "bf16") -> ModelSizes:
    jdt = jnp.bfloat16 if DTYPE_BYTES[dtype] == 2 else jnp.float32
    dense_bytes = dense_params = expert_bytes = expert_params = 0
    for layer in range(cfg.num_hidden_layers):
        p = layer_param_shapes(cfg, layer, jdt, fp8_experts=expert_dtype == "fp8")
        experts = p["mlp"].pop("experts", None)
        dense_bytes += _nbytes(p)
        dense_params += sum(int(x.size) for x in jax.tree.leaves(p) if len(x.shape) >= 2)
        if experts is not None:
            expert_bytes = _nbytes(experts) // cfg.num_experts
            expert_params = sum(int(experts[k].size) for k in ("gate_up", "down")) // cfg.num_experts
    # Conv weights are [C, K] (not a matmul) but tiny; GDN conv FLOPs come from the cost model.
    V, H = cfg.vocab_size, cfg.hidden_size
    return ModelSizes(dense_bytes, dense_params, expert_bytes, expert_params,
                      V * H * DTYPE_BYTES[dtype], V * H)


def expert_coverage(num_tokens: float, num_experts: int, top_k: int) -> float:
    """Expected fraction of experts that ``num_tokens`` tokens touch, routing uniformly."""
    return 1.0 - (1.0 - top_k / num_experts) ** num_tokens


# One step ---------------------------------------------------------------------------------------
def step_terms(cfg: ModelConfig, *, tokens: int, seqs: int, kv_len: int, devices: int,
               logits_rows: int | None = None, decode: bool, dtype: str = "bf16",
               expert_dtype: str = "bf16", kv_dtype: str = "bf16", state_dtype: str = "bf16",
               gdn_chunk: int = 64) -> dict[str, float]:
    """FLOPs and HBM bytes of one step on one device, by term.

    tokens / seqs: token rows and requests on this device (its DP rank); every rank has the
    same, so the system routes ``tokens * devices`` tokens. kv_len: keys each token attends
    to (and KV tokens read per request). logits_rows: rows whose logits are computed
    (default one per request).
    """
    s = model_sizes(cfg, dtype, expert_dtype)
    L = cfg.num_hidden_layers
    n_attn = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    n_gdn = L - n_attn
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    K, E = cfg.num_experts_per_tok, cfg.num_experts
    rows = logits_rows if logits_rows is not None else seqs
    kvb, stb = DTYPE_BYTES[kv_dtype], DTYPE_BYTES[state_dtype]
    Hkv, D, Hq = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    local_experts = E / devices
    touched = expert_coverage(tokens * devices, E, K) * local_experts
    expert_rows = tokens * K  # this device's share of the system's routed rows
    gdn = gated_delta_net_cost(tokens, seqs, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                               cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                               conv_kernel=cfg.linear_conv_kernel_dim, decode=decode,
                               chunk_size=gdn_chunk, x_bytes=DTYPE_BYTES[dtype], state_bytes=stb)
    return {
        "dense_flops": 2.0 * tokens * s.dense_params,
        "expert_flops": 2.0 * expert_rows * s.expert_params * n_moe,
        "attention_flops": 4.0 * tokens * Hq * D * kv_len * n_attn,
        "gdn_flops": float(gdn.flops) * n_gdn,
        "lm_head_flops": 2.0 * rows * s.lm_head_params,
        "dense_weight_bytes": float(s.dense_bytes),
        "expert_weight_bytes": touched * s.expert_bytes * n_moe,
        "lm_head_bytes": float(s.lm_head_bytes),
        "kv_bytes": float(n_attn * (seqs * kv_len + tokens) * 2 * Hkv * D * kvb),
        "gdn_state_bytes": float(gdn.bytes_accessed) * n_gdn,
        "expert_rows": float(expert_rows),
        "touched_local_experts": touched,
    }


def verify_step_terms(cfg: ModelConfig, *, seqs: int, kv_len: int, devices: int,
                      num_draft_tokens: int, dtype: str = "bf16", expert_dtype: str = "bf16",
                      kv_dtype: str = "bf16", state_dtype: str = "bf16") -> dict[str, float]:
    """``step_terms`` of one TARGET_VERIFY step on one device: ``seqs`` requests of n =
    ``num_draft_tokens`` rows each, logits for every row; the GDN terms are the verify
    kernel's (one state read per request and layer, no state write) plus the commit's (the
    slot's state read and written, the n positions' FLOPs again: all n counted)."""
    n = num_draft_tokens
    t = step_terms(cfg, tokens=seqs * n, seqs=seqs, kv_len=kv_len, devices=devices,
                   logits_rows=seqs * n, decode=True, dtype=dtype, expert_dtype=expert_dtype,
                   kv_dtype=kv_dtype, state_dtype=state_dtype)
    n_gdn = sum(t != FULL_ATTENTION for t in cfg.layer_types)
    heads = (seqs, n, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
             cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    kw = dict(conv_kernel=cfg.linear_conv_kernel_dim, x_bytes=DTYPE_BYTES[dtype],
              state_bytes=DTYPE_BYTES[state_dtype])
    v, c = gated_delta_net_verify_cost(*heads, **kw), gated_delta_net_commit_cost(*heads, **kw)
    t["gdn_flops"] = float(v.flops + c.flops) * n_gdn
    t["gdn_state_bytes"] = float(v.bytes_accessed + c.bytes_accessed) * n_gdn
    return t


def mtp_step_terms(cfg: ModelConfig, *, tokens: int, seqs: int, kv_len: int, devices: int,
                   dtype: str = "bf16", expert_dtype: str = "bf16", kv_dtype: str = "bf16",
                   head: bool = True) -> dict[str, float]:
    """``step_terms`` of one MTP draft step on one device: ``tokens`` rows of ``seqs``
    requests through the ``fc`` [2H, H] and one full-attention MoE layer (its own KV of
    ``kv_len`` keys), then (``head``) the shared LM head for one row per request. Without
    ``head``: the MTP pass of a step none of whose requests drafts (its KV only)."""
    mtp = dataclasses.replace(cfg, num_hidden_layers=1, layer_types=(FULL_ATTENTION,))
    t = step_terms(mtp, tokens=tokens, seqs=seqs, kv_len=kv_len, devices=devices,
                   logits_rows=seqs if head else 0, decode=True, dtype=dtype,
                   expert_dtype=expert_dtype, kv_dtype=kv_dtype)
    fc = 2 * cfg.hidden_size * cfg.hidden_size
    t["dense_flops"] += 2.0 * tokens * fc
    t["dense_weight_bytes"] += float(fc * DTYPE_BYTES[dtype])
    return t


def totals(terms: dict[str, float]) -> tuple[float, float, float]:
    """(bf16 FLOPs, expert FLOPs, bytes) of a step_terms dict."""
    bf16 = sum(v for k, v in terms.items() if k.endswith("_flops") and k != "expert_flops")
    nbytes = sum(v for k, v in terms.items() if k.endswith("_bytes"))
    return bf16, terms["expert_flops"], nbytes


def step_seconds(terms: dict[str, float], hw: Hardware, expert_dtype: str) -> float:
    """max(compute, memory) time of one step on one device (device = chip / devices_per_chip)."""
    bf16, expert, nbytes = totals(terms)
    dev = hw.devices_per_chip
    expert_peak = (hw.fp8_flops if expert_dtype == "fp8" else hw.bf16_flops) / dev
    compute = bf16 / (hw.bf16_flops / dev) + expert / expert_peak
    return max(compute, nbytes / (hw.hbm_bandwidth / dev))


# Workload ceilings -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ceiling:
    tokens_per_s_per_chip: float  # total (input + output)
    output_tokens_per_s_per_chip: float
    prefill_s: float  # one cycle's prefill time
    decode_step_s: float  # one decode step at mean context
    decode_bound: str  # "memory" | "compute"
    prefill_terms: dict
    decode_terms: dict  # the decode (or, speculating, the verify) step's
    draft_s: float = 0.0  # speculating: the MTP draft steps of one decode step (in decode_step_s)
    tokens_per_step: float = 1.0  # tokens a request gains per decode step (the accept length)


def ceiling(cfg: ModelConfig, hw: Hardware, *, input_len: int, output_len: int, concurrency: int,
            num_chips: int, dtype: str = "bf16", expert_dtype: str = "bf16", kv_dtype: str = "bf16",
            state_dtype: str = "bf16", prefill_tokens_per_device: int = 8192,
            num_draft_tokens: int = 1, accept_length: float = 1.0) -> Ceiling:
    """The workload's ceiling (module docstring); ``num_draft_tokens`` > 1 speculates with
    MTP drafts, each step gaining ``accept_length`` tokens per request."""
    if num_draft_tokens > 1 and not 1.0 <= accept_length <= num_draft_tokens:
        raise ValueError(f"accept_length {accept_length} must lie in [1, {num_draft_tokens}]")
    devices = num_chips * hw.devices_per_chip
    per_dev = concurrency / devices  # requests per DP rank
    kw = dict(dtype=dtype, expert_dtype=expert_dtype, kv_dtype=kv_dtype, state_dtype=state_dtype)
    # Prefill: per_dev * input_len tokens per device, in steps of prefill_tokens_per_device.
    T = min(prefill_tokens_per_device, per_dev * input_len)
    n_steps = per_dev * input_len / T
    pre = step_terms(cfg, tokens=T, seqs=max(1, T / input_len), kv_len=input_len / 2, devices=devices,
                     decode=False, **kw)
    prefill_s = n_steps * step_seconds(pre, hw, expert_dtype)
    kv_len = input_len + output_len / 2
    draft_s, tokens_per_step = 0.0, 1.0
    if num_draft_tokens > 1:
        n = num_draft_tokens
        dec = verify_step_terms(cfg, seqs=per_dev, kv_len=kv_len, devices=devices,
                                num_draft_tokens=n, **kw)
        drafts = [mtp_step_terms(cfg, tokens=per_dev * (n if i == 0 else 1), seqs=per_dev,
                                 kv_len=kv_len, devices=devices, dtype=dtype,
                                 expert_dtype=expert_dtype, kv_dtype=kv_dtype)
                  for i in range(n - 1)]
        draft_s = sum(step_seconds(d, hw, expert_dtype) for d in drafts)
        tokens_per_step = accept_length
    else:
        dec = step_terms(cfg, tokens=per_dev, seqs=per_dev, kv_len=kv_len, devices=devices,
                         decode=True, **kw)
    step_s = step_seconds(dec, hw, expert_dtype) + draft_s
    bf16, ex, nbytes = totals(dec)
    dev = hw.devices_per_chip
    bound = "memory" if nbytes / (hw.hbm_bandwidth / dev) >= bf16 / (hw.bf16_flops / dev) else "compute"
    cycle = prefill_s + output_len / tokens_per_step * step_s
    total = concurrency * (input_len + output_len) / cycle / num_chips
    out = concurrency * output_len / cycle / num_chips
    return Ceiling(total, out, prefill_s, step_s, bound, pre, dec, draft_s, tokens_per_step)


def load_config(path: str | Path) -> ModelConfig:
    return model_config_from_dict(json.loads(Path(path).read_text()))


def _fmt(terms: dict) -> str:
    return "\n".join(f"    {k:24s} {v / (1e9 if 'flops' in k or 'bytes' in k else 1):12.3f}"
                     + (" G" if ("flops" in k or "bytes" in k) else "") for k, v in terms.items())


def main(argv=None) -> Ceiling:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default=str(CONFIG_397B))
    p.add_argument("--hardware", choices=[*HARDWARE, "cpu", "auto"], default="tpu7x",
                   help="peaks to plan with; auto: the TPU this process runs on (its "
                        "device_kind), else this machine measured")
    p.add_argument("--num-chips", type=int, default=None, help="default: one host of the hardware")
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--expert-dtype", choices=("bf16", "fp8"), default=None,
                   help="default: the config's dtype")
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--state-dtype", default="bf16")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=1,
                   help="n = k+1 rows verified per request and step (1: no speculation)")
    p.add_argument("--accept-length", type=float, default=None,
                   help="tokens a request gains per verify step, 1..n (default: n)")
    a = p.parse_args(argv)
    cfg = load_config(a.model_config)
    raw = json.loads(Path(a.model_config).read_text())
    cfg_dtype = (raw.get("text_config", raw).get("dtype") or raw.get("torch_dtype") or "bfloat16")
    expert_dtype = a.expert_dtype or ("fp8" if "8" in str(cfg_dtype) else "bf16")
    hw = (measure_cpu() if a.hardware == "cpu" else this_hardware() if a.hardware == "auto"
          else HARDWARE[a.hardware])
    chips = a.num_chips or hw.chips_per_host
    kw = dict(input_len=a.input_len, output_len=a.output_len, concurrency=a.concurrency,
              num_chips=chips, expert_dtype=expert_dtype, kv_dtype=a.kv_dtype,
              state_dtype=a.state_dtype)
    n = a.speculative_num_draft_tokens
    accept = a.accept_length if a.accept_length is not None else float(n)
    try:
        c = ceiling(cfg, hw, num_draft_tokens=n, accept_length=accept, **kw)
    except ValueError as e:
        p.error(str(e))
    print(f"hardware {hw.name}: {chips} chips x {hw.devices_per_chip} devices, "
          f"bf16 {hw.bf16_flops / 1e12:.1f} / fp8 {hw.fp8_flops / 1e12:.1f} TFLOP/s per chip, "
          f"HBM {hw.hbm_bandwidth / 1e12:.2f} TB/s per chip")
    print(f"workload: {a.input_len} in / {a.output_len} out, concurrency {a.concurrency}, "
          f"experts {expert_dtype}, KV {a.kv_dtype}, GDN state {a.state_dtype}")
    print(f"  prefill step terms (per device):\n{_fmt(c.prefill_terms)}")
    what = "verify" if n > 1 else "decode"
    print(f"  {what} step terms (per device):\n{_fmt(c.decode_terms)}")
    print(f"prefill time per cycle {c.prefill_s:.3f} s; decode step {c.decode_step_s * 1e3:.2f} ms "
          f"({c.decode_bound}-bound)")
    if n > 1:
        plain = ceiling(cfg, hw, **kw)
        print(f"speculating: {n} rows verified per request, accept length {accept:.2f}; step "
              f"{c.decode_step_s * 1e3:.2f} ms (MTP drafts {c.draft_s * 1e3:.2f} ms) against "
              f"{plain.decode_step_s * 1e3:.2f} ms without; {accept / c.decode_step_s:.0f} "
              f"against {1 / plain.decode_step_s:.0f} tokens/s per request")
        print(f"ceiling without speculation: {plain.tokens_per_s_per_chip:.0f} total tok/s/chip")
        devices = chips * hw.devices_per_chip
        per_dev = a.concurrency / devices
        pass_only = step_seconds(mtp_step_terms(
            cfg, tokens=per_dev, seqs=per_dev, kv_len=a.input_len + a.output_len / 2,
            devices=devices, expert_dtype=expert_dtype, kv_dtype=a.kv_dtype, head=False),
            hw, expert_dtype)
        print(f"backed off (every request's drafts paused: a decode step and the MTP pass, no "
              f"chain): {(plain.decode_step_s + pass_only) * 1e3:.2f} ms, "
              f"x{plain.decode_step_s / (plain.decode_step_s + pass_only):.3f} of the plain rate")
    print(f"ceiling: {c.tokens_per_s_per_chip:.0f} total tok/s/chip, "
          f"{c.output_tokens_per_s_per_chip:.0f} output tok/s/chip")
    measured = PUBLISHED.get((a.input_len, a.output_len))
    if measured and a.hardware == "tpu7x" and a.concurrency == 64 and chips == 4:
        spec = " (published without speculation)" if n > 1 else ""
        print(f"published: {measured:.0f} tok/s/chip -> implied efficiency "
              f"{measured / c.tokens_per_s_per_chip:.1%} of this ceiling{spec}")
    return c


if __name__ == "__main__":
    main()
