"""logit_bias (SGLang / OpenAI: token-id string -> additive bias in [-100, 100]): the
sampler's stage against numpy, greedy decoding steered by it, and its validation."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError
from sglang_tpu_backend.sampling import sampler
from tests.engine.test_engine import collect, greedy


def test_apply_logit_bias_matches_numpy_and_drops_padding():
    rng = np.random.default_rng(0)
    R, V, B = 3, 10, 4
    logits = rng.normal(size=(R, V)).astype(np.float32)
    ids = np.full((R, B), V, np.int32)  # padding: dropped
    vals = np.zeros((R, B), np.float32)
    ids[0, :2], vals[0, :2] = [1, 7], [5.0, -3.5]
    ids[2, :3], vals[2, :3] = [4, 4, 0], [1.0, 2.0, -100.0]  # a repeated id adds up
    want = logits.copy()
    want[0, 1] += 5.0
    want[0, 7] -= 3.5
    want[2, 4] += 3.0
    want[2, 0] -= 100.0
    got = np.asarray(sampler.apply_logit_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(vals)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _first_tokens(engine, prompt, n, **sp):
    return collect(engine, greedy(prompt, n, **sp))[-1]["output_ids"]


def test_bias_steers_greedy_decoding(clean_engine):
    prompt = [5, 17, 29, 41, 53]
    plain = _first_tokens(clean_engine, prompt, 4, ignore_eos=True)
    target = next(t for t in range(100, 200) if t not in plain)
    # +100 on one token: every greedy step picks it (the tiny model's logits span a few units)
    assert _first_tokens(clean_engine, prompt, 4, ignore_eos=True,
                         logit_bias={str(target): 100}) == [target] * 4
    # -100 on the greedy first token bans it; the rest of the batch is not affected
    banned = _first_tokens(clean_engine, prompt, 1, ignore_eos=True, logit_bias={str(plain[0]): -100.0})
    assert banned[0] != plain[0]
    # a zero bias changes nothing (the FULL sampler variant equals the greedy one)
    assert _first_tokens(clean_engine, prompt, 4, ignore_eos=True, logit_bias={str(target): 0}) == plain


@pytest.mark.parametrize("bias", [
    {"5": 100.5}, {"5": -101}, {"99999": 1}, {"x": 1}, {"5": "big"}, {str(i): 1 for i in range(301)}, [1, 2],
])
def test_bad_logit_bias_is_refused(clean_engine, bias):
    with pytest.raises(InvalidRequestError) as e:
        collect(clean_engine, GenerateReqInput(input_ids=[3, 4], sampling_params={"logit_bias": bias}))
    assert e.value.field == "sampling_params.logit_bias"
