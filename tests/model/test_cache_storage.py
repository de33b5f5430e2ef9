"""A 16-bit model keeps its KV pages and conv states in f32 on a CPU, and loses no accuracy.

XLA:CPU converts a whole bf16 array to f32 for every scatter into it, so the engine stores
these caches in f32 there (``config.cache_storage_dtype``). The values stored are the
step's own (computed in bf16, which XLA:CPU may carry in f32 between ops), no longer rounded
to bf16 on the way into the cache: the logits move within bf16 noise, and no further from an
f32 run of the same weights than a bf16 cache's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.config import load_model_config
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.planning.mem_budget import size_pools
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.config import cache_storage_dtype
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.model_loader.tiny_model import default_model_path

PAGE = 8
BUCKETS = dict(num_tokens=32, num_seqs=4, pages_per_seq=4, num_logits=4)


def test_storage_dtype_choice():
    assert cache_storage_dtype(jnp.bfloat16, "cpu") == jnp.float32
    assert cache_storage_dtype(jnp.float16, "cpu") == jnp.float32
    assert cache_storage_dtype(jnp.float32, "cpu") == jnp.float32
    assert cache_storage_dtype(jnp.bfloat16, "tpu") == jnp.bfloat16
    assert cache_storage_dtype(jnp.float8_e4m3fn, "cpu") == jnp.float8_e4m3fn


def test_bf16_model_with_f32_cache_is_as_accurate():
    cfg, params = load_model(default_model_path(), dtype=jnp.bfloat16)
    params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)  # the same weights
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (13, 9)]
    pages = [list(range(0, 4)), list(range(4, 8))]

    def run(params, kv_dtype):
        cache = init_cache(cfg, num_pages=9, page_size=PAGE, num_state_slots=2, kv_dtype=kv_dtype)
        outs = []
        steps = [[SeqChunk(p, 0, pg, i) for i, (p, pg) in enumerate(zip(prompts, pages))]]
        for t in range(4):  # then decode steps, each request fed a fixed token
            steps.append([SeqChunk([5 + t + i], len(prompts[i]) + t, pages[i], i) for i in range(2)])
        for chunks in steps:
            batch, rows = build_forward_batch(chunks, page_size=PAGE, mode=ForwardMode.MIXED,
                                              **BUCKETS)  # one program for every step
            logits, cache = forward_jit(params, cache, batch, cfg, impl="auto")
            outs.append(np.asarray(logits)[np.concatenate(rows)])
        assert cache.kv_pages.dtype == kv_dtype and cache.conv_state.dtype == kv_dtype
        return outs

    exact = run(params32, jnp.float32)
    bf16_cache, f32_cache = run(params, jnp.bfloat16), run(params, jnp.float32)
    for step, (e, a, b) in enumerate(zip(exact, bf16_cache, f32_cache)):
        err_bf16, err_f32 = np.abs(a - e).max(), np.abs(b - e).max()
        print(f"step {step}: max |logit - f32 run| bf16 cache {err_bf16:.4f}, f32 cache {err_f32:.4f}")
        assert np.abs(a - b).max() < 0.05
        assert err_f32 <= 1.25 * err_bf16 + 1e-3
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU storage rule")
def test_memory_budget_counts_the_stored_bytes():
    cfg = load_model_config(default_model_path())
    args = dict(page_size=16, max_running_requests=4, chunked_prefill_size=64, context_length=128,
                skip_warmup=True, mem_fraction_static=0.5)
    bf16 = size_pools(cfg, ServerArgs(**args, dtype="bfloat16"), 64 << 20)
    f32 = size_pools(cfg, ServerArgs(**args, dtype="float32"), 64 << 20)
    assert bf16.page_bytes == f32.page_bytes
    assert bf16.state == f32.state  # conv states f32 too (the recurrent state always is)


# --- --kv-cache-dtype fp8_e4m3: float8_e4m3fn pages with per-row scales --------------------

HELD_OUT = ["The lighthouse keeper counted ships until the fog rolled in.",
            "def merge(a, b): return sorted(a + b)"]
DECODE_STEPS = 10


def _greedy_logprobs(cfg, params, prompts, kv_dtype, forced=None, drop_scales=False):
    """Prefill ``prompts`` in one step, then DECODE_STEPS decode steps; each step feeds the
    greedy token of this run, or ``forced`` [steps][req] tokens. Returns (chosen tokens
    [steps][req], their logprobs, the run's own argmax) for every step's next-token logits.
    ``drop_scales``: a broken cache that writes scaled rows but reads them with scale 1."""
    # The pool of test_bf16_model_with_f32_cache_is_as_accurate: its f32 program is reused.
    pages = [list(range(4 * i, 4 * i + 4)) for i in range(len(prompts))]
    cache = init_cache(cfg, num_pages=9, page_size=PAGE, num_state_slots=2, kv_dtype=kv_dtype)
    chosen, logprobs, argmax = [], [], []
    chunks = [SeqChunk(p, 0, pg, i) for i, (p, pg) in enumerate(zip(prompts, pages))]
    for step in range(DECODE_STEPS + 1):
        batch, rows = build_forward_batch(chunks, page_size=PAGE, mode=ForwardMode.MIXED,
                                          **BUCKETS)
        logits, cache = forward_jit(params, cache, batch, cfg, impl="auto")
        if drop_scales:
            cache = dataclasses.replace(cache, kv_scales=jnp.ones_like(cache.kv_scales))
        lp = np.asarray(jax.nn.log_softmax(logits[np.concatenate(rows)], axis=-1))
        argmax.append(lp.argmax(-1))
        tok = argmax[-1] if forced is None else np.asarray(forced[step])
        chosen.append(tok)
        logprobs.append(lp[np.arange(len(prompts)), tok])
        ctx = [c.context_len + len(c.token_ids) for c in chunks]
        chunks = [SeqChunk([int(tok[i])], ctx[i], pages[i], i) for i in range(len(prompts))]
    return np.array(chosen), np.array(logprobs), np.array(argmax)


def test_fp8_kv_cache_accuracy_on_held_out_prompts():
    """The float32 tiny model with an FP8 KV cache vs its f32 cache (auto), teacher-forced on
    the auto run's greedy tokens: the chosen tokens' logprobs move little and the greedy
    choices agree. A cache whose scales are ignored on read breaks the bound."""
    from sglang_tpu_backend.tokenizer import load_tokenizer

    cfg, params = load_model(default_model_path(), dtype=jnp.float32)
    tok = load_tokenizer(default_model_path())
    prompts = [tok.encode(t)[:12] for t in HELD_OUT]  # 12 + 11 tokens: 3 of 4 pages
    tokens, lp_auto, _ = _greedy_logprobs(cfg, params, prompts, jnp.float32)
    _, lp_fp8, argmax_fp8 = _greedy_logprobs(cfg, params, prompts, jnp.float8_e4m3fn, tokens)
    _, lp_broken, _ = _greedy_logprobs(cfg, params, prompts, jnp.float8_e4m3fn, tokens,
                                       drop_scales=True)
    err, broken = np.abs(lp_fp8 - lp_auto).max(), np.abs(lp_broken - lp_auto).max()
    agree = float(np.mean(argmax_fp8 == tokens))
    print(f"fp8 KV vs auto over {tokens.size} tokens: max |dlogprob| {err:.2e}, greedy "
          f"agreement {agree:.3f}; scales ignored on read: max |dlogprob| {broken:.2e}")
    assert err < 0.1  # measured 0.015 (f32 model, f32 vs fp8 cache)
    assert agree >= 0.9  # measured 21 of 22: one near-tie of the random tiny model flips
    assert broken > 0.3  # measured 1.06: the bound tells a broken scale apart


def test_fp8_kv_cache_layout_and_budget():
    cfg = load_model_config(default_model_path())
    cache = init_cache(cfg, num_pages=5, page_size=PAGE, num_state_slots=2,
                       kv_dtype=jnp.float8_e4m3fn, state_dtype=jnp.float32)
    L, N, H2, S, _ = cache.kv_pages.shape
    assert cache.kv_scales.shape == (L, N, H2, S) and cache.kv_scales.dtype == jnp.float32
    assert cache.conv_state.dtype == jnp.float32  # not fp8: the conv state stays exact
    assert init_cache(cfg, num_pages=5, page_size=PAGE, num_state_slots=2).kv_scales is None
    args = dict(page_size=16, max_running_requests=4, chunked_prefill_size=64, context_length=128,
                skip_warmup=True, mem_fraction_static=0.5, dtype="float32")
    auto = size_pools(cfg, ServerArgs(**args), 64 << 20)
    fp8 = size_pools(cfg, ServerArgs(**args, kv_cache_dtype="fp8_e4m3"), 64 << 20)
    D = cfg.head_dim
    assert fp8.page_bytes * 4 * D == auto.page_bytes * (D + 4)  # 1 B/element + f32 scale/row
    assert fp8.num_pages_per_rank > auto.num_pages_per_rank
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="fp8")


def test_fp8_kv_cache_refuses_handover():
    """The handover state (kv, conv, rec) has no scales: an FP8 cache is refused by the state
    transfer, and a prefill / decode engine refuses the flag before loading anything."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.model_executor.state_transfer import StateTransfer

    cfg = load_model_config(default_model_path())
    cache = init_cache(cfg, num_pages=4, page_size=PAGE, num_state_slots=2,
                       kv_dtype=jnp.float8_e4m3fn)
    transfer = StateTransfer(4, 2)
    with pytest.raises(NotImplementedError, match="kv-cache-dtype"):
        transfer.gather(cache, [0], 0)
    with pytest.raises(NotImplementedError, match="kv-cache-dtype"):
        transfer.scatter(cache, *transfer.empty_state(cache, 1), [0], 0)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3: a decode replica"):
        Engine(role="decode", kv_cache_dtype="fp8_e4m3", skip_warmup=True, start_loop=False)
