"""A rollout group: N offline engines as Ray actors, driven as one rollout service (issue 37).

    group = RolloutGroup(2, dict(dtype="float32", skip_warmup=True, random_seed=0))
    groups = group.generate(["a", "b"], {"max_new_tokens": 8, "temperature": 1.0, "seed": 0}, n=4)
    groups[1][3]["output_ids"], groups[1][3]["meta_info"]["weight_version"]
    seconds = group.update_weights_from_tensor({"lm_head.weight": w}, weight_version="step-1")
    group.shutdown()

Each replica is one Ray actor (``EngineActor``) holding one ``entrypoints.offline.OfflineEngine``
built from ``ServerArgs`` fields in its own process (one host; a replica spanning several
hosts, ``--nnodes > 1``, is out of scope here: build those with ``ray_app.multihost``). The
driver API is plain and explicit: every call is a fan-out of ``actor.method.remote(...)``
followed by ``ray.get`` per replica; an exception in a replica is raised again as
``RolloutError`` naming the replica (``replica 1: ...``), and a refused weight update
(``success: false``) is one too.

- ``generate(prompts, sampling_params, n)``: prompt ``i`` (a string or a list of token ids)
  and its ``n`` samples (a GRPO group) run on replica ``i % N``; returns, per prompt in
  order, the list of its ``n`` outputs in order, each the offline engine's dict ``{"text",
  "output_ids", "meta_info"}`` with ``meta_info["output_token_logprobs"]`` (``[logprob,
  token_id, None]`` per output token, natural log, at the sampling temperature; the engine
  computes logprobs of the processed logits) and ``meta_info["weight_version"]``. With a
  ``seed`` in ``sampling_params`` sample ``j`` of every prompt draws with seed ``seed + j``
  (SGLang's ``n`` expansion), so outputs do not depend on N.
- ``update_weights_from_tensor(named_tensors, weight_version)``: the arrays (checkpoint
  names, numpy) go into the object store once (``ray.put``) and every replica reads the same
  object; returns the wall seconds until every replica serves them.
- ``release_memory_occupation`` / ``resume_memory_occupation`` (tags ``["kv_cache"]``,
  ``["weights"]`` or None), ``pause_generation(mode)`` / ``continue_generation()``,
  ``abort(rid, abort_all)``, ``flush_cache()``, ``get_weight_version()``: on every replica.
- ``submit(...)`` starts a ``generate`` and returns a ``PendingRollout`` (``result()``), so a
  driver can pause or abort a rollout in flight (partial rollouts). Actors run up to
  ``ACTOR_CONCURRENCY`` calls at a time (threads) for that.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

ACTOR_CONCURRENCY = 8  # generate + pause / abort / info calls in flight on one replica
DEFAULT_TIMEOUT_S = 600.0


class RolloutError(RuntimeError):
    """A replica's call failed or was refused; the message names the replica."""


