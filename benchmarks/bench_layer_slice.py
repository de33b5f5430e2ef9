"""A few real Qwen3.5-397B layers on one chip: the per-chip decode step, timed, against the
planner's prediction for the chip it runs on.

    python benchmarks/bench_layer_slice.py                       # on a TPU chip
    JAX_PLATFORMS=cpu python benchmarks/bench_layer_slice.py --preset tiny --impl xla

The slice is what one chip of a DP8 x EP8 host runs per step: ``--layers`` layers of the 397B
config in its layer pattern (default 4 = one period: 3 Gated DeltaNet + 1 gated attention),
the 64 routed experts this chip holds (of 512), the embedding and the LM head, ``--requests``
decode requests (one token each) at ``--context`` tokens of KV in pages of ``--page``, GDN
state in ``--state-dtype``, routed experts in ``--expert-dtype`` (FP8 by default: with bf16
experts, f32 state and the 2 GB embedding and head, 4 layers overflow a v5e's 16 GiB). The
expert-parallel collectives are absent: one chip is one device; its routing (sort, gather,
combine) runs. Weights are random (``sharded_loader.dummy_params``), the cache zeroed, the
batch a full decode bucket (every request real, context ``--context - 1`` plus the new token).

Prints the device's median step time (``device_timing.py``: three runs of ``--iters`` steps
back to back after warm-up, less one step waited for alone, so the host's wait for a result
(1.5 ms more a step on a v5e) is not in it, as it is not between the layers of a real step;
the cache donated and fed back, as the runner does), a step waited for alone, the planner's
prediction
(``planning/roofline.py``: ``step_terms`` for these layers, ``step_seconds`` on this chip's
peaks: max of compute and HBM time) and the ratio predicted / measured (the fraction of the
predicted speed reached; target >= 0.7). The planner's figure for a whole Ironwood host is
then restated at that measured efficiency.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from sglang_tpu_backend.config import ModelConfig, load_model_config  # noqa: E402
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from sglang_tpu_backend.model_loader.sharded_loader import dummy_params  # noqa: E402
from sglang_tpu_backend.model_loader.tiny_model import ASSET_DIR  # noqa: E402
from sglang_tpu_backend.models import qwen3_5_moe  # noqa: E402
from sglang_tpu_backend.models.param_shapes import param_shapes  # noqa: E402
from sglang_tpu_backend.planning import roofline  # noqa: E402
from device_timing import device_ms  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def slice_config(cfg: ModelConfig, layers: int, local_experts: int) -> ModelConfig:
    """``layers`` layers of ``cfg`` in its layer pattern, with the experts one chip holds."""
    kinds = cfg.layer_types[:cfg.layer_period]
    return dataclasses.replace(cfg, num_hidden_layers=layers, num_experts=local_experts,
                               layer_types=tuple(kinds[i % len(kinds)] for i in range(layers)))


def decode_batch(requests: int, context: int, page: int, vocab: int) -> ForwardBatch:
    """A full decode bucket: request r holds pages r*P .. r*P + P - 1 (P = context / page),
    state slot r, ``context - 1`` cached tokens and one new one at position context - 1."""
    pages = -(-context // page)
    rng = np.random.default_rng(0)
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    return ForwardBatch(
        input_ids=i32(rng.integers(0, vocab, requests)),
        positions=i32(np.full(requests, context - 1)),
        cu_q_lens=i32(np.arange(requests + 1)),
        kv_lens=i32(np.full(requests, context)),
        page_table=i32(np.arange(requests * pages).reshape(requests, pages)),
        state_slots=i32(np.arange(requests)),
        num_seqs=i32([requests]),
        logits_indices=i32(np.arange(requests)),
        mode=ForwardMode.DECODE)


def build(cfg: ModelConfig, args):
    """(step, params, cache, batch) on the first device: step(params, cache, batch) ->
    (logits f32[R, V], cache), jitted with the cache donated."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    rep = NamedSharding(mesh, PartitionSpec())
    fp8 = args.expert_dtype == "fp8"
    shapes = param_shapes(cfg, jnp.bfloat16, fp8_experts=fp8)
    params = dummy_params(cfg, jax.tree.map(lambda _: rep, shapes), fp8_experts=fp8)
    pages = args.requests * -(-args.context // args.page)
    cache = qwen3_5_moe.init_cache(cfg, num_pages=pages, page_size=args.page,
                                   num_state_slots=args.requests,
                                   state_dtype=DTYPES[args.state_dtype])
    batch = decode_batch(args.requests, args.context, args.page, cfg.vocab_size)
    step = jax.jit(lambda p, c, b: qwen3_5_moe.forward(p, c, b, cfg, args.impl),
                   donate_argnums=(1,))
    return step, params, cache, batch


def time_steps(step, params, cache, batch, warmup: int, iters: int):
    """The device's ms per step (median, min; ``device_timing.device_ms``: three runs of
    ``iters`` steps back to back, one step waited for alone taken away), the median ms of a
    step waited for alone, and the last step's logits. ``warmup`` steps first (the first
    compiles); the cache is fed back each step."""
    state = {"cache": cache}

    def dispatch():
        logits, state["cache"] = step(params, state["cache"], batch)
        state["logits"] = logits
        return logits, state["cache"]

    for _ in range(max(warmup, 1)):
        jax.block_until_ready(dispatch())
    med, mn, waited = device_ms(dispatch, max(iters, 2))
    return med, mn, waited, state["logits"]


def predicted_ms(cfg: ModelConfig, hw: roofline.Hardware, args) -> tuple[float, dict]:
    """The planner's step time for this slice on one device of ``hw`` (the EP system's
    tokens: ``--requests`` per device on ``--ep`` devices route over ``--ep`` times the
    local experts), and its terms."""
    full = dataclasses.replace(cfg, num_experts=cfg.num_experts * args.ep)
    terms = roofline.step_terms(full, tokens=args.requests, seqs=args.requests,
                                kv_len=args.context, devices=args.ep, decode=True,
                                expert_dtype=args.expert_dtype, state_dtype=args.state_dtype)
    chip = dataclasses.replace(hw, devices_per_chip=1)
    return 1e3 * roofline.step_seconds(terms, chip, args.expert_dtype), terms


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=["397b", "tiny"], default="397b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel devices of the host")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--expert-dtype", choices=["bf16", "fp8"], default="fp8")
    ap.add_argument("--state-dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--impl", default="auto", help="kernels/dispatch.py: auto, pallas, xla")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json-out")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    base = (roofline.load_config(roofline.CONFIG_397B) if args.preset == "397b"
            else load_model_config(ASSET_DIR))
    cfg = slice_config(base, args.layers, max(1, base.num_experts // args.ep))
    dev = jax.devices()[0]
    hw = roofline.hardware_for(dev.device_kind) if dev.platform == "tpu" else roofline.this_hardware()
    t0 = time.perf_counter()
    step, params, cache, batch = build(cfg, args)
    measured, fastest, waited, logits = time_steps(step, params, cache, batch, args.warmup,
                                                   args.iters)
    pred, terms = predicted_ms(cfg, hw, args)
    out = dict(device_kind=dev.device_kind, layers=args.layers, local_experts=cfg.num_experts,
               requests=args.requests, context=args.context, page=args.page,
               expert_dtype=args.expert_dtype, state_dtype=args.state_dtype,
               measured_ms=measured, min_ms=fastest, waited_ms=waited, predicted_ms=pred,
               ratio=pred / measured, finite=bool(jnp.isfinite(logits).all()),
               seconds=time.perf_counter() - t0, terms=terms)
    print(f"{args.layers}-layer slice ({cfg.num_experts} local experts, {args.expert_dtype} "
          f"experts, {args.state_dtype} state), {args.requests} requests x {args.context} "
          f"tokens, page {args.page}, on {dev.device_kind}: measured {measured:.3f} ms "
          f"(min {fastest:.3f}; waited for alone {waited:.3f}), predicted {pred:.3f} ms, "
          f"predicted / measured {pred / measured:.2f}; logits finite: {out['finite']}")
    _restate_ironwood(out, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return out


def _restate_ironwood(out: dict, args) -> None:
    """The planner's whole-model decode step on one Ironwood TensorCore (60 layers, same
    requests and context), and that figure at the efficiency measured here."""
    full = roofline.load_config(roofline.CONFIG_397B)
    hw = roofline.hardware_for("TPU7x")
    terms = roofline.step_terms(full, tokens=args.requests, seqs=args.requests,
                                kv_len=args.context, devices=args.ep, decode=True,
                                expert_dtype=args.expert_dtype, state_dtype=args.state_dtype)
    ms = 1e3 * roofline.step_seconds(terms, hw, args.expert_dtype)
    out.update(ironwood_predicted_ms=ms, ironwood_at_measured_efficiency_ms=ms / out["ratio"])
    print(f"Ironwood (TPU7x), all {full.num_hidden_layers} layers, {args.ep} TensorCores: "
          f"planner {ms:.2f} ms a decode step; at the efficiency measured here "
          f"{ms / out['ratio']:.2f} ms")


if __name__ == "__main__":
    main()
