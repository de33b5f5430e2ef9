"""One forward over a ragged batch equals running each request alone, however it is chunked.

Uses the embedded tiny default model in fp32 with the reference kernels. Every call pads to
the same buckets (64 tokens, 4 requests, 8 pages each, 4 logits rows), which also checks that
padding rows change nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.model_loader.tiny_model import default_model_path
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache

PAGE = 8
BUCKETS = dict(num_tokens=64, num_seqs=4, pages_per_seq=8, num_logits=4)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model():
    cfg, params = load_model(default_model_path(), dtype=jnp.float32)
    return cfg, params


def new_cache(cfg):
    return init_cache(cfg, num_pages=40, page_size=PAGE, num_state_slots=6,
                      kv_dtype=jnp.float32, state_dtype=jnp.float32)


def run(model, cache, chunks, mode=None):
    cfg, params = model
    batch, rows = build_forward_batch(chunks, page_size=PAGE, mode=mode, **BUCKETS)
    logits, cache = forward_jit(params, cache, batch, cfg, impl="reference")
    return [np.asarray(logits)[r] for r in rows], cache


def prompt(seed, n, vocab):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def pages_for(req):
    return list(range(8 * req, 8 * req + 8))


def test_chunked_prefill_equals_one_shot(model):
    cfg, _ = model
    toks = prompt(1, 45, cfg.vocab_size)
    one_shot, _ = run(model, new_cache(cfg), [SeqChunk(toks, 0, pages_for(0), 1)])

    for cuts in ([7, 13, 20, 5], [3, 42], [16, 9, 20]):  # mid-page and page-aligned boundaries
        cache, start = new_cache(cfg), 0
        for n in cuts:
            out, cache = run(model, cache, [SeqChunk(toks[start:start + n], start, pages_for(0), 1)])
            start += n
        np.testing.assert_allclose(out[0], one_shot[0], atol=ATOL, rtol=0, err_msg=f"cuts {cuts}")


def test_gdn_chunked_form_equals_recurrent_form(model):
    """Prefill as one EXTEND (chunked GDN) vs token by token as DECODE steps (recurrent GDN)."""
    cfg, _ = model
    toks = prompt(2, 20, cfg.vocab_size)
    chunked, _ = run(model, new_cache(cfg), [SeqChunk(toks, 0, pages_for(0), 0)])
    cache = new_cache(cfg)
    out, cache = run(model, cache, [SeqChunk(toks[:1], 0, pages_for(0), 0)])
    for i in range(1, len(toks)):
        out, cache = run(model, cache, [SeqChunk([toks[i]], i, pages_for(0), 0)], ForwardMode.DECODE)
    np.testing.assert_allclose(out[0], chunked[0], atol=ATOL, rtol=0)


def test_ragged_mixed_batch_equals_each_alone(model):
    cfg, _ = model
    a, b, c, d = (prompt(10 + i, n, cfg.vocab_size) for i, n in enumerate([11, 17, 25, 6]))

    # Alone: a is prefilled then decodes one token; c is prefilled in two chunks.
    cache = new_cache(cfg)
    _, cache = run(model, cache, [SeqChunk(a[:10], 0, pages_for(0), 0)])
    alone_a, _ = run(model, cache, [SeqChunk(a[10:], 10, pages_for(0), 0)])
    alone_b, _ = run(model, new_cache(cfg), [SeqChunk(b, 0, pages_for(1), 1)])
    cache = new_cache(cfg)
    _, cache = run(model, cache, [SeqChunk(c[:9], 0, pages_for(2), 2)])
    alone_c, _ = run(model, cache, [SeqChunk(c[9:], 9, pages_for(2), 2)])
    alone_d, _ = run(model, new_cache(cfg), [SeqChunk(d, 0, pages_for(3), 5)])

    # Together: the earlier chunks of a and c first, then one MIXED step with a decode row,
    # two prefill chunks and a fresh request.
    cache = new_cache(cfg)
    _, cache = run(model, cache, [SeqChunk(a[:10], 0, pages_for(0), 0),
                                  SeqChunk(c[:9], 0, pages_for(2), 2)])
    together, _ = run(model, cache, [
        SeqChunk(a[10:], 10, pages_for(0), 0),
        SeqChunk(b, 0, pages_for(1), 1),
        SeqChunk(c[9:], 9, pages_for(2), 2),
        SeqChunk(d, 0, pages_for(3), 5),
    ], ForwardMode.MIXED)
    np.testing.assert_allclose(together[0], alone_a[0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(together[1], alone_b[0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(together[2], alone_c[0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(together[3], alone_d[0], atol=ATOL, rtol=0)


def test_decode_batch_equals_each_alone_and_leaves_other_slots(model):
    cfg, _ = model
    seqs = [prompt(20 + i, n, cfg.vocab_size) for i, n in enumerate([5, 12, 9])]
    cache = new_cache(cfg)
    _, cache = run(model, cache, [SeqChunk(s[:-1], 0, pages_for(i), i) for i, s in enumerate(seqs)])
    untouched = np.asarray(cache.rec_state[0][4]).copy()
    together, cache = run(model, cache, [
        SeqChunk(s[-1:], len(s) - 1, pages_for(i), i) for i, s in enumerate(seqs)
    ], ForwardMode.DECODE)
    np.testing.assert_array_equal(np.asarray(cache.rec_state[0][4]), untouched)
    for i, s in enumerate(seqs):
        alone, _ = run(model, new_cache(cfg), [SeqChunk(s, 0, pages_for(i), i)])
        np.testing.assert_allclose(together[i], alone[0], atol=ATOL, rtol=0)



def test_padding_rows_routed_nowhere_and_change_nothing(model):
    """Padding rows get no expert (group sizes count only real rows), and real rows' outputs
    are the same with or without padding: for the model (the module's 64-token bucket on the
    reference kernels vs an exact-size batch on impl="auto", the fast XLA grouped matmuls on
    CPU) and for one MoE block."""
    from sglang_tpu_backend.kernels.routing import route_metadata
    from sglang_tpu_backend.models.qwen3_5_moe import layer_params, moe_block, route_tokens

    cfg, params = model
    chunks = [SeqChunk(prompt(7, 5, cfg.vocab_size), 0, pages_for(0), 1),
              SeqChunk(prompt(8, 3, cfg.vocab_size), 0, pages_for(1), 2)]
    padded, _ = run(model, new_cache(cfg), chunks)  # 8 real rows in 64
    batch, rows = build_forward_batch(chunks, page_size=PAGE, **{**BUCKETS, "num_tokens": 8})
    exact, _ = forward_jit(params, new_cache(cfg), batch, cfg, impl="auto")
    for p_rows, r in zip(padded, rows):
        np.testing.assert_allclose(p_rows, np.asarray(exact)[r], atol=ATOL, rtol=0)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, cfg.hidden_size)), jnp.float32)
    p = layer_params(params, cfg, 0)["mlp"]
    half = cfg.num_experts // 2

    @jax.jit
    def moe_checks(x):  # one compile for all of it
        n = jnp.int32(8)
        top_w, top_i = route_tokens(x @ p["gate"], cfg, num_valid=n)
        _, sizes, sorted_rows = route_metadata(top_i, cfg.num_experts)
        _, upper_sizes, _ = route_metadata(top_i, half, expert_offset=half)  # an EP rank
        padded = moe_block(p, x, cfg, "xla", num_valid=n)[:8]
        exact = moe_block(p, x[:8], cfg, "xla", num_valid=n)
        return top_w, top_i, sizes, sorted_rows, upper_sizes, padded, exact

    top_w, top_i, sizes, sorted_rows, upper_sizes, padded, exact = map(np.asarray, moe_checks(x))
    assert np.all(top_i[8:] == cfg.num_experts) and np.all(top_w[8:] == 0)
    assert sizes.sum() == 8 * cfg.num_experts_per_tok and np.all(sorted_rows[8:] == -1)
    assert upper_sizes.sum() == np.sum(top_i[:8] >= half)
    np.testing.assert_allclose(padded, exact, atol=1e-5, rtol=0)
