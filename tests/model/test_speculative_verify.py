"""TARGET_VERIFY and commit_accepted on the tiny float32 model: rollback at every position.

From one prefilled request (its slot and pages cloned for every case), a non-speculative run
decodes the greedy continuation t_0, t_1, ... one token per step. One verify step then checks
k = 3 drafts [t_0 | d_1 d_2 d_3] for four copies of the request: the drafts are t_1..t_3
except that d_{j+1} is wrong, for j = 0, 1, 2, and all right for j = 3; greedy acceptance
must take j drafts; then the commit.
Each slot's GDN recurrent and conv states must equal bit for bit those the non-speculative run
left after the same tokens, and so must the next step's logits.

Same numerics on both sides: the XLA paths, ``batch_invariant`` (attention reads every key
from the pages, so a token's result does not depend on how many tokens of its request share
the step; without it the verify step's attention sums in another order and the states differ
by ~1e-7) and one token bucket for every step (T = 32), so the dense matmuls see the same
shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.model_executor import verify
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.model_loader.tiny_model import default_model_path
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache

PAGE, PAGES_PER_SEQ = 8, 4
K = 3  # drafts per request
N = K + 1  # verified positions per request
R, T = 8, 32  # request and token buckets of every step (verify: T = R * N)
PROMPT_LEN = 11
CASES = [0, 1, 2, K]  # per verify request: j, the drafts to accept (d_{j+1} wrong if j < K)
KW = dict(impl="xla", batch_invariant=True)


def pages(r):
    return list(range(PAGES_PER_SEQ * r, PAGES_PER_SEQ * (r + 1)))


def step(model, cache, chunks, mode=None):
    cfg, params = model
    batch, rows = build_forward_batch(chunks, page_size=PAGE, mode=mode, num_tokens=T,
                                      num_seqs=R, pages_per_seq=PAGES_PER_SEQ, num_logits=T)
    fn = verify.forward_verify_jit if mode == ForwardMode.TARGET_VERIFY else forward_jit
    out = fn(params, cache, batch, cfg, **KW)
    return (np.asarray(out[0]), rows, *out[1:]), batch


def clone_request(cache, src, dsts):
    """The cache with request ``src``'s state slot and KV pages copied to each of ``dsts``."""
    kv, cs, rs = cache.kv_pages, cache.conv_state, cache.rec_state
    for d in dsts:
        kv = kv.at[:, pages(d)].set(kv[:, pages(src)])
        cs, rs = cs.at[:, d].set(cs[:, src]), rs.at[:, d].set(rs[:, src])
    return dataclasses.replace(cache, kv_pages=kv, conv_state=cs, rec_state=rs)


def slot_states(cache, slot):
    return np.asarray(cache.conv_state[:, slot]), np.asarray(cache.rec_state[:, slot])


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_path(), dtype=jnp.float32)


@pytest.fixture(scope="module")
def prefilled(model):
    """(cache with the prompt prefilled in slot/pages 0 and cloned to 1..len(CASES), t_0)."""
    cfg, _ = model
    cache = init_cache(cfg, num_pages=PAGES_PER_SEQ * (len(CASES) + 1), page_size=PAGE,
                       num_state_slots=len(CASES) + 1, kv_dtype=jnp.float32,
                       state_dtype=jnp.float32)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, PROMPT_LEN).tolist()
    (logits, rows, cache), _ = step(model, cache, [SeqChunk(prompt, 0, pages(0), 0)])
    t0 = int(np.argmax(logits[rows[0][0]]))
    return clone_request(cache, 0, range(1, len(CASES) + 1)), t0


@pytest.fixture(scope="module")
def plain_decode(model, prefilled):
    """Non-speculative greedy decode of request 0 for N + 1 steps: tokens t_0..t_{N+1}, the
    logits of each step and the slot's states after each step."""
    cache, t0 = prefilled
    cache = jax.tree.map(jnp.copy, cache)  # the steps donate it
    tokens, logits, states = [t0], [], []
    for i in range(N + 1):
        (lg, rows, cache), _ = step(model, cache, [SeqChunk([tokens[-1]], PROMPT_LEN + i,
                                                            pages(0), 0)])
        logits.append(lg[rows[0][0]])
        tokens.append(int(np.argmax(logits[-1])))
        states.append(slot_states(cache, 0))
    return tokens, logits, states


