"""The RL loop example's trainer scores tokens as the rollout engine does (``examples/rl_loop.py``).

No Ray here: the example's ``Trainer`` and one offline engine in this process.

- The trainer's logprob function (``logprobs_at``: temperature, then log-softmax) equals the
  jitted sampler's reported logprobs (``draw_logits``) bit for bit on the same logits, at
  temperatures 1 and 0.7; its jitted head (``head_logits``: the norm's weight product, the
  lm_head matmul) equals the engine's (``layers.rms_norm``, ``qwen3_5_moe.compute_logits``)
  on the same rows at the tiny model's sizes.
- Its replay of the deterministic engine's schedule (``Trainer.replay_features``) gives the
  engine's reported output logprobs of seeded samples exactly, before and after a refit of a
  perturbed lm_head and norm (a larger head amplifies any hidden-state difference: the gap of
  a one-pass scoring grows with it, measured up to 1.1e-5 in 10 steps of the example).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.scripts import load_script

pytestmark = pytest.mark.cpu_only(reason="bit-equality of XLA:CPU programs; the example's "
                                  "trainer and engines run on the CPU (JAX_PLATFORMS=cpu)")


@pytest.fixture(scope="module")
def rl_loop():
    return load_script("examples/rl_loop.py")


def _model_sizes():
    from sglang_tpu_backend.config import load_model_config
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path

    cfg = load_model_config(default_model_path())
    return cfg.hidden_size, cfg.vocab_size


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_are_the_samplers(rl_loop, temperature):
    """The sampler's reported logprobs (jitted ``draw_logits``) and the trainer's
    ``logprobs_at`` of the same logits f32[L, V] at the same targets: bit for bit."""
    from sglang_tpu_backend.sampling import sampler

    _, V = _model_sizes()
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    logits = 5.0 * jax.random.normal(k[0], (40, V), jnp.float32)
    targets = jax.random.randint(k[1], (40,), 0, V, jnp.int32)
    inp = types.SimpleNamespace(temperature=jnp.full((40,), temperature, jnp.float32))
    lp = jax.jit(lambda x: sampler.draw_logits(x, inp, sampler.PLAIN)[0])(logits)
    want = np.asarray(jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0])
    got = jax.jit(rl_loop.logprobs_at)(logits, targets, temperature)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(rl_loop.logprobs_at(logits, targets, temperature)),
                                  want)


@pytest.mark.parametrize("rows", [16, 40])
def test_trainer_head_is_the_engines(rl_loop, rows):
    """The engine's final norm weight product and lm_head (``rms_norm`` then
    ``compute_logits``, jitted) and the trainer's jitted ``head_logits`` of its features (the
    norm at w = 0) at the tiny model's sizes: the same logits bit for bit."""
    from sglang_tpu_backend.models.layers import rms_norm
    from sglang_tpu_backend.models.qwen3_5_moe import compute_logits

    H, V = _model_sizes()
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    x = 3.0 * jax.random.normal(k[0], (rows, H), jnp.float32)
    train = {"norm": 0.1 * jax.random.normal(k[1], (H,), jnp.float32),
             "lm_head": 0.3 * jax.random.normal(k[2], (V, H), jnp.float32)}
    batch = types.SimpleNamespace(logits_indices=jnp.arange(rows))
    want = jax.jit(lambda x, t: compute_logits(t, rms_norm(x, t["norm"], 1e-6), batch))(x, train)
    feats = rms_norm(x, jnp.zeros((H,), jnp.float32), 1e-6)
    got = jax.jit(rl_loop.head_logits)(train, feats)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _scores(trainer, rl_loop, engine, prompt, seed):
    """(engine's reported output logprobs, the trainer's) of 3 seeded samples of ``prompt``."""
    sp = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "seed": seed, "n": 3}
    outs = engine.generate(None, sp, [prompt], return_logprob=True)
    rollout = np.array([e[0] for s in outs for e in s["meta_info"]["output_token_logprobs"]],
                       np.float32)
    feats, targets = trainer.features([(prompt, s["output_ids"]) for s in outs])
    mine = np.asarray(trainer._logprobs(trainer.train, feats, targets, 1.0))
    return rollout, mine


def test_replay_scores_equal_the_engines(rl_loop):
    from sglang_tpu_backend.entrypoints.offline import OfflineEngine

    trainer = rl_loop.Trainer(engine_args=rl_loop.ENGINE_ARGS)
    prompt = trainer.encode(["The capital of France is"])[0]
    engine = OfflineEngine(**rl_loop.ENGINE_ARGS)
    try:
        rollout, mine = _scores(trainer, rl_loop, engine, prompt, seed=3)
        np.testing.assert_array_equal(mine, rollout)
        k = jax.random.split(jax.random.PRNGKey(1), 2)
        head, norm = trainer.train["lm_head"], trainer.train["norm"]
        trainer.train = {  # a trained head: larger, so any hidden-state difference shows more
            "lm_head": head * 3.0 + 0.05 * jax.random.normal(k[0], head.shape),
            "norm": norm + 0.1 * jax.random.normal(k[1], norm.shape)}
        named = {rl_loop.HEAD: np.asarray(trainer.train["lm_head"], np.float32),
                 rl_loop.NORM: np.asarray(trainer.train["norm"], np.float32)}
        ok, message = engine.update_weights_from_tensor(named, weight_version="perturbed")
        assert ok, message
        trainer.params = {**trainer.params, **trainer.train}
        rollout, mine = _scores(trainer, rl_loop, engine, prompt, seed=4)
        np.testing.assert_array_equal(mine, rollout)
    finally:
        engine.shutdown()