class EngineActor:
    """One rollout replica: an ``OfflineEngine`` in this actor's process (wrapped by
    ``ray.remote`` in ``RolloutGroup``). ``engine_args``: ``ServerArgs`` fields."""

    def __init__(self, engine_args: Mapping[str, Any], env: Mapping[str, str] | None = None):
        import os

        os.environ.update(env or {})
        from sglang_tpu_backend.entrypoints.offline import OfflineEngine

        self.engine = OfflineEngine(**dict(engine_args))
        # Starts the offline engine's private loop on this thread, before concurrent calls.
        self.engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})

    def ready(self) -> bool:
        return True

    def generate(self, prompts: list, sampling_params: dict | None, n: int,
                 return_logprob: bool = True) -> list[dict]:
        """Outputs of ``prompts`` (each text or token ids) with ``n`` samples each, flat:
        prompt-major (prompt ``i`` sample ``j`` at ``i * n + j``)."""
        sp = dict(sampling_params or {}, n=n)
        text = [p for p in prompts if isinstance(p, str)]
        if text and len(text) != len(prompts):
            raise ValueError("prompts: all strings or all token id lists")
        outs = self.engine.generate(prompts if text else None, sp,
                                    None if text else [list(map(int, p)) for p in prompts],
                                    return_logprob=return_logprob)
        return outs if isinstance(outs, list) else [outs]

    def update_weights_from_tensor(self, named: dict, weight_version: str | None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        return self.engine.update_weights_from_tensor(list(named.items()),
                                                      flush_cache=flush_cache,
                                                      weight_version=weight_version)

    def call(self, method: str, *args, **kwargs):
        """``engine.<method>(*args, **kwargs)`` for the plain control calls."""
        return getattr(self.engine, method)(*args, **kwargs)

    def shutdown(self) -> None:
        self.engine.shutdown()


class PendingRollout:
    """A ``generate`` in flight: ``result()`` waits and returns what ``generate`` returns."""

    def __init__(self, group: "RolloutGroup", refs: list, slots: list[list[int]],
                 num_prompts: int, n: int):
        self._group, self._refs, self._slots = group, refs, slots
        self._num_prompts, self._n = num_prompts, n

    def result(self, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[list[dict]]:
        per_replica = self._group._get(self._refs, timeout_s)
        groups: list[list[dict]] = [[] for _ in range(self._num_prompts)]
        for replica, (prompt_ids, outs) in enumerate(zip(self._slots, per_replica)):
            if len(outs) != len(prompt_ids) * self._n:
                raise RolloutError(f"replica {replica}: {len(outs)} outputs for "
                                   f"{len(prompt_ids)} prompts x n={self._n}")
            for k, i in enumerate(prompt_ids):
                groups[i] = outs[k * self._n:(k + 1) * self._n]
        return groups


class RolloutGroup:
    """``num_replicas`` engine actors on the running Ray cluster (``ray.init`` first).

    ``engine_args``: ``ServerArgs`` fields for every replica (``dtype``, ``model_path``, ...);
    ``num_cpus`` / ``resources``: each actor's Ray resources (on a TPU host, e.g.
    ``{"TPU": 4}``); ``env``: environment variables set in each actor before the engine
    starts (e.g. ``JAX_PLATFORMS``). Blocks until every engine has started.
    """

    def __init__(self, num_replicas: int, engine_args: Mapping[str, Any] | None = None, *,
                 num_cpus: float = 1.0, resources: Mapping[str, float] | None = None,
                 env: Mapping[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        import ray

        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        remote = ray.remote(EngineActor).options(num_cpus=num_cpus, resources=dict(resources or {}),
                                                 max_concurrency=ACTOR_CONCURRENCY)
        self.replicas = [remote.remote(dict(engine_args or {}), dict(env or {}))
                         for _ in range(num_replicas)]
        try:
            self._get([r.ready.remote() for r in self.replicas], timeout_s)
        except BaseException:
            for r in self.replicas:  # the ones that did start
                ray.kill(r)
            raise

    # Fan-out helpers -------------------------------------------------------------------------
    def _get(self, refs: list, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list:
        """``ray.get`` of one ref per replica; a failure raises RolloutError naming it."""
        import ray

        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except Exception as e:  # noqa: BLE001 - re-raised with the replica's index
                cause = getattr(e, "cause", None) or e
                raise RolloutError(f"replica {i}: {type(cause).__name__}: {cause}") from e
        return out

    def _all(self, method: str, *args, **kwargs) -> list:
        return self._get([r.call.remote(method, *args, **kwargs) for r in self.replicas])

    # Rollouts --------------------------------------------------------------------------------
    def submit(self, prompts: Sequence[str | Sequence[int]], sampling_params: dict | None = None,
               n: int = 1, return_logprob: bool = True) -> PendingRollout:
        """Start ``generate`` and return at once (see ``generate``)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        num = len(self.replicas)
        slots = [list(range(len(prompts)))[k::num] for k in range(num)]
        slots = [s for s in slots if s]
        refs = [self.replicas[k].generate.remote([prompts[i] for i in s], sampling_params, n,
                                                 return_logprob)
                for k, s in enumerate(slots)]
        return PendingRollout(self, refs, slots, len(prompts), n)

    def generate(self, prompts: Sequence[str | Sequence[int]], sampling_params: dict | None = None,
                 n: int = 1, return_logprob: bool = True) -> list[list[dict]]:
        """Per prompt (in order) its ``n`` samples (in order): ``{"text", "output_ids",
        "meta_info"}`` with output token logprobs (natural log) and ``weight_version``."""
        return self.submit(prompts, sampling_params, n, return_logprob).result()

    # Weights and memory ----------------------------------------------------------------------
    def update_weights_from_tensor(self, named_tensors: Mapping[str, Any] | Sequence[tuple],
                                   weight_version: str | None = None,
                                   flush_cache: bool = True) -> float:
        """Refit every replica with checkpoint-named arrays (numpy; any subset of the names).
        The arrays are put in the object store once. Returns wall seconds (put + every
        replica serving the new weights); a refusal raises RolloutError naming the replica."""
        import ray

        t0 = time.perf_counter()
        named = {k: np.asarray(v) for k, v in dict(named_tensors).items()}
        ref = ray.put(named)
        results = self._get([r.update_weights_from_tensor.remote(ref, weight_version, flush_cache)
                             for r in self.replicas])
        for i, (ok, message) in enumerate(results):
            if not ok:
                raise RolloutError(f"replica {i}: update_weights_from_tensor refused: {message}")
        return time.perf_counter() - t0

    def release_memory_occupation(self, tags: list[str] | None = None) -> list[dict]:
        return self._all("release_memory_occupation", tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> list[dict]:
        return self._all("resume_memory_occupation", tags)

    def pause_generation(self, mode: str = "abort") -> list[dict]:
        return self._all("pause_generation", mode)

    def continue_generation(self) -> list[dict]:
        return self._all("continue_generation")

    def abort(self, rid: str = "", abort_all: bool = False) -> list[bool]:
        """Abort ``rid`` (on whichever replica runs it) or, with ``abort_all``, everything."""
        return self._all("abort_request", rid, abort_all)

    def flush_cache(self) -> list[bool]:
        return self._all("flush_cache")

    def get_weight_version(self) -> list[str]:
        return self._all("get_weight_version")

    def shutdown(self) -> None:
        """Stop every engine, then end the actors (``ray.kill``)."""
        import ray

        try:
            self._get([r.shutdown.remote() for r in self.replicas], 60.0)
        finally:
            for r in self.replicas:
                ray.kill(r)
            self.replicas = []
