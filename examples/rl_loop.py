"""A small RL loop on the tiny model: a JAX trainer actor + a Ray rollout group (issue 37).

    .venv/bin/python examples/rl_loop.py --steps 3          # --replicas 2 --prompts 2 --n 4

Starts a local Ray cluster (127.0.0.1), a ``Trainer`` actor holding the tiny default
checkpoint's params in f32 (the project's loader; nothing is downloaded) and a
``ray_app.rollout.RolloutGroup`` of ``--replicas`` f32 engines on the same checkpoint. Each step:

1. rollout: ``--prompts`` prompts x ``--n`` samples (temperature 1, ``--max-new-tokens``
   each, seed ``--seed + 1000 k`` at step k, sample j of a prompt ``+ j``), with output token
   logprobs; they carry weight version ``default`` at step 0, ``step-<k>`` after k refits;
2. the trainer's own logprobs of the same tokens: the project's model forward
   (``models.qwen3_5_moe.forward_hidden``), teacher-forced, replaying the engines' schedule
   at their step shapes (the engines run ``enable_deterministic_inference``: prompts
   prefilled in prefill-only steps of one fixed shape, then one DECODE step of one fixed
   shape per output token), then the engine's head and sampler math (temperature,
   log-softmax, f32, jitted); prints the largest |rollout logprob - trainer logprob| (the
   training-inference mismatch, natural-log units; f32 target <= 1e-5; measured 0).
   ``--one-pass`` scores with one teacher-forced pass over prompt + output instead (other
   program shapes, the GDN chunked path for output tokens: f32 rounding gaps of 1e-6 to
   1e-5 that grow with the trained head);
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
# Deterministic inference: every engine step has one of two fixed shapes (the trainer's replay
# runs the same two programs, so it rounds as the engine does; see ``Trainer.replay_features``).
ENGINE_ARGS = dict(dtype="float32", page_size=16, context_length=128, chunked_prefill_size=64,
                   max_running_requests=16, skip_warmup=True, random_seed=0, log_level="warning",
                   enable_deterministic_inference=True)


class Trainer:
    """Holds the model (f32 params, frozen trunk) and trains ``lm_head`` [V, H] and the final
    norm's weight [H] (zero-centred: the norm multiplies by ``1 + w``). ``engine_args``: the
    rollout engines' ServerArgs fields (the replay's step shapes come from them);
    ``one_pass``: score with one teacher-forced pass instead of the replay."""

    def __init__(self, lr: float = 5e-3, engine_args: dict | None = None, one_pass: bool = False):
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
        self._step = jax.jit(_hidden_rows, static_argnames=("cfg",), donate_argnames=("cache",))
        self.shapes = engine_shapes(dict(ENGINE_ARGS if engine_args is None else engine_args))
        self.one_pass = one_pass
        self._grad = jax.jit(jax.value_and_grad(_loss))
        # Jitted like the engine's head and sampler: XLA:CPU rounds a small eager matmul
        # differently from the jitted one of the same shapes (measured at 2-24 rows).
        self._logprobs = jax.jit(_token_logprobs)

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
        """f32[L, H] final hidden rows (before the norm's weight) predicting each output
        token, sequence-major, and the target ids i32[L]: ``replay_features`` (default) or
        ``one_pass_features``."""
        if self.one_pass:
            return self.one_pass_features(seqs)
        return self.replay_features(seqs)

    def replay_features(self, seqs: list[tuple[list[int], list[int]]]):
        """``features`` by replaying the engine's schedule, teacher-forced, at its step shapes:
        each prompt prefilled in chunks ending at multiples of 64 or at its end (prefill-only
        steps of the deterministic prefill shape), then one DECODE step per output token but
        the last (GDN recurrent path), at the deterministic DECODE shape. At a fixed shape a
        row's result does not depend on the other rows (README, Deterministic inference), so
        these are the engine's own hidden rows for the same tokens and weights."""
        import jax.numpy as jnp

        from sglang_tpu_backend.models.qwen3_5_moe import init_cache

        sh = self.shapes
        P = sh["pages_per_seq"]
        cache = init_cache(self.cfg, num_pages=len(seqs) * P, page_size=sh["page_size"],
                           num_state_slots=len(seqs), kv_dtype=jnp.float32)
        rows = [[None] * len(out) for _, out in seqs]  # [seq][output index] -> f32[H]
        for mode, T, R, L, chunks, owners in replay_steps(seqs, sh):
            batch, per_chunk = build_step(chunks, sh, mode, T, R, L)
            hidden, cache = self._step(self.params, cache, batch, cfg=self.cfg)
            hidden = np.asarray(hidden)
            for (i, j), r in zip(owners, per_chunk):
                if j is not None:
                    rows[i][j] = hidden[r[-1]]
        feats = np.stack([h for seq_rows in rows for h in seq_rows])
        targets = [t for _, out in seqs for t in out]
        return jnp.asarray(feats), jnp.asarray(targets, jnp.int32)

    def one_pass_features(self, seqs: list[tuple[list[int], list[int]]]):
        """``features`` from one teacher-forced pass (prompt + output as one prefill, every
        sequence in one ragged batch): other shapes and the GDN chunked path for the output
        tokens, so the rows round differently from the engine's (``--one-pass``)."""
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
        mine = np.asarray(self._logprobs(self.train, feats, targets, temperature))
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
    """log softmax((feats * (1 + norm)) @ lm_head.T / T) at targets: f32[L] (natural log).
    feats f32[L, H], targets i32[L]. Jitted by the trainer (``Trainer._logprobs``), as the
    engine's head and sampler are."""
    return logprobs_at(head_logits(train, feats), targets, temperature)


def head_logits(train, feats):
    """The engine's head on the trainer's features: ``layers.rms_norm``'s weight product, then
    ``qwen3_5_moe.compute_logits``' matmul. feats f32[L, H] -> f32[L, V]."""
    import jax.numpy as jnp

    return ((feats * (1.0 + train["norm"])) @ train["lm_head"].T).astype(jnp.float32)


def logprobs_at(logits, targets, temperature):
    """The engine sampler's reported logprobs (``sampling.sampler.draw_logits``: the logits
    divided by the temperature, then ``jax.nn.log_softmax`` over the vocabulary, f32) at
    ``targets``: logits f32[L, V], targets i32[L] -> f32[L]."""
    import jax
    import jax.numpy as jnp

    lp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]