@pytest.mark.jax_versions  # the model forward: both jax legs
def test_rollback_at_every_position(model, prefilled, plain_decode):
    cfg, params = model
    tokens, plain_logits, plain_states = plain_decode
    cache = jax.tree.map(jnp.copy, prefilled[0])
    chunks = []
    for r, j in enumerate(CASES, start=1):  # request r in slot/pages r
        drafts = list(tokens[1:N])
        if j < K:
            drafts[j] = (drafts[j] + 1) % cfg.vocab_size  # first wrong draft: d_{j+1}
        chunks.append(SeqChunk([tokens[0]] + drafts, PROMPT_LEN, pages(r), r, logits="all"))
    before = [slot_states(cache, r) for r in range(1, len(CASES) + 1)]
    (logits, rows, cache, states), batch = step(model, cache, chunks, ForwardMode.TARGET_VERIFY)
    for r in range(len(CASES)):  # the verify step leaves the slots untouched
        for got, want in zip(slot_states(cache, r + 1), before[r]):
            np.testing.assert_array_equal(got, want)

    accepted_len = np.zeros(R, np.int32)  # padding requests: 0 (leave their slot alone)
    bonus = []
    for r, (chunk, j) in enumerate(zip(chunks, CASES)):
        lg = logits[rows[r]]  # [N, V]: row i predicts the token after position i
        greedy = np.argmax(lg, axis=-1)
        a = 0
        while a < K and chunk.token_ids[a + 1] == greedy[a]:
            a += 1
        assert a == j, f"request {r}: accepted {a} drafts, expected {j}"
        accepted_len[r] = a + 1
        bonus.append(int(greedy[a]))
        assert bonus[-1] == tokens[a + 1]
        for i in range(a + 1):  # rows of accepted positions: the plain run's logits
            np.testing.assert_array_equal(lg[i], plain_logits[i])

    commit = jax.jit(verify.commit_accepted, static_argnames=("cfg", "impl"),
                     donate_argnames=("cache",))
    cache = commit(params, cache, states, batch.state_slots, jnp.asarray(accepted_len), cfg=cfg,
                   impl="xla")
    for r, j in enumerate(CASES):
        conv, rec = slot_states(cache, r + 1)
        want_conv, want_rec = plain_states[j]  # after tokens t_0..t_j
        np.testing.assert_array_equal(rec, want_rec, f"rec state, first wrong draft {j}")
        np.testing.assert_array_equal(conv, want_conv, f"conv state, first wrong draft {j}")

    # The next step (each request's bonus token) matches the plain run's step j + 1.
    nxt = [SeqChunk([bonus[r]], PROMPT_LEN + j + 1, pages(r + 1), r + 1)
           for r, j in enumerate(CASES)]
    (logits, rows, cache), _ = step(model, cache, nxt)
    for r, j in enumerate(CASES):
        np.testing.assert_array_equal(logits[rows[r][0]], plain_logits[j + 1])
        for got, want in zip(slot_states(cache, r + 1), plain_states[j + 1]):
            np.testing.assert_array_equal(got, want)


def test_commit_compiles_once_for_every_accepted_length(model, prefilled):
    cfg, params = model
    cache = jax.tree.map(jnp.copy, prefilled[0])
    chunk = SeqChunk([prefilled[1]] * N, PROMPT_LEN, pages(1), 1, logits="all")
    (_, _, cache, states), batch = step(model, cache, [chunk], ForwardMode.TARGET_VERIFY)
    commit = jax.jit(verify.commit_accepted, static_argnames=("cfg", "impl"))
    for a in range(N + 1):
        commit(params, cache, states, batch.state_slots,
               jnp.asarray([a] + [0] * (R - 1), jnp.int32), cfg=cfg, impl="xla")
    assert commit._cache_size() == 1


def test_verify_batch_layout_is_checked(model):
    with pytest.raises(ValueError, match="TARGET_VERIFY needs"):
        build_forward_batch([SeqChunk([1, 2, 3, 4], 5, pages(0), 0),
                             SeqChunk([1, 2, 3], 5, pages(1), 1)], page_size=PAGE,
                            mode=ForwardMode.TARGET_VERIFY, num_tokens=8, num_seqs=2)
    cfg, params = model
    batch, _ = build_forward_batch([SeqChunk([1, 2], 5, pages(0), 0)], page_size=PAGE,
                                   mode=ForwardMode.TARGET_VERIFY)
    cache = init_cache(cfg, num_pages=4, page_size=PAGE, num_state_slots=1)
    with pytest.raises(ValueError, match="forward_verify"):
        forward_jit(params, cache, batch, cfg, impl="xla")
