"""The whole model on the Pallas kernels (TPU interpret mode on CPU) matches the reference path.

One prefill and 8 decode steps of two requests of the embedded tiny default model, fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.model_loader.tiny_model import default_model_path
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache

pytestmark = pytest.mark.jax_versions  # the model forward on the Pallas kernels, both jax legs

PAGE = 16
DECODE_STEPS = 8


def run_steps(cfg, params, prompts, impl):
    cache = init_cache(cfg, num_pages=16, page_size=PAGE, num_state_slots=4,
                       kv_dtype=jnp.float32, state_dtype=jnp.float32)
    pages = [list(range(0, 8)), list(range(8, 16))]
    chunks = [SeqChunk(p, 0, pages[i], i + 1) for i, p in enumerate(prompts)]
    all_logits, tokens = [], []
    for _ in range(1 + DECODE_STEPS):
        batch, rows = build_forward_batch(chunks, page_size=PAGE, pages_per_seq=8)
        logits, cache = forward_jit(params, cache, batch, cfg, impl=impl)
        logits = np.asarray(logits)
        all_logits.append(logits)
        step_tokens = [int(np.argmax(logits[r[0]])) for r in rows]
        tokens.append(step_tokens)
        chunks = [SeqChunk([t], c.context_len + len(c.token_ids), c.pages, c.state_slot)
                  for t, c in zip(step_tokens, chunks)]
    return np.stack(all_logits), tokens


@pytest.mark.timeout(1200)
def test_model_on_pallas_interpret_matches_reference():
    cfg, params = load_model(default_model_path(), dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (19, 7)]
    with jax.default_matmul_precision("highest"):  # f32 means f32 on a TPU too (2e-4 bound)
        ref_logits, ref_tokens = run_steps(cfg, params, prompts, "reference")
        ker_logits, ker_tokens = run_steps(cfg, params, prompts, "interpret")
    assert ker_tokens == ref_tokens
    np.testing.assert_allclose(ker_logits, ref_logits, atol=2e-4, rtol=0)
