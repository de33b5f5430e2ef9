"""A decode step against this machine's roofline, and where the time goes.

The model (``--config mid``: hidden 1024, 16 layers, 64 experts top-8, fp32; ``--config tiny``:
the embedded default's shapes) gets random weights in the runner's layout, and a decode step
of ``--num-requests`` requests at ``--context`` tokens each runs through
``ModelRunner.forward`` (the jitted forward, ``impl="auto"``: the XLA paths on CPU).

Roofline: this machine's matmul peak (a jitted f32 1024^3 matmul) and memory bandwidth (a
streaming copy, read + write), measured in this run; each kernel group of the cost model
(``roofline.step_terms``: dense matmuls, routed experts, attention, GDN, lm_head) costs
max(bytes / bandwidth, FLOPs / peak), and the step's roofline time is their sum. Efficiency =
roofline time / measured step time.
The mixers' projections are counted with their mixer (as the measurement below removes
them together), the router and shared expert with the rest.

Where the time goes: the step is timed again with the routed experts, the GDN mixers or the
attention mixers replaced by nothing (each variant compiled once, then all timed in turns); a part's
measured time is the full step minus the step without it, "rest" is what is left (router,
shared expert, norms, embedding, lm_head, the layer loop). Printed per part beside its
roofline time. (A removed part's now-unused inputs may be dropped too, e.g. the router with
the routed experts: a part's time is then slightly overstated and the rest's understated.)

With ``--prefill-len N`` the step is a prefill instead: ``--num-requests`` fresh prompts of N
tokens each in one MIXED step (as the engine's chunked prefill runs them).

    JAX_PLATFORMS=cpu python benchmarks/bench_cpu_roofline.py --config mid
    JAX_PLATFORMS=cpu python benchmarks/bench_cpu_roofline.py --config mid --num-requests 4 --prefill-len 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.model_executor.model_runner import ModelRunner
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.models.param_shapes import param_shapes
from sglang_tpu_backend.planning import roofline

from bench_vs_transformers import make_config  # benchmarks/ is the script's path

PAGE = 16


def random_params(cfg, seed: int = 0):
    """f32 params in the runner's layout: N(0, 1/fan_in) matrices, unit norms, A_log in
    [0, log 16) (decays that neither vanish nor explode)."""
    shapes = param_shapes(cfg, jnp.float32)
    leaves, tree = jax.tree.flatten_with_path(shapes)
    key = jax.random.key(seed)
    out = []
    for i, (path, s) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        k = jax.random.fold_in(key, i)
        if "A_log" in name:
            x = jax.random.uniform(k, s.shape, jnp.float32, 0.0, float(np.log(16.0)))
        elif len(s.shape) <= 2 and "norm" in name:
            x = jnp.ones(s.shape, jnp.float32)
        else:
            x = jax.random.normal(k, s.shape, jnp.float32) / np.sqrt(s.shape[-2] if len(s.shape) > 1 else 1)
        out.append(x.astype(s.dtype))
    return jax.tree.unflatten(tree, out)


def decode_batch(num_requests: int, context: int, pages_per_seq: int, vocab: int) -> ForwardBatch:
    """Every request at ``context`` tokens with one new token; request r owns pages
    r * pages_per_seq onwards and state slot r."""
    R = num_requests
    rng = np.random.default_rng(1)
    return ForwardBatch(
        input_ids=rng.integers(3, vocab, R).astype(np.int32),
        positions=np.full(R, context, np.int32),
        cu_q_lens=np.arange(R + 1, dtype=np.int32),
        kv_lens=np.full(R, context + 1, np.int32),
        page_table=(np.arange(R)[:, None] * pages_per_seq + np.arange(pages_per_seq)).astype(np.int32),
        state_slots=np.arange(R, dtype=np.int32),
        num_seqs=np.array([R], np.int32),
        logits_indices=np.arange(R, dtype=np.int32),
        mode=ForwardMode.DECODE,
    )


def prefill_batch(num_requests: int, prompt_len: int, pages_per_seq: int, vocab: int) -> ForwardBatch:
    """``num_requests`` fresh prompts of ``prompt_len`` tokens; request r owns pages
    r * pages_per_seq onwards and state slot r; each returns its last row's logits."""
    R, n = num_requests, prompt_len
    rng = np.random.default_rng(1)
    return ForwardBatch(
        input_ids=rng.integers(3, vocab, R * n).astype(np.int32),
        positions=np.tile(np.arange(n, dtype=np.int32), R),
        cu_q_lens=(np.arange(R + 1) * n).astype(np.int32),
        kv_lens=np.full(R, n, np.int32),
        page_table=(np.arange(R)[:, None] * pages_per_seq + np.arange(pages_per_seq)).astype(np.int32),
        state_slots=np.arange(R, dtype=np.int32),
        num_seqs=np.array([R], np.int32),
        logits_indices=(np.arange(1, R + 1) * n - 1).astype(np.int32),
        mode=ForwardMode.MIXED,
    )


