"""A small RL loop on the tiny model: a JAX trainer actor + a Ray rollout group (issue 37).

    .venv/bin/python examples/rl_loop.py --steps 3          # --replicas 2 --prompts 2 --n 4

Starts a local Ray cluster (127.0.0.1), a ``Trainer`` actor holding the tiny default
checkpoint's params in f32 (the project's loader; nothing is downloaded) and a
``ray_app.rollout.RolloutGroup`` of ``--replicas`` f32 engines on the same checkpoint. Each step:

1. rollout: ``--prompts`` prompts x ``--n`` samples (temperature 1, ``--max-new-tokens``
   each, seed ``--seed + 1000 k`` at step k, sample j of a prompt ``+ j``), with output token
   logprobs; they carry weight version ``default`` at step 0, ``step-<k>`` after k refits;
2. the trainer's own logprobs of the same tokens: the project's model forward
   (``models.qwen3_5_moe.forward_hidden``) over prompt + output, teacher-forced, one ragged
   batch; prints the largest |rollout logprob - trainer logprob| (the training-inference
   mismatch, natural-log units; f32 target <= 1e-5);
3. ``--grad-steps`` Adam steps of REINFORCE with a GRPO baseline on ``lm_head`` and the final
   norm (reward: the fraction of even token ids in a sample's output; advantage: reward minus
   its group's mean), everything else frozen;
4. refit: the two trained leaves, under their checkpoint names (``lm_head.weight`` [V, H],
   ``model.language_model.norm.weight`` [H], as ``model_executor/tensor_update.py`` takes
   them), into every replica with ``update_weights_from_tensor``.

Per step it prints rollout tokens/s (output tokens of the step / wall seconds of the
rollout), refit seconds, the max logprob gap and the mean reward; ``--out FILE`` also writes
those records as JSON. Ray is shut down at the end (its processes stop with it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Count with me: 1 2 3 4", "Once upon a time there",
           "The quick brown fox jumps", "def fibonacci(n):", "Water boils at a temperature of"]
NORM, HEAD = "model.language_model.norm.weight", "lm_head.weight"
ENGINE_ARGS = dict(dtype="float32", page_size=16, context_length=128, chunked_prefill_size=64,
                   max_running_requests=16, skip_warmup=True, random_seed=0, log_level="warning")


class Trainer:
    """Holds the model (f32 params, frozen trunk) and trains ``lm_head`` [V, H] and the final
    norm's weight [H] (zero-centred: the norm multiplies by ``1 + w``)."""

    def __init__(self, lr: float = 5e-3):
        import jax
        import jax.numpy as jnp

        from sglang_tpu_backend.model_loader.loader import load_model
        from sglang_tpu_backend.model_loader.tiny_model import default_model_path
        from sglang_tpu_backend.tokenizer import load_tokenizer

        path = default_model_path()
        self.cfg, self.params = load_model(path, dtype=jnp.float32)
        self.tokenizer = load_tokenizer(path)
        self.lr = lr
        self.train = {"norm": self.params["norm"], "lm_head": self.params["lm_head"]}
        self.adam = (jax.tree.map(jnp.zeros_like, self.train),
                     jax.tree.map(jnp.zeros_like, self.train), 0)
        self._features = jax.jit(self._features_fn, static_argnames=("cfg",))
        self._grad = jax.jit(jax.value_and_grad(_loss))

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [list(self.tokenizer.encode(p)) for p in prompts]

    @staticmethod
    def _features_fn(params, cache, batch, cfg):
        from sglang_tpu_backend.models.qwen3_5_moe import forward_hidden

        # The final norm at w = 0 gives x * rsqrt(mean(x^2) + eps) exactly; the head applies
        # (1 + w) itself (the same f32 product as layers.rms_norm), so w gets a gradient.
        frozen = {**params, "norm": params["norm"] * 0.0}
        hidden, _, _, _ = forward_hidden(frozen, cache, batch, cfg, "auto")
        return hidden[batch.logits_indices]  # [L, H]

    def features(self, seqs: list[tuple[list[int], list[int]]]):
        """Teacher-forced final hidden rows (before the norm's weight) predicting each output
        token: f32[L, H] with L = total output tokens, and the target ids i32[L]."""
        import jax.numpy as jnp

        from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
        from sglang_tpu_backend.models.qwen3_5_moe import init_cache

        page = 16
        chunks, targets, first_page = [], [], 0
        for slot, (prompt, out) in enumerate(seqs):
            toks = prompt + out[:-1]
            pages = list(range(first_page, first_page + -(-len(toks) // page)))
            first_page += len(pages)
            chunks.append(SeqChunk(toks, 0, pages, slot, logits="all"))
            targets.extend(out)
        batch, rows = build_forward_batch(chunks, page_size=page)
        keep = np.concatenate([r[len(p) - 1:] for r, (p, _) in zip(rows, seqs)])
        cache = init_cache(self.cfg, num_pages=first_page, page_size=page,
                           num_state_slots=len(seqs), kv_dtype=jnp.float32)
        feats = self._features(self.params, cache, batch, self.cfg)
        return feats[keep], jnp.asarray(targets, jnp.int32)

    def step(self, groups: list[list[dict]], prompt_ids: list[list[int]], temperature: float,
             grad_steps: int) -> dict:
        """Score a rollout, then train on it. Returns ``max_gap`` (max |rollout - trainer|
        logprob), ``reward`` (mean), ``loss`` and the trained leaves under checkpoint names
        (numpy f32) in ``named``."""
        import jax
        import jax.numpy as jnp

        seqs = [(p, s["output_ids"]) for p, g in zip(prompt_ids, groups) for s in g]
        rollout_lp = np.array([e[0] for g in groups for s in g
                               for e in s["meta_info"]["output_token_logprobs"]], np.float64)
        feats, targets = self.features(seqs)
        mine = np.asarray(_token_logprobs(self.train, feats, targets, temperature))
        rewards = np.array([[np.mean([t % 2 == 0 for t in s["output_ids"]]) for s in g]
                            for g in groups])
        adv = (rewards - rewards.mean(axis=1, keepdims=True)).reshape(-1)
        lens = [len(o) for _, o in seqs]
        weights = jnp.asarray(np.repeat(adv / np.asarray(lens), lens) / len(seqs), jnp.float32)
        loss = 0.0
        for _ in range(grad_steps):
            loss, grads = self._grad(self.train, feats, targets, weights, temperature)
            self.train, self.adam = _adam(self.train, grads, self.adam, self.lr)
        self.params = {**self.params, **self.train}
        named = {NORM: np.asarray(self.train["norm"], np.float32),
                 HEAD: np.asarray(self.train["lm_head"], np.float32)}
        jax.block_until_ready(self.train)
        gaps = np.abs(mine - rollout_lp)
        return {"max_gap": float(gaps.max()), "logprob_at_max_gap": float(rollout_lp[gaps.argmax()]),
                "reward": float(rewards.mean()), "loss": float(loss), "named": named}


def _token_logprobs(train, feats, targets, temperature):
    """log softmax((feats * (1 + norm)) @ lm_head.T / T) at targets: f32[L] (natural log)."""
    import jax
    import jax.numpy as jnp

    logits = ((feats * (1.0 + train["norm"])) @ train["lm_head"].T).astype(jnp.float32)
    lp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]


def _loss(train, feats, targets, weights, temperature):
    """REINFORCE: -sum(advantage-weighted token logprobs); ``weights`` f32[L]."""
    return -(weights * _token_logprobs(train, feats, targets, temperature)).sum()


def _adam(params, grads, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    import jax
    import jax.numpy as jnp

    m, v, t = state
    t += 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    params = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - b1 ** t))
                          / (jnp.sqrt(v / (1 - b2 ** t)) + eps), params, m, v)
    return params, (m, v, t)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help=f"at most {len(PROMPTS)}")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (a GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--grad-steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--seed", type=int, default=0, help="step k samples with seed + k")
    ap.add_argument("--fixed-seed", action="store_true",
                    help="the same sampling seed every step: draws then differ only through "
                         "the weights")
    ap.add_argument("--temp-dir", default=None, help="Ray's temp dir (default: Ray's)")
    ap.add_argument("--out", default=None, help="write the per-step records here (JSON)")
    return ap.parse_args(argv)


def run(args, ray) -> list[dict]:
    from ray_app.rollout import RolloutGroup

    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    trainer = ray.remote(Trainer).options(num_cpus=1).remote(args.lr)
    group = RolloutGroup(args.replicas, ENGINE_ARGS, num_cpus=1, env=env)
    try:
        prompt_ids = ray.get(trainer.encode.remote(PROMPTS[:args.prompts]))
        sp = {"temperature": 1.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
        records = []
        for k in range(args.steps):
            seed = args.seed + (0 if args.fixed_seed else 1000 * k)  # sample j: seed + j
            t0 = time.perf_counter()
            groups = group.generate(prompt_ids, dict(sp, seed=seed), n=args.n)
            roll_s = time.perf_counter() - t0
            toks = sum(len(s["output_ids"]) for g in groups for s in g)
            res = ray.get(trainer.step.remote(groups, prompt_ids, 1.0, args.grad_steps))
            version = f"step-{k + 1}"
            refit_s = group.update_weights_from_tensor(res["named"], weight_version=version)
            rec = {"step": k, "rollout_tok_s": toks / roll_s, "rollout_s": roll_s,
                   "refit_s": refit_s, "max_gap": res["max_gap"], "reward": res["reward"],
                   "logprob_at_max_gap": res["logprob_at_max_gap"],
                   "loss": res["loss"],
                   "weight_versions": sorted({s["meta_info"]["weight_version"]
                                              for g in groups for s in g}),
                   "logprobs0": [e[0] for e in groups[0][0]["meta_info"]["output_token_logprobs"]],
                   "output_ids0": groups[0][0]["output_ids"]}
            records.append(rec)
            print(f"step {k}: rollout {toks} tok in {roll_s:.2f} s ({rec['rollout_tok_s']:.1f} "
                  f"tok/s), refit {refit_s:.3f} s, max |logprob gap| {rec['max_gap']:.2e} "
                  f"(at logprob {rec['logprob_at_max_gap']:.2f}), "
                  f"reward {rec['reward']:.3f}, weight_version {rec['weight_versions']}",
                  flush=True)
        return records
    finally:
        group.shutdown()
        ray.kill(trainer)


def main(argv=None) -> list[dict]:
    import ray

    args = parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be 1..{len(PROMPTS)}")
    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    os.environ.update(env)
    t0 = time.perf_counter()
    ray.init(num_cpus=args.replicas + 1, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=args.temp_dir, runtime_env={"env_vars": env}, log_to_driver=True)
    try:
        records = run(args, ray)
    finally:
        ray.shutdown()
    print(f"total {time.perf_counter() - t0:.1f} s (Ray start, engines, trainer, "
          f"{args.steps} steps)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(records))
    return records


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
