"""The jitted sampler against numpy references (small vocabularies, CPU)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from sglang_tpu_backend.sampling import sampler


def inputs(R, L, V, **kw) -> sampler.SamplingInputs:
    base = dict(
        sample_rows=np.arange(R, dtype=np.int32) % L, valid=np.ones(R, bool),
        temperature=np.ones(R, np.float32), top_p=np.ones(R, np.float32), top_k=np.zeros(R, np.int32),
        min_p=np.zeros(R, np.float32), frequency_penalty=np.zeros(R, np.float32),
        presence_penalty=np.zeros(R, np.float32), repetition_penalty=np.ones(R, np.float32),
        seed_lo=np.arange(R, dtype=np.uint32), seed_hi=np.zeros(R, np.uint32), step=np.zeros(R, np.int32),
        slot=np.zeros(R, np.int32), bitmask=np.full((R, (V + 31) // 32), -1, np.int32),
        target_ids=np.zeros(L, np.int32),
    )
    for k, v in kw.items():
        base[k] = np.broadcast_to(np.asarray(v, dtype=base[k].dtype), base[k].shape).copy()
    return sampler.SamplingInputs(**base)


def run(logits, inp, S=1, K=0, counts=None, prompt_mask=None, variant=sampler.FULL):
    V = logits.shape[1]
    counts = jnp.zeros((S, V), jnp.int32) if counts is None else jnp.array(counts, copy=True)  # donated
    prompt_mask = jnp.zeros((S, V), bool) if prompt_mask is None else jnp.asarray(prompt_mask)
    return jax.device_get(sampler.sample_jit(jnp.asarray(logits), counts, prompt_mask, inp, num_top_logprobs=K,
                                             variant=variant))


def test_top_k_top_p_min_p_mask_hand_checked():
    probs = jnp.array([[0.5, 0.05, 0.3, 0.15]] * 4, jnp.float32)
    keep = np.asarray(sampler.top_k_top_p_min_p_mask(
        probs,
        jnp.array([2, 0, 0, 1], jnp.int32),
        jnp.array([1.0, 0.7, 1.0, 1.0], jnp.float32),
        jnp.array([0.0, 0.0, 0.2, 0.0], jnp.float32),
    ))
    np.testing.assert_array_equal(keep[0], [True, False, True, False])  # top-2
    np.testing.assert_array_equal(keep[1], [True, False, True, False])  # 0.5 + 0.3 >= 0.7
    np.testing.assert_array_equal(keep[2], [True, False, True, True])  # p >= 0.2 * 0.5
    np.testing.assert_array_equal(keep[3], [True, False, False, False])  # top-1


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(0)
    R, V = 3, 16
    logits = rng.normal(size=(R, V)).astype(np.float32) * 3
    counts = rng.integers(0, 3, size=(R, V)).astype(np.int32)
    pmask = rng.random((R, V)) < 0.3
    freq, pres, rep = np.array([0.5, 0, 0.2], np.float32), np.array([0, 1.0, 0.3], np.float32), np.array([1.0, 1.5, 0.8], np.float32)
    got = np.asarray(sampler.apply_penalties(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(pmask),
                                             jnp.asarray(freq), jnp.asarray(pres), jnp.asarray(rep)))
    want = logits - freq[:, None] * counts - pres[:, None] * (counts > 0)
    seen = (counts > 0) | pmask
    want = np.where(seen, np.where(want > 0, want / rep[:, None], want * rep[:, None]), want)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_greedy_logprobs_equal_log_softmax_and_top_k():
    rng = np.random.default_rng(1)
    L, V = 4, 50
    logits = rng.normal(size=(L, V)).astype(np.float32)
    inp = inputs(4, L, V, temperature=0.0, target_ids=[3, 7, 9, 11])
    out = run(logits, inp, K=5)
    ref = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    ref = np.asarray(ref)
    np.testing.assert_array_equal(out["tokens"], logits.argmax(-1))
    np.testing.assert_allclose(out["logprobs"], ref[np.arange(4), logits.argmax(-1)], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["row_logprobs"], ref[np.arange(4), [3, 7, 9, 11]], rtol=1e-5, atol=1e-6)
    order = np.argsort(-ref, axis=-1)[:, :5]
    np.testing.assert_array_equal(out["top_ids"], order)
    np.testing.assert_allclose(out["top_logprobs"], np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-6)


def test_seeded_sampling_is_deterministic_per_seed_and_step():
    rng = np.random.default_rng(2)
    V = 64
    logits = np.repeat(rng.normal(size=(1, V)).astype(np.float32), 8, axis=0)
    a = run(logits, inputs(8, 8, V, seed_lo=7, step=np.arange(8)))["tokens"]
    b = run(logits, inputs(8, 8, V, seed_lo=7, step=np.arange(8)))["tokens"]
    c = run(logits, inputs(8, 8, V, seed_lo=8, step=np.arange(8)))["tokens"]
    np.testing.assert_array_equal(a, b)
    assert len(set(a.tolist())) > 1  # different steps draw differently
    assert not np.array_equal(a, c)  # another seed, another stream
    # Row order must not matter: the key is a function of (seed, step) only.
    d = run(logits, inputs(8, 8, V, seed_lo=7, step=np.arange(8)[::-1]))["tokens"]
    np.testing.assert_array_equal(d, a[::-1])


def test_sampling_distribution_and_filters():
    V, R = 8, 4000
    logits = np.log(np.array([[0.4, 0.3, 0.15, 0.1, 0.05, 0, 0, 0]], np.float32) + 1e-9)
    logits = np.repeat(logits, R, axis=0)
    seeds = np.arange(R, dtype=np.uint32)
    toks = run(logits, inputs(R, R, V, seed_lo=seeds))["tokens"]
    freq = np.bincount(toks, minlength=V) / R
    np.testing.assert_allclose(freq[:5], [0.4, 0.3, 0.15, 0.1, 0.05], atol=0.03)
    toks = run(logits, inputs(R, R, V, seed_lo=seeds, top_k=2))["tokens"]
    assert set(toks.tolist()) == {0, 1}
    toks = run(logits, inputs(R, R, V, seed_lo=seeds, top_p=0.6))["tokens"]
    assert set(toks.tolist()) == {0, 1}  # 0.4 < 0.6, 0.4 + 0.3 covers it
    toks = run(logits, inputs(R, R, V, seed_lo=seeds, min_p=0.3))["tokens"]
    assert set(toks.tolist()) == {0, 1, 2}  # >= 0.12
    # Temperature sharpens: at 0.25 the top token dominates.
    toks = run(logits, inputs(R, R, V, seed_lo=seeds, temperature=0.25))["tokens"]
    assert (toks == 0).mean() > 0.7


def test_bitmask_blocks_tokens_and_counts_update():
    V = 40
    logits = np.zeros((2, V), np.float32)
    logits[:, 5] = 10.0  # greedy would pick 5
    mask = np.zeros((2, 2), np.int32)
    mask[:, 1] = 1 << (33 - 32)  # only token 33 allowed
    out = run(logits, inputs(2, 2, V, temperature=0.0, bitmask=mask, slot=[0, 1]), S=2)
    np.testing.assert_array_equal(out["tokens"], [33, 33])
    counts = np.asarray(out["counts"])
    assert counts[0, 33] == 1 and counts[1, 33] == 1 and counts.sum() == 2
    # Invalid (padding) rows do not count.
    out = run(logits, inputs(2, 2, V, temperature=0.0, valid=[True, False], slot=[0, 1]), S=2)
    assert np.asarray(out["counts"]).sum() == 1


def test_repetition_penalty_changes_greedy_choice_via_penalty_state():
    V = 16
    logits = np.zeros((1, V), np.float32)
    logits[0, 4], logits[0, 9] = 2.0, 1.5
    counts, pmask = sampler.reset_penalty_rows(
        jnp.zeros((2, V), jnp.int32), jnp.zeros((2, V), bool), jnp.int32(1),
        jnp.array([4, 4, V, V], jnp.int32), jnp.array([7, 7, 2, V], jnp.int32))
    assert int(counts[1, 7]) == 2 and int(counts[1, 2]) == 1 and bool(pmask[1, 4]) and int(counts[0].sum()) == 0
    out = run(logits, inputs(1, 1, V, temperature=0.0, slot=1, repetition_penalty=1.5), S=2,
              counts=counts, prompt_mask=pmask)
    assert out["tokens"][0] == 9  # 2.0 / 1.5 < 1.5
    out = run(logits, inputs(1, 1, V, temperature=0.0, slot=1, presence_penalty=0.0), S=2,
              counts=counts, prompt_mask=pmask)
    assert out["tokens"][0] == 4


# One row of each kind (per-row sampling values) for the variant comparisons below.
ROW_KINDS = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=0.7),
    "top_k": dict(temperature=0.9, top_k=5),
    "top_p": dict(temperature=1.3, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "penalty": dict(temperature=0.6, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.3),
    "greedy_penalty": dict(temperature=0.0, repetition_penalty=0.7),
    "mask": dict(temperature=0.8),
    "greedy_mask": dict(temperature=0.0),
}


def mixed_inputs(kinds, V, rng, L=8):
    """SamplingInputs with row r of kind ``kinds[r]`` (R = len(kinds), one slot per row); the
    *mask rows allow a random half of the vocabulary, the others all of it."""
    R = len(kinds)
    inp = inputs(R, L, V, seed_lo=rng.integers(0, 2**32, R), seed_hi=rng.integers(0, 2**32, R),
                 step=rng.integers(0, 100, R), slot=np.arange(R), valid=np.arange(R) < R - 1,
                 target_ids=rng.integers(0, V, L))
    fields = {k: np.array(getattr(inp, k)) for k in ROW_KINDS["penalty"]} | {
        k: np.array(getattr(inp, k)) for k in ("top_k", "top_p", "min_p", "bitmask")}
    for r, kind in enumerate(kinds):
        for k, v in ROW_KINDS[kind].items():
            fields[k][r] = v
        if "mask" in kind:
            fields["bitmask"][r] = rng.integers(-2**31, 2**31, fields["bitmask"].shape[1])
    return dataclasses.replace(inp, **fields)


def needs_of(kinds) -> sampler.SamplerVariant:
    """The stages rows of these kinds need (what sampler_state.sampler_variant reports)."""
    return sampler.SamplerVariant(
        draw=any(ROW_KINDS[k]["temperature"] > 0 for k in kinds),
        filter=any(k in ("top_k", "top_p", "min_p") for k in kinds),
        penalties=any("penalty" in k for k in kinds), mask=any("mask" in k for k in kinds), bias=False)


@pytest.mark.parametrize("kinds", [
    ["greedy"] * 4, ["greedy", "plain", "plain", "greedy"], ["plain", "top_k", "greedy", "plain"],
    ["plain", "top_p", "min_p", "greedy"], ["greedy", "greedy_penalty", "plain", "penalty"],
    ["greedy_mask", "plain", "mask", "greedy"], ["greedy_penalty", "greedy_mask", "greedy", "greedy"],
])
@pytest.mark.parametrize("K", [0, 5])
def test_fast_variants_equal_the_full_sampler_bit_for_bit(kinds, K):
    """Leaving out the stages no row needs (the exact needs, and the served collapsed level)
    changes nothing: tokens, logprobs, top logprobs, prompt-row logprobs and penalty counts."""
    rng = np.random.default_rng(len(kinds) * 7 + K + sum(map(len, kinds)))
    V, L = 300, 8
    for trial in range(2):
        logits = (rng.normal(size=(L, V)) * 3).astype(np.float32)
        counts = rng.integers(0, 3, (len(kinds), V)).astype(np.int32)
        pmask = rng.random((len(kinds), V)) < 0.2
        inp = mixed_inputs(kinds, V, rng, L)
        full = run(logits, inp, S=len(kinds), K=K, counts=counts, prompt_mask=pmask)
        needs = needs_of(kinds)
        for variant in {needs, sampler.variant_for(needs)}:
            fast_inp = inp if variant.mask else dataclasses.replace(inp, bitmask=None)
            fast = run(logits, fast_inp, S=len(kinds), K=K, counts=counts, prompt_mask=pmask, variant=variant)
            assert fast.keys() == full.keys()
            for key in full:
                np.testing.assert_array_equal(fast[key], full[key], err_msg=f"{variant} {key}")
    assert sampler.variant_for(needs) in sampler.VARIANTS


def test_variant_for_collapses_to_three_levels():
    V = sampler.SamplerVariant
    assert sampler.variant_for(V(False, False, False, False, False)) == sampler.GREEDY
    assert sampler.variant_for(V(True, False, False, False, False)) == sampler.PLAIN
    for needs in (V(True, True, False, False, False), V(False, False, True, False, False),
                  V(False, False, False, True, False), V(False, False, False, False, True)):
        assert sampler.variant_for(needs) == sampler.FULL


def test_top_p_one_keeps_every_token_despite_rounding():
    """Ten probabilities of 0.1 sum to more than 1 in float32: top_p = 1 must still keep the
    tail (it is off), so skipping the filter for top_p = 1 rows changes nothing."""
    probs = jnp.asarray(np.array([[0.1] * 10 + [1e-9] * 4], np.float32))
    assert float(jnp.cumsum(probs[0])[-1] - probs[0, -1]) > 1.0
    keep = sampler.top_k_top_p_min_p_mask(probs, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.float32),
                                          jnp.zeros(1, jnp.float32))
    assert bool(jnp.all(keep))


def argsort_scatter_mask(probs, top_k, top_p, min_p):
    """The filter as it was before ``keep_first_ranks``: a stable argsort, the rules judged per
    rank, scattered back to the tokens (the reference the sort-free mapping must equal)."""
    R, V = probs.shape
    order = jnp.argsort(-probs, axis=-1)
    keep = sampler.keep_by_rank(jnp.take_along_axis(probs, order, axis=-1), top_k, top_p, min_p)
    return jnp.zeros((R, V), jnp.bool_).at[jnp.arange(R)[:, None], order].set(keep)


@pytest.mark.parametrize("levels", [2, 3, 5, 50])
def test_filter_mask_equals_argsort_scatter_with_ties(levels):
    # Few distinct values: every top-k / top-p / min-p boundary falls inside a run of ties.
    rng = np.random.default_rng(levels)
    R, V = 96, 67
    raw = rng.integers(0, levels, (R, V)).astype(np.float32) + 1.0
    raw[rng.random((R, V)) < 0.2] = 0.0  # masked tokens: zero probability, tied too
    raw[:, 0] = np.maximum(raw[:, 0], 1.0)
    probs = jnp.asarray(raw / raw.sum(-1, keepdims=True))
    top_k = jnp.asarray(rng.integers(0, V + 3, R), jnp.int32)
    top_p = jnp.asarray(rng.choice([0.05, 0.3, 0.5, 0.9, 0.999, 1.0], R), jnp.float32)
    min_p = jnp.asarray(rng.choice([0.0, 0.0, 0.2, 0.5, 0.99, 1.0], R), jnp.float32)
    got = jax.jit(sampler.top_k_top_p_min_p_mask)(probs, top_k, top_p, min_p)
    want = jax.jit(argsort_scatter_mask)(probs, top_k, top_p, min_p)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_filter_mask_tie_at_top_k_boundary_keeps_lowest_ids():
    probs = jnp.array([[0.1, 0.3, 0.1, 0.3, 0.1, 0.1]], jnp.float32)
    one = lambda v, dt: jnp.array([v], dt)  # noqa: E731
    keep = sampler.top_k_top_p_min_p_mask(probs, one(3, jnp.int32), one(1.0, jnp.float32),
                                          one(0.0, jnp.float32))
    np.testing.assert_array_equal(np.asarray(keep[0]), [True, True, False, True, False, False])


@pytest.mark.parametrize("V", [37, 1216, 3000])
def test_top_equals_lax_top_k_with_ties_and_masked_rows(V):
    rng = np.random.default_rng(V)
    x = rng.integers(-3, 3, (8, V)).astype(np.float32)
    x[1] = -np.inf  # a row with every token masked
    x[2, 5:] = -np.inf  # fewer finite tokens than K
    x = jnp.asarray(x)
    K = 20
    vals, ids = sampler._top(x, K)
    want_vals, want_ids = jax.lax.top_k(x, K)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    assert ids.dtype == jnp.int32
