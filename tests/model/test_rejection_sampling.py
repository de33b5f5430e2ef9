"""Speculative rejection sampling (``speculative/rejection.py``) on small vocabularies, CPU.

The distribution tests emit two tokens per request under speculation, vectorised over
thousands of seeds (one row each): a verify step with k = 2 fixed drafts and, for the requests
that emitted one token only, a plain step (k = 0) after it. A chi-square test (rare cells
pooled) compares the empirical first tokens and two-token sequences with the exact target
distribution, and the same test with a deliberately wrong rule must fail it.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from sglang_tpu_backend.sampling import sampler
from sglang_tpu_backend.speculative import rejection

N = 20_000  # seeds (rows) per distribution test
V = 16
TEMP = 0.8
STEP = 7  # output index of the first emitted token


def make_inputs(R, V, **kw) -> sampler.SamplingInputs:
    """Default (plain, temperature 1) inputs for R rows, fields overridden by ``kw``
    (broadcast to [R]); ``bitmask``, ``bias_ids`` and ``bias_values`` are passed through."""
    base = dict(
        sample_rows=np.zeros(R, np.int32), valid=np.ones(R, bool), temperature=np.ones(R, np.float32),
        top_p=np.ones(R, np.float32), top_k=np.zeros(R, np.int32), min_p=np.zeros(R, np.float32),
        frequency_penalty=np.zeros(R, np.float32), presence_penalty=np.zeros(R, np.float32),
        repetition_penalty=np.ones(R, np.float32), seed_lo=np.arange(R, dtype=np.uint32),
        seed_hi=np.zeros(R, np.uint32), step=np.zeros(R, np.int32), slot=np.zeros(R, np.int32),
        target_ids=np.zeros(R, np.int32),
    )
    extra = {f: kw.pop(f, None) for f in ("bitmask", "bias_ids", "bias_values")}
    for name, v in kw.items():
        base[name] = np.broadcast_to(np.asarray(v, dtype=base[name].dtype), (R,)).copy()
    return sampler.SamplingInputs(**base, **extra)


def verify(fn, logits, drafts, inp, draft_probs=None, counts=None, prompt_mask=None,
           variant=sampler.PLAIN, **kw):
    """Run ``fn`` (a jitted verify_sampled) on numpy inputs; counts default to zeros[1, V]."""
    V = logits.shape[-1]
    counts = np.zeros((1, V), np.int32) if counts is None else counts
    prompt_mask = np.zeros(counts.shape, bool) if prompt_mask is None else prompt_mask
    dp = None if draft_probs is None else jnp.asarray(draft_probs)
    return jax.device_get(fn(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), dp,
                             jnp.array(counts), jnp.asarray(prompt_mask), inp, variant=variant, **kw))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def chi_square(samples, probs):
    """(statistic, bound): Pearson's statistic of integer ``samples`` against ``probs`` f64[C],
    cells expected fewer than 5 times pooled, and its 1 - 3e-5 quantile (z = 4, Wilson-Hilferty).
    A sample in a cell of probability 0 makes the statistic infinite."""
    observed = np.bincount(samples, minlength=probs.size).astype(np.float64)
    if observed[probs == 0].sum() > 0:
        return np.inf, 0.0
    expected = probs * samples.size
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if expected[~big].sum() > 0:
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    stat = float(np.sum((obs - exp) ** 2 / exp))
    dof = obs.size - 1
    bound = dof * (1 - 2 / (9 * dof) + 4 * np.sqrt(2 / (9 * dof))) ** 3
    return stat, bound


def total_variation(samples, probs):
    return 0.5 * float(np.abs(np.bincount(samples, minlength=probs.size) / samples.size - probs).sum())


@pytest.fixture(scope="module")
def toy_model():
    """A two-level toy target: logits L0 f32[V] for the first token, L1 f32[V, V] for the second
    given the first, L2 f32[V, V] for the third given the second (only the bonus reads it);
    and a toy drafter q0 f32[V], q1 f32[V, V] (rows: distributions)."""
    rng = np.random.default_rng(0)
    L0, L1, L2 = (rng.normal(size=s).astype(np.float32) * 1.5 for s in ((V,), (V, V), (V, V)))
    q0 = rng.dirichlet(np.ones(V)).astype(np.float32)
    q1 = rng.dirichlet(np.ones(V), size=V).astype(np.float32)
    return L0, L1, L2, q0, q1


# Sampling settings of each mode's requests, and the sampler variant that serves them.
FILTERED = sampler.SamplerVariant(mask=False, bias=False)
MODES = {
    "deterministic": ({}, sampler.PLAIN),
    "draft_probs": ({}, sampler.PLAIN),
    "filtered": (dict(top_k=5, min_p=0.05, frequency_penalty=0.7, presence_penalty=0.5,
                      repetition_penalty=1.3), FILTERED),
}
PROMPT = np.random.default_rng(5).random(V) < 0.3  # the prompt's tokens (repetition penalty)


def exact_targets(mode, toy_model):
    """Plain sampling's distributions: p0 f64[V] of the first token, p1 f64[V, V] of the
    second given the first (counted as an output token), from the sampler's stages."""
    L0, L1 = toy_model[:2]
    kw, variant = MODES[mode]
    inp = make_inputs(V + 1, V, temperature=TEMP, **kw)
    counts = np.concatenate([np.zeros((1, V), np.int32), np.eye(V, dtype=np.int32)])
    x = sampler.process_logits(np.concatenate([L0[None], L1]), counts,
                               np.broadcast_to(PROMPT, (V + 1, V)), None, inp, variant)
    p = np.asarray(jax.nn.softmax(sampler.draw_logits(x, inp, variant)[1]), np.float64)
    p /= p.sum(-1, keepdims=True)
    return p[0], p[1:]


