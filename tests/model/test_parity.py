"""The JAX model against transformers' Qwen3_5MoeForCausalLM on tiny random checkpoints (fp32)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch  # noqa: E402
from sglang_tpu_backend.model_loader.loader import load_model  # noqa: E402
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache  # noqa: E402
from tests.model.hf_reference import make_hf_model, save_hf_model  # noqa: E402

PAGE = 8
PROMPT_LEN = 21  # ends mid-page
DECODE_STEPS = 32


@pytest.fixture(scope="module", params=["small", "wide", "irregular"])
def models(request, tmp_path_factory):
    hf = make_hf_model(request.param, seed=1)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    cfg, params = load_model(path, dtype=jnp.float32)
    # "small"/"wide" scan over groups of 4 layers (3 GDN + 1 attention); "irregular" is one group.
    assert cfg.layer_period == {"small": 4, "wide": 4, "irregular": 5}[request.param]
    return hf, cfg, params


def test_prompt_logits_and_greedy_decode_match_transformers(models):
    hf, cfg, params = models
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, PROMPT_LEN).tolist()

    with torch.no_grad():
        ref_prompt_logits = hf(torch.tensor([prompt])).logits[0].numpy()  # [S, V]
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )
    ref_tokens = out.sequences[0, PROMPT_LEN:].tolist()
    ref_step_logits = np.stack([l[0].numpy() for l in out.logits])  # [steps, V]

    max_len = PROMPT_LEN + DECODE_STEPS
    pages = list(range(3, 3 + -(-max_len // PAGE)))  # not starting at 0 on purpose
    cache = init_cache(cfg, num_pages=pages[-1] + 1, page_size=PAGE, num_state_slots=4,
                       kv_dtype=jnp.float32, state_dtype=jnp.float32)
    slot = 2
    batch, _ = build_forward_batch(
        [SeqChunk(prompt, 0, pages, slot, logits="all")], page_size=PAGE
    )
    logits, cache = forward_jit(params, cache, batch, cfg, impl="reference")
    np.testing.assert_allclose(np.asarray(logits), ref_prompt_logits, atol=1e-4, rtol=0)

    tokens, step_logits = [], [np.asarray(logits[-1])]
    tok = int(np.argmax(step_logits[-1]))
    for step in range(DECODE_STEPS):
        tokens.append(tok)
        if step == DECODE_STEPS - 1:
            break
        batch, _ = build_forward_batch(
            [SeqChunk([tok], PROMPT_LEN + step, pages, slot)], page_size=PAGE
        )
        logits, cache = forward_jit(params, cache, batch, cfg, impl="reference")
        step_logits.append(np.asarray(logits[0]))
        tok = int(np.argmax(step_logits[-1]))
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.stack(step_logits), ref_step_logits, atol=1e-4, rtol=0)
