"""A 16-bit model keeps its KV pages and conv states in f32 on a CPU, and loses no accuracy.

XLA:CPU converts a whole bf16 array to f32 for every scatter into it, so the engine stores
these caches in f32 there (``config.cache_storage_dtype``). The values stored are the
step's own (computed in bf16, which XLA:CPU may carry in f32 between ops), no longer rounded
to bf16 on the way into the cache: the logits move within bf16 noise, and no further from an
f32 run of the same weights than a bf16 cache's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.config import load_model_config
from sglang_tpu_backend.loader import load_model
from sglang_tpu_backend.mem_budget import size_pools
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.config import cache_storage_dtype
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.tiny_model import default_model_path

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