def _hidden_rows(params, cache, batch, cfg):
    """One engine step's forward, trunk and final norm at w = 0 (see ``_features_fn``), with
    the deterministic engine's batch-invariant attention: (f32[L, H] rows
    ``batch.logits_indices``, cache)."""
    from sglang_tpu_backend.models.qwen3_5_moe import forward_hidden

    frozen = {**params, "norm": params["norm"] * 0.0}
    hidden, cache, _, _ = forward_hidden(frozen, cache, batch, cfg, "auto", batch_invariant=True)
    return hidden[batch.logits_indices], cache


def engine_shapes(engine_args: dict) -> dict:
    """The deterministic engine's two step shapes and paging, from its ServerArgs fields:
    ``decode`` and ``prefill`` (mode, T, R, L), ``page_size``, ``pages_per_seq`` and the
    prefill chunk grid ``chunk`` (tokens)."""
    from sglang_tpu_backend.model_executor.step_buckets import deterministic_shapes
    from sglang_tpu_backend.model_loader.tiny_model import default_model_path
    from sglang_tpu_backend.server_args import DETERMINISTIC_MIN_CHUNK, ServerArgs

    args = ServerArgs(model_path=str(default_model_path()), **engine_args)
    if not args.enable_deterministic_inference:
        raise ValueError("the replay needs enable_deterministic_inference (fixed step shapes)")
    decode, prefill = deterministic_shapes(args.max_running_requests, args.max_tokens_per_step)
    return {"decode": decode, "prefill": prefill, "page_size": args.page_size,
            "pages_per_seq": -(-args.context_length // args.page_size),
            "chunk": DETERMINISTIC_MIN_CHUNK}


def replay_steps(seqs, sh: dict):
    """The engine's steps for teacher-forced ``seqs`` [(prompt ids, output ids)], sequence i in
    state slot i and pages [i * P, (i + 1) * P): yields (mode, T, R, L, chunks, owners), owners
    (i, j) per chunk: its last row predicts output j of sequence i (j None: no output)."""
    from sglang_tpu_backend.model_executor.batch_builder import SeqChunk

    P = sh["pages_per_seq"]
    pages = [list(range(i * P, (i + 1) * P)) for i in range(len(seqs))]
    n_rounds = max(-(-len(p) // sh["chunk"]) for p, _ in seqs)
    for k in range(n_rounds):  # prefill: round k holds chunk k of every prompt that has one
        items = []
        for i, (p, _) in enumerate(seqs):
            a, b = k * sh["chunk"], min(len(p), (k + 1) * sh["chunk"])
            if a < b:
                items.append((SeqChunk(p[a:b], a, pages[i], i), (i, 0 if b == len(p) else None)))
        yield from _pack(items, *sh["prefill"], by_tokens=True)
    for t in range(max(len(o) for _, o in seqs) - 1):  # decode: input out[t] predicts out[t + 1]
        items = [(SeqChunk([o[t]], len(p) + t, pages[i], i), (i, t + 1))
                 for i, (p, o) in enumerate(seqs) if t + 1 < len(o)]
        yield from _pack(items, *sh["decode"], by_tokens=False)


def _pack(items, mode, T, R, L, by_tokens):
    """Split (chunk, owner) items into steps of at most R chunks (and T tokens): yields
    (mode, T, R, L, chunks, owners)."""
    step: list = []
    for item in items:
        n_tok = sum(len(c.token_ids) for c, _ in step) + len(item[0].token_ids)
        if step and (len(step) == R or (by_tokens and n_tok > T)):
            yield mode, T, R, L, [c for c, _ in step], [o for _, o in step]
            step = []
        step.append(item)
    if step:
        yield mode, T, R, L, [c for c, _ in step], [o for _, o in step]


def build_step(chunks, sh: dict, mode, T, R, L):
    """A numpy ForwardBatch of ``chunks`` padded to the step shape (T, R, L) and the engine's
    page table width; and each chunk's logits rows (``batch_builder.build_forward_batch``)."""
    from sglang_tpu_backend.model_executor.batch_builder import build_forward_batch

    return build_forward_batch(chunks, page_size=sh["page_size"], mode=mode, num_tokens=T,
                               num_seqs=R, pages_per_seq=sh["pages_per_seq"], num_logits=L)


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
    ap.add_argument("--one-pass", action="store_true",
                    help="the trainer scores with one teacher-forced pass instead of replaying "
                         "the engine's schedule (other shapes: f32 rounding gaps)")
    ap.add_argument("--temp-dir", default=None, help="Ray's temp dir (default: Ray's)")
    ap.add_argument("--out", default=None, help="write the per-step records here (JSON)")
    return ap.parse_args(argv)


def run(args, ray) -> list[dict]:
    from ray_app.rollout import RolloutGroup

    env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    trainer = ray.remote(Trainer).options(num_cpus=1).remote(args.lr, ENGINE_ARGS, args.one_pass)
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