def two_tokens(fn, toy_model, mode):
    """Emit two tokens for N seeds with ``fn`` as the verify rule: (t0 i32[N], t1 i32[N], joint
    probabilities f64[V * V] of (t0, t1) under plain sampling)."""
    L0, L1, L2, q0, q1 = toy_model
    p0, p1 = exact_targets(mode, toy_model)
    kw, variant = MODES[mode]
    if mode == "deterministic":  # a likely first draft, an unlikely second one
        d0 = int(np.argsort(-p0)[1])
        drafts = np.tile([d0, np.argsort(-p1[d0])[V // 2]], (N, 1))
        draft_probs = None
    elif mode == "filtered":  # a likely first draft, a second one the filter drops
        d0 = int(np.argsort(-p0)[1])
        drafts = np.tile([d0, np.argsort(-p1[d0])[-1]], (N, 1))
        assert p1[d0, drafts[0, 1]] == 0
        draft_probs = None
    else:  # drafts drawn from the toy drafter, which passes its distributions
        rng = np.random.default_rng(1)
        d0 = rng.choice(V, size=N, p=q0 / q0.sum())
        cum = np.cumsum(q1[d0], axis=-1)
        d1 = np.minimum((rng.random((N, 1)) * cum[:, -1:] > cum).sum(-1), V - 1)
        drafts = np.stack([d0, d1], axis=1)
        draft_probs = np.stack([np.broadcast_to(q0, (N, V)), q1[d0]], axis=1)
    logits = np.stack([np.broadcast_to(L0, (N, V)), L1[drafts[:, 0]], L2[drafts[:, 1]]], axis=1)
    state = dict(counts=np.zeros((N, V), np.int32), prompt_mask=np.broadcast_to(PROMPT, (N, V)))
    inp = make_inputs(N, V, temperature=TEMP, step=STEP, seed_hi=3, slot=np.arange(N), **kw)
    out = verify(fn, logits, drafts, inp, draft_probs, variant=variant, **state)
    t0 = out["tokens"][:, 0]
    # Requests that emitted one token only sample the second from L1[t0] in a plain step,
    # with the penalty state the verify step left.
    state["counts"] = out["counts"]
    inp = make_inputs(N, V, temperature=TEMP, step=STEP + 1, seed_hi=3, slot=np.arange(N), **kw)
    plain = verify(fn, L1[t0][:, None], np.zeros((N, 0)), inp, variant=variant, **state)
    t1 = np.where(out["num_accepted"] >= 1, out["tokens"][:, 1], plain["next_token"])
    return t0, t1, (p0[:, None] * p1).reshape(-1)


WRONG_RULES = {
    "always_accept": ("accept_drafts", lambda p, q, u: jnp.ones(u.shape, bool)),
    "residual_is_p": ("residual_probs", lambda p, q: p),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rule", ["exact", *WRONG_RULES])
def test_two_token_distribution_matches_the_target(toy_model, mode, rule, monkeypatch):
    fn = rejection.verify_sampled_jit
    if rule != "exact":
        monkeypatch.setattr(rejection, *WRONG_RULES[rule])

        def wrong(*args, **kw):  # a new function: jit's trace cache is keyed on it
            return rejection.verify_sampled(*args, **kw)

        fn = jax.jit(wrong, static_argnames=("variant",))
    t0, t1, joint = two_tokens(fn, toy_model, mode)
    first = joint.reshape(V, V).sum(1)
    stats = {"first": chi_square(t0, first), "pair": chi_square(t0 * V + t1, joint)}
    tv = {"first": total_variation(t0, first), "pair": total_variation(t0 * V + t1, joint)}
    print(f"\n{mode} {rule}: chi2 (stat, bound) {stats}, TV {tv}")
    passes = all(stat <= bound for stat, bound in stats.values())
    assert passes == (rule == "exact"), (stats, tv)


def test_k0_is_plain_sampling_with_its_own_draws(toy_model):
    L0 = toy_model[0]
    p0 = softmax(L0.astype(np.float64) / TEMP)
    logits = np.broadcast_to(L0, (N, V))
    inp = make_inputs(N, V, temperature=TEMP, step=STEP, seed_hi=3)
    out = verify(rejection.verify_sampled_jit, logits[:, None], np.zeros((N, 0)), inp)
    assert (out["num_accepted"] == 0).all()
    stat, bound = chi_square(out["next_token"], p0)
    assert stat <= bound, (stat, bound)
    np.testing.assert_array_equal(out["tokens"][:, 0], out["next_token"])
    # The same seeds and step in the plain sampler draw independently (salted keys): tokens
    # agree about as often as two independent draws, sum(p^2), not always.
    plain = sampler.sample_jit(jnp.asarray(logits), jnp.zeros((1, V), jnp.int32),
                               jnp.zeros((1, V), bool), inp, variant=sampler.PLAIN)
    agree = float((np.asarray(plain["tokens"]) == out["next_token"]).mean())
    assert abs(agree - float((p0 ** 2).sum())) < 0.02, agree


def full_case(rng, R=6, k=3, V=40, B=4):
    """Random FULL-variant inputs: rows of mixed temperature (two greedy), filters, penalties,
    logit bias and per-position bitmasks; each row its own penalty slot."""
    n, W = k + 1, (V + 31) // 32
    bits = rng.integers(-2**31, 2**31, (R, n, W), dtype=np.int64).astype(np.int32)
    bits[..., 0] |= 0xFF  # tokens 0..7 (the drafts' ids) allowed at every position
    inp = make_inputs(
        R, V, temperature=[0.0, 0.7, 1.0, 1.3, 0.0, 0.9], top_k=[0, 5, 0, 0, 3, 8],
        top_p=[1.0, 1.0, 0.8, 1.0, 1.0, 0.9], min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.05],
        frequency_penalty=[0.5, 0.3, 0.0, 0.8, 0.0, 0.2], presence_penalty=[0.0, 0.5, 0.7, 0.0, 0.4, 0.3],
        repetition_penalty=[1.3, 1.0, 1.2, 0.9, 1.5, 1.1], seed_lo=rng.integers(0, 1000, R),
        step=rng.integers(0, 50, R), slot=np.arange(R)[::-1], bitmask=bits,
        bias_ids=np.concatenate([rng.integers(0, V, (R, B - 1)), np.full((R, 1), V)], 1).astype(np.int32),
        bias_values=rng.normal(size=(R, B)).astype(np.float32) * 2)
    logits = rng.normal(size=(R, n, V)).astype(np.float32) * 3
    drafts = rng.integers(0, 8, (R, k)).astype(np.int32)  # small ids: often seen again
    likely = rng.random((R, k)) < 0.8  # most drafts made likely, so that some are accepted
    logits[np.arange(R)[:, None], np.arange(k), drafts] += np.where(likely, 8.0, 0.0)
    counts = rng.integers(0, 2, (R, V)).astype(np.int32)
    prompt_mask = rng.random((R, V)) < 0.2
    return logits, drafts, counts, prompt_mask, inp


def position_inputs(inp, j, counts, drafts):
    """Plain-step inputs and penalty state equivalent to position j: the row's counts with
    d_0 .. d_{j-1} added, its bitmask of position j."""
    counts = counts.copy()
    for r, s in enumerate(inp.slot):
        np.add.at(counts[s], drafts[r, :j], 1)
    return counts, sampler.SamplingInputs(**{**vars(inp), "bitmask": inp.bitmask[:, j],
                                             "sample_rows": np.arange(len(inp.slot), dtype=np.int32)})


def test_each_position_targets_the_plain_samplers_distribution():
    rng = np.random.default_rng(2)
    logits, drafts, counts, prompt_mask, inp = full_case(rng)
    R, n, V = logits.shape
    x, logprobs, scaled = jax.device_get(jax.jit(rejection.position_targets)(
        logits, drafts, counts, prompt_mask, inp))
    for j in range(n):
        c_j, inp_j = position_inputs(inp, j, counts, drafts)
        want_x = sampler.process_logits(logits[:, j], c_j[inp.slot], prompt_mask[inp.slot],
                                        inp_j.bitmask, inp_j, sampler.FULL)
        want_lp, want_scaled = sampler.draw_logits(want_x, inp_j, sampler.FULL)
        np.testing.assert_allclose(jax.nn.softmax(scaled[:, j]), jax.nn.softmax(want_scaled), atol=1e-6)
        np.testing.assert_allclose(logprobs[:, j], want_lp, atol=1e-6)
        # sample itself, at position j: greedy rows pick x's argmax, drawn rows a token the
        # target allows, and both report the logprob the target gives it.
        got = jax.device_get(sampler.sample_jit(logits[:, j], jnp.asarray(c_j), prompt_mask, inp_j))
        greedy = inp.temperature == 0
        np.testing.assert_array_equal(got["tokens"][greedy], x[greedy, j].argmax(-1))
        assert np.isfinite(scaled[np.arange(R), j, got["tokens"]]).all()
        np.testing.assert_allclose(got["logprobs"], logprobs[np.arange(R), j, got["tokens"]], atol=1e-6)


def test_verify_emits_counts_and_reports_logprobs_of_its_tokens():
    rng = np.random.default_rng(3)
    logits, drafts, counts, prompt_mask, inp = full_case(rng)
    R, n, V = logits.shape
    _, logprobs, scaled = jax.device_get(jax.jit(rejection.position_targets)(
        logits, drafts, counts, prompt_mask, inp))
    out = verify(rejection.verify_sampled_jit, logits, drafts, inp, counts=counts,
                 prompt_mask=prompt_mask, variant=sampler.FULL)
    again = verify(rejection.verify_sampled_jit, logits, drafts, inp, counts=counts,
                   prompt_mask=prompt_mask, variant=sampler.FULL)
    for key in out:
        np.testing.assert_array_equal(out[key], again[key])  # seeded: deterministic
    assert 0 < out["num_accepted"].sum() < R * (n - 1)  # some drafts accepted, some not
    want_counts = counts.copy()
    for r in range(R):
        a = out["num_accepted"][r]
        emitted = out["tokens"][r, : a + 1]
        np.testing.assert_array_equal(emitted[:a], drafts[r, :a])
        assert emitted[a] == out["next_token"][r]
        assert np.isfinite(scaled[r, np.arange(a + 1), emitted]).all()  # allowed by each target
        np.testing.assert_allclose(out["logprobs"][r, : a + 1], logprobs[r, np.arange(a + 1), emitted],
                                   atol=1e-6)
        assert (out["tokens"][r, a + 1:] == 0).all() and (out["logprobs"][r, a + 1:] == 0).all()
        np.add.at(want_counts[inp.slot[r]], emitted, 1)
    np.testing.assert_array_equal(out["counts"], want_counts)


@pytest.mark.parametrize("variant", [sampler.GREEDY, sampler.FULL])
def test_greedy_rows_accept_exact_matches_then_the_argmax(variant):
    rng = np.random.default_rng(4)
    R, k, V = 6, 3, 32
    logits = rng.normal(size=(R, k + 1, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :k].copy()
    wrong = [0, 1, 2, None, None, 0]  # first wrong draft per row (None: all right)
    for r, m in enumerate(wrong):
        if m is not None:
            drafts[r, m] = (argmax[r, m] + 1) % V
    temperature = np.zeros(R, np.float32)
    if variant == sampler.FULL:
        temperature[5] = 1.0  # a drawn row in the same step
        bitmask = np.full((R, k + 1, 1), -1, np.int32)
    kw = {"bitmask": bitmask} if variant.mask else {}
    inp = make_inputs(R, V, temperature=temperature, **kw)
    out = verify(rejection.verify_sampled_jit, logits, drafts, inp, variant=variant,
                 num_drafts=jnp.array([3, 3, 3, 3, 2, 3], jnp.int32))
    want = np.array([0, 1, 2, 3, 2])  # row 4: all right, but only two drafts
    np.testing.assert_array_equal(out["num_accepted"][:5], want)
    np.testing.assert_array_equal(out["next_token"][:5], argmax[np.arange(5), want])
    assert out["next_token"][3] == argmax[3, k]  # all accepted: the bonus is the last argmax


def test_padding_rows_and_num_drafts():
    V, k = 16, 3
    drafts = np.array([[3, 5, 7]] * 4, np.int32)
    logits = np.zeros((4, k + 1, V), np.float32)
    logits[:, np.arange(k), drafts[0]] = 60.0  # every draft has target probability 1
    drafts[2, :] = V  # past num_drafts: out of range, ignored
    inp = make_inputs(4, V, valid=[True, True, True, False], slot=[0, 1, 2, 3])
    counts = np.zeros((4, V), np.int32)
    for dp in (None, jax.nn.one_hot(drafts, V) * 0.5 + 0.5 / V):
        out = verify(rejection.verify_sampled_jit, logits, drafts, inp, draft_probs=dp, counts=counts,
                     num_drafts=jnp.array([3, 1, 0, 3], jnp.int32))
        np.testing.assert_array_equal(out["num_accepted"], [3, 1, 0, 0])
        assert out["next_token"][3] == 0 and (out["tokens"][3] == 0).all()
        assert out["counts"][3].sum() == 0 and out["counts"][2].sum() == 1
        np.testing.assert_array_equal(out["counts"][0, drafts[0]], 1)
        assert out["counts"][0].sum() == 4 and out["counts"][1].sum() == 2


def test_bad_shapes_are_named():
    V = 16
    logits, inp = np.zeros((2, 3, V), np.float32), make_inputs(2, V)
    with pytest.raises(ValueError, match="drafts"):
        rejection.verify_sampled(logits, np.zeros((2, 1), np.int32), None, jnp.zeros((1, V), jnp.int32),
                                 jnp.zeros((1, V), bool), inp)
    for bitmask in (np.full((2, 1), -1, np.int32), None):  # one mask per row, not per position
        with pytest.raises(ValueError, match="bitmask"):
            rejection.verify_sampled(logits, np.zeros((2, 2), np.int32), None, jnp.zeros((1, V), jnp.int32),
                                     jnp.zeros((1, V), bool), make_inputs(2, V, bitmask=bitmask),
                                     variant=sampler.FULL)