def step_seconds(runner: ModelRunner, fb: ForwardBatch) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(runner.forward([fb]))
    return time.perf_counter() - t0


FAKES = {  # part -> (model function, stand-in that passes its input through)
    "routed experts": ("routed_experts", lambda experts, x, *a, **k: jnp.zeros_like(x)),
    "gdn": ("gdn_block", lambda p, h, conv, rec, *a, **k: (h, conv, rec)),
    "attention": ("attention_block", lambda p, h, kv, scales, *a, **k: (h, kv, scales)),
}


def compiled_forward(runner: ModelRunner, fb: ForwardBatch, without: str | None = None):
    """A jitted forward (the model with part ``without`` replaced by its stand-in), traced and
    compiled now, so the patch can be undone and the variants timed in turns."""
    def forward(params, cache, batch, cfg, impl, with_stats=False, batch_invariant=False):
        return qwen3_5_moe.forward(params, cache, batch, cfg, impl, with_stats=with_stats,
                                   batch_invariant=batch_invariant)

    # A new function per variant: jax caches traces per function, so reusing
    # qwen3_5_moe.forward would hand every variant the first one's trace.
    fn = jax.jit(forward, static_argnames=("cfg", "impl", "with_stats", "batch_invariant"),
                 donate_argnames=("cache",))
    real = None
    if without is not None:
        name, fake = FAKES[without]
        real = getattr(qwen3_5_moe, name)
        setattr(qwen3_5_moe, name, fake)
    try:
        runner.backend.forward_fn = fn
        jax.block_until_ready(runner.forward([fb]))
    finally:
        if real is not None:
            setattr(qwen3_5_moe, name, real)
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=("tiny", "mid"), default="mid")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=96, help="tokens already in each request")
    ap.add_argument("--prefill-len", type=int, default=0,
                    help="time a prefill of --num-requests prompts of this many tokens instead")
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    cfg = make_config(args.config)
    R, ctx, n = args.num_requests, args.context, args.prefill_len
    T = R * n if n else R  # token rows in the step
    pages_per_seq = -(-(n or ctx + 1) // PAGE)
    runner = ModelRunner(cfg, random_params(cfg), page_size=PAGE, num_pages=R * pages_per_seq + 1,
                         num_state_slots=R, max_running_requests=R, max_tokens_per_step=T,
                         context_length=pages_per_seq * PAGE, kv_dtype=jnp.float32,
                         router_stats=False)
    fb = (prefill_batch(R, n, runner.pages_per_seq, cfg.vocab_size) if n
          else decode_batch(R, ctx, runner.pages_per_seq, cfg.vocab_size))
    # The runner's page table is context_length / page wide: pad ours to it.
    fb = ForwardBatch(**{**{f: getattr(fb, f) for f in ForwardBatch.__dataclass_fields__},
                         "page_table": np.pad(fb.page_table, ((0, 0), (0, runner.pages_per_seq - pages_per_seq)))})

    hw = roofline.measure_cpu()
    terms = roofline.step_terms(cfg, tokens=T, seqs=R, kv_len=n / 2 if n else ctx + 1, devices=1,
                                logits_rows=R, decode=not n, dtype="f32", expert_dtype="f32",
                                kv_dtype="f32", state_dtype="f32")
    proj = dense_params_by_part(cfg)  # the mixers' projections go with their mixer
    mm = lambda p: (2.0 * T * p, 4.0 * p)  # noqa: E731  f32 matmul of T rows: (FLOPs, weight bytes)
    kernels = {  # part -> [(FLOPs, bytes) per kernel group]
        "routed experts": [(terms["expert_flops"], terms["expert_weight_bytes"])],
        "gdn": [(terms["gdn_flops"], terms["gdn_state_bytes"]), mm(proj["gdn"])],
        "attention": [(terms["attention_flops"], terms["kv_bytes"]), mm(proj["attention"])],
        "rest": [mm(proj["rest"]), (terms["lm_head_flops"], terms["lm_head_bytes"])],
    }
    roof = {k: sum(max(b / hw.hbm_bandwidth, f / hw.bf16_flops) for f, b in v)
            for k, v in kernels.items()}

    variants = {part: compiled_forward(runner, fb, part) for part in (None, *FAKES)}
    times = {part: [] for part in variants}
    for _ in range(args.steps):  # in turns, so machine noise hits every variant alike
        for part, fn in variants.items():
            runner.backend.forward_fn = fn
            times[part].append(step_seconds(runner, fb))
    median = {part: statistics.median(t) for part, t in times.items()}
    full = median[None]
    measured = {part: full - median[part] for part in FAKES}
    measured["rest"] = full - sum(measured.values())
    total_roof = sum(roof.values())
    what = f"prefill of {R} x {n} tokens" if n else f"decode of {R} requests at context {ctx}"
    print(f"config={args.config} {what} fp32 backend={jax.default_backend()}")
    print(f"measured peaks: matmul {hw.bf16_flops / 1e9:.0f} GFLOP/s, bandwidth {hw.hbm_bandwidth / 1e9:.1f} GB/s")
    print(f"{'part':16s} {'GFLOP':>8s} {'MB':>9s} {'roofline ms':>12s} {'measured ms':>12s} {'efficiency':>11s}")
    for k, v in kernels.items():
        f, b = sum(x[0] for x in v), sum(x[1] for x in v)
        print(f"{k:16s} {f / 1e9:8.2f} {b / 1e6:9.1f} {roof[k] * 1e3:12.2f} {measured[k] * 1e3:12.2f} "
              f"{roof[k] / measured[k]:11.1%}")
    print(f"{'prefill' if n else 'decode'} step: measured {full * 1e3:.1f} ms, roofline {total_roof * 1e3:.1f} ms "
          f"-> efficiency {total_roof / full:.1%}")


def dense_params_by_part(cfg) -> dict[str, int]:
    """Matmul parameters (2-D weights) of every layer by part: the attention and GDN mixers'
    projections, and the rest (router, shared expert and its gate; dense MLPs)."""
    from sglang_tpu_backend.models.param_shapes import layer_param_shapes

    out = {"attention": 0, "gdn": 0, "rest": 0}
    for layer in range(cfg.num_hidden_layers):
        p = layer_param_shapes(cfg, layer, jnp.float32)
        p["mlp"].pop("experts", None)
        count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)  # noqa: E731
                                 if len(x.shape) == 2 and min(x.shape) > cfg.linear_conv_kernel_dim)
        out["attention"] += count(p.get("self_attn", {}))
        out["gdn"] += count(p.get("linear_attn", {}))
        out["rest"] += count(p["mlp"])
    return out


if __name__ == "__main__":
    main()
