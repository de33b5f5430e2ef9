"""Where and how a step runs: one device, data-parallel ranks, tensor-parallel heads, or DP
ranks over several processes. ``ModelRunner`` picks one backend (``make_backend``) and talks
to it through ``StepBackend`` alone.

Every backend steps on ``num_ranks`` rank-local ForwardBatches of one bucket (one batch
unless DP) and returns (logits, cache, router stats):
  SingleDeviceBackend  everything on the first device; logits f32[L, V]. The only one that
                       reads in-flight decode inputs on the device (overlap scheduling).
  TPBackend            ``parallel.TPForward``: one pool and one batch, every device runs every
                       request on its share of the heads and experts; logits f32[L, V]
                       replicated, the sampler state replicated beside them. Handover
                       state is converted to / from the one-device head layout. Verify
                       states, commits and the MTP layer's KV split by heads like the cache.
  DPBackend            ``parallel.DPForward``: one rank per device, each with its own pages
                       and slots (``num_pages`` / ``num_state_slots`` per rank); logits
                       f32[D*L, V], rank r's rows at r*L .. r*L+L-1; the sampler state split
                       by global slot ``rank * num_state_slots + slot`` like the caches.
                       Handover state moves rank-locally.
  MultiHostDPBackend   DPBackend over the devices of several processes (this one the leader,
                       ``jax.process_index() == 0``): every step program over the mesh is one
                       all processes enter in the same order, so a step first broadcasts the
                       rank batches to the followers (``parallel/multihost.py``), and logits
                       and router stats are gathered to the host; the sampler and its state
                       live on the leader's first device. Snapshot copies and handover
                       transfers are announced to the followers, which run them too. Weight
                       updates are refused; ``close`` stops the followers.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import jax
import numpy as np

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch
from sglang_tpu_backend.model_executor.state_snapshots import GDNSnapshots
from sglang_tpu_backend.model_executor.state_transfer import StateTransfer
from sglang_tpu_backend.model_loader.sharded_loader import (LoadReport, WeightSource,
                                                             with_native_layouts)
from sglang_tpu_backend.models import qwen3_5_moe

StepOutput = tuple[jax.Array, qwen3_5_moe.ModelCache, Any]  # logits, cache, stats or None


class StepBackend(abc.ABC):
    """Places params, caches and sampler state, and runs the model step, for one layout."""

    num_ranks: int = 1  # DP ranks: rank-local batches per step, logits row blocks
    in_flight_inputs: bool = False  # ``forward`` reads decode inputs from ``last_tokens``
    state_transfer: bool = False  # request state export / install (handover)
    weight_updates: bool = True  # ``place_params`` after start-up
    verify_steps: bool = False  # ``verify``: TARGET_VERIFY steps (speculative decoding)
    hidden_states: bool = False  # hidden states and the MTP programs (NEXTN drafting)
    dp = None  # the DPForward whose rank layout the caches follow (None: one pool)
    tp = None  # the TPForward whose head layout the caches follow (None: whole heads)

    def __init__(self, cfg: ModelConfig, *, impl: str, with_stats: bool | str,
                 batch_invariant: bool):
        """``with_stats``: steps also return the routers' health (``metrics/router_stats.py``);
        ``qwen3_5_moe.ROUTED``: and the routed expert ids (``--enable-return-routed-experts``).
        ``batch_invariant``: see ``qwen3_5_moe.forward``."""
        self.cfg, self.impl = cfg, impl
        self.with_stats, self.batch_invariant = with_stats, batch_invariant

    @abc.abstractmethod
    def place_params(self, params: Any) -> Any:
        """Loaded host params placed for the step (shardings, TPU weight layouts)."""

    def param_shardings(self, shapes: Any) -> Any | None:
        """Where each param leaf lives (a mirror of ``shapes``), or None when the step's
        layout is made from the whole params (TP), which then pass through one device."""
        return None

    def placed_param_shapes(self, source: WeightSource) -> Any | None:
        """``load_params(source)``'s params before any is read: ShapeDtypeStructs of their
        shape, dtype, placement and TPU layout (``with_native_layouts``, as the loader places
        them), to lower programs against while the weights load; None where the params are
        placed from the whole tree (``param_shardings`` None)."""
        shapes = source.shapes()
        shardings = self.param_shardings(shapes)
        if shardings is None:
            return None
        return jax.tree.map(lambda s, f: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=f),
                            shapes, with_native_layouts(shapes, shardings))

    def load_params(self, source: WeightSource) -> tuple[Any, LoadReport]:
        """``source``'s weights placed for the step: read (or drawn) straight into
        ``param_shardings``, each process reading only its devices' share, else whole and
        then placed by ``place_params``."""
        shardings = self.param_shardings(source.shapes())
        if shardings is None:
            params, report = source.host()
            return self.place_params(params), report
        return source.load(shardings)

    @abc.abstractmethod
    def init_cache(self, *, num_pages: int, page_size: int, num_state_slots: int, kv_dtype: Any,
                   state_dtype: Any) -> qwen3_5_moe.ModelCache:
        """Zeroed KV pages and GDN state slots (sizes per rank)."""

    def make_transfer(self, num_pages: int, num_state_slots: int) -> StateTransfer:
        """The handover's export / install programs over this layout's cache."""
        return StateTransfer(num_pages, num_state_slots, self.dp, self.tp)

    def make_snapshots(self, cache: qwen3_5_moe.ModelCache, num_snapshots: int, max_copies: int
                       ) -> GDNSnapshots | None:
        """The prefix cache's GDN snapshots per rank (None when ``num_snapshots`` is 0)."""
        return GDNSnapshots(cache, num_snapshots, max_copies, self.dp) if num_snapshots else None

    @abc.abstractmethod
    def place_sampler_state(self, counts: jax.Array, prompt_mask: jax.Array,
                            last_tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The sampler state (``sampler_state.SamplerState``) placed beside the logits."""

    @abc.abstractmethod
    def forward(self, params: Any, cache: qwen3_5_moe.ModelCache, batches: Sequence[ForwardBatch],
                from_slot: np.ndarray | None = None, last_tokens: jax.Array | None = None
                ) -> StepOutput:
        """One step on ``num_ranks`` numpy batches of one bucket (cache donated): (logits
        f32[num_ranks*L, V], new cache, router stats or None: health f32[num_ranks*layers, 3]
        and rows per physical expert slot f32[layers, P], ``metrics/router_stats.py``).
        ``from_slot`` i32[T] / ``last_tokens`` i32[S]: see ``in_flight_inputs``."""

    def verify(self, params: Any, cache: qwen3_5_moe.ModelCache, batches: Sequence[ForwardBatch]
               ) -> tuple[jax.Array, qwen3_5_moe.ModelCache, Any]:
        """One TARGET_VERIFY step (``model_executor/verify.py``): (logits f32[L, V], the
        cache with KV written and GDN slots unchanged, ``VerifyStates``)."""
        raise NotImplementedError(f"speculative decoding is not supported with "
                                  f"{type(self).__name__}")

    def forward_hidden(self, params: Any, cache: qwen3_5_moe.ModelCache,
                       batches: Sequence[ForwardBatch]) -> tuple[StepOutput, jax.Array]:
        """``forward`` (no in-flight inputs), and every row's hidden state [T, H] after the
        final norm (NEXTN: the MTP drafter's input, ``nextn_step.py``)."""
        raise NotImplementedError(f"NEXTN drafting is not supported with {type(self).__name__}")

    def verify_hidden(self, params: Any, cache: qwen3_5_moe.ModelCache,
                      batches: Sequence[ForwardBatch]) -> tuple[tuple, jax.Array]:
        """``verify``, and every row's hidden state [T, H] after the final norm."""
        raise NotImplementedError(f"NEXTN drafting is not supported with {type(self).__name__}")

    def place_mtp_params(self, mtp_params: Any) -> Any:
        """The MTP params (``models/mtp.py``) placed beside the main ones."""
        raise NotImplementedError(f"NEXTN drafting is not supported with {type(self).__name__}")

    def init_mtp_cache(self, *, num_pages: int, page_size: int, kv_dtype: Any) -> jax.Array:
        """Zeroed MTP KV pages, ``num_pages`` per rank (``mtp.init_mtp_cache``)."""
        raise NotImplementedError(f"NEXTN drafting is not supported with {type(self).__name__}")

    def mtp_drafts(self, params: Any, mtp_params: Any, cache: jax.Array,
                   batches: Sequence[ForwardBatch], hidden: jax.Array, inps: Sequence[Any],
                   sampled: jax.Array, accepted_len: Any, num_steps: int
                   ) -> tuple[jax.Array, jax.Array]:
        """``nextn_step.mtp_drafts`` on every rank (one batch and ``MtpInputs`` per rank;
        cache donated): (drafts i32[num_ranks*R, num_steps], cache)."""
        raise NotImplementedError(f"NEXTN drafting is not supported with {type(self).__name__}")

    def commit(self, params: Any, cache: qwen3_5_moe.ModelCache, states: Any, slots: np.ndarray,
               accepted_len: jax.Array) -> qwen3_5_moe.ModelCache:
        """Each verified request's GDN slot := its state after ``accepted_len`` positions
        (``verify.commit_accepted``; slots i32[num_ranks*R], rank-local ids)."""
        from sglang_tpu_backend.model_executor.verify import commit_accepted_jit

        return commit_accepted_jit(params, cache, states, slots, accepted_len, cfg=self.cfg,
                                   impl=self.impl)

    def close(self) -> None:
        """Release what the backend holds beyond arrays (multi-host: the followers)."""

    def _split(self, out: tuple) -> StepOutput:
        return out[0], out[1], (out[2] if self.with_stats else None)

    @staticmethod
    def _no_in_flight(from_slot: np.ndarray | None) -> None:
        if from_slot is not None:
            raise ValueError("in-flight decode inputs need one device (no DP / TP)")


class SingleDeviceBackend(StepBackend):
    """Everything committed to the first device, as step outputs are: a jit's cache key
    includes whether an argument is committed, so warm-up (fresh arrays) and serving (step
    outputs) must agree or the first real steps compile again."""

    in_flight_inputs = True
    state_transfer = True
    verify_steps = True
    hidden_states = True

    def __init__(self, cfg: ModelConfig, **kw):
        super().__init__(cfg, **kw)
        self.device = jax.devices()[0]
        # One module-level jit (static cfg/impl, cache donated): runners of equal shapes share
        # compilations. Benchmarks swap in variants of it.
        self.forward_fn = qwen3_5_moe.forward_jit

    def place_params(self, params):
        from jax.sharding import SingleDeviceSharding

        from sglang_tpu_backend.model_executor.weight_layout import place_weights

        where = SingleDeviceSharding(self.device)
        return place_weights(params, jax.tree.map(lambda _: where, params))

    def param_shardings(self, shapes):
        from jax.sharding import SingleDeviceSharding

        return jax.tree.map(lambda _: SingleDeviceSharding(self.device), shapes)

    def init_cache(self, **sizes):
        return jax.device_put(qwen3_5_moe.init_cache(self.cfg, **sizes), self.device)

    def place_sampler_state(self, counts, prompt_mask, last_tokens):
        return jax.device_put((counts, prompt_mask, last_tokens), self.device)

    def forward(self, params, cache, batches, from_slot=None, last_tokens=None):
        if from_slot is not None:
            raise ValueError("in-flight input ids are resolved as the batch is placed "
                             "(ModelRunner.place_batch), not here")
        (fb,) = batches
        return self._split(self.forward_fn(params, cache, fb, **self._forward_static()))

    def lower_forward(self, params, cache, batches) -> jax.stages.Lowered:
        """``forward``'s program lowered for these arguments (``parallel_compile``)."""
        (fb,) = batches
        return self.forward_fn.lower(params, cache, fb, **self._forward_static())

    def _forward_static(self) -> dict[str, Any]:
        return dict(cfg=self.cfg, impl=self.impl, with_stats=self.with_stats,
                    batch_invariant=self.batch_invariant)

    def verify(self, params, cache, batches):
        from sglang_tpu_backend.model_executor.verify import forward_verify_jit

        (fb,) = batches
        return forward_verify_jit(params, cache, fb, cfg=self.cfg, impl=self.impl,
                                  batch_invariant=self.batch_invariant)

    def forward_hidden(self, params, cache, batches):
        (fb,) = batches
        *out, hidden = qwen3_5_moe.forward_jit(
            params, cache, fb, cfg=self.cfg, impl=self.impl, with_stats=self.with_stats,
            batch_invariant=self.batch_invariant, with_hidden=True)
        return self._split(tuple(out)), hidden

    def verify_hidden(self, params, cache, batches):
        from sglang_tpu_backend.model_executor.verify import forward_verify_jit

        (fb,) = batches
        *out, hidden = forward_verify_jit(params, cache, fb, cfg=self.cfg, impl=self.impl,
                                          batch_invariant=self.batch_invariant, with_hidden=True)
        return tuple(out), hidden

    def place_mtp_params(self, mtp_params):
        return self.place_params(mtp_params)

    def init_mtp_cache(self, **sizes):
        from sglang_tpu_backend.models.mtp import init_mtp_cache

        return jax.device_put(init_mtp_cache(self.cfg, **sizes), self.device)

    def mtp_drafts(self, params, mtp_params, cache, batches, hidden, inps, sampled,
                   accepted_len, num_steps):
        from sglang_tpu_backend.model_executor.nextn_step import mtp_drafts_jit

        (fb,), (inp,) = batches, inps
        sampled = jax.device_put(sampled, self.device)  # warm-up's and serving's placement
        return mtp_drafts_jit(params, mtp_params, cache, fb, hidden, inp, sampled, accepted_len,
                              cfg=self.cfg, impl=self.impl, num_steps=num_steps)


class TPBackend(StepBackend):
    """``parallel.TPForward`` over the first ``tp_size`` devices."""

    state_transfer = True  # converted to / from the one-device layout on the host
    verify_steps = True
    hidden_states = True

    def __init__(self, cfg: ModelConfig, tp_size: int, **kw):
        from sglang_tpu_backend.parallel.mesh import make_mesh
        from sglang_tpu_backend.parallel.tp_forward import TPForward

        super().__init__(cfg, **kw)
        self.tp = TPForward(cfg, make_mesh(tp_size), impl=self.impl, with_stats=self.with_stats,
                            batch_invariant=self.batch_invariant)

    def place_params(self, params):
        return self.tp.shard_params(params)

    def init_cache(self, **sizes):
        return self.tp.init_cache(**sizes)

    def place_sampler_state(self, counts, prompt_mask, last_tokens):
        from jax.sharding import NamedSharding, PartitionSpec

        everywhere = NamedSharding(self.tp.mesh, PartitionSpec())
        return jax.device_put(counts, everywhere), jax.device_put(prompt_mask, everywhere), last_tokens

    def forward(self, params, cache, batches, from_slot=None, last_tokens=None):
        self._no_in_flight(from_slot)
        (fb,) = batches
        return self._split(self.tp(params, cache, self.tp.put_batch(fb)))

    def verify(self, params, cache, batches):
        (fb,) = batches
        return self.tp.verify(params, cache, self.tp.put_batch(fb))

    def forward_hidden(self, params, cache, batches):
        (fb,) = batches
        *out, hidden = self.tp.forward_hidden(params, cache, self.tp.put_batch(fb))
        return self._split(tuple(out)), hidden

    def verify_hidden(self, params, cache, batches):
        (fb,) = batches
        *out, hidden = self.tp.verify_hidden(params, cache, self.tp.put_batch(fb))
        return tuple(out), hidden

    def place_mtp_params(self, mtp_params):
        return self.tp.shard_mtp_params(mtp_params)

    def init_mtp_cache(self, **sizes):
        return self.tp.init_mtp_cache(**sizes)

    def mtp_drafts(self, params, mtp_params, cache, batches, hidden, inps, sampled,
                   accepted_len, num_steps):
        (fb,), (inp,) = batches, inps
        return self.tp.mtp_drafts(params, mtp_params, cache, self.tp.put_batch(fb), hidden, inp,
                                  sampled, accepted_len, num_steps)

    def commit(self, params, cache, states, slots, accepted_len):
        return self.tp.commit(params, cache, states, slots, accepted_len)


class DPBackend(StepBackend):
    """``parallel.DPForward`` over the first ``dp_size`` devices (of every process)."""

    state_transfer = True  # rank-local (``state_transfer.StateTransfer``)
    verify_steps = True
    hidden_states = True

    def __init__(self, cfg: ModelConfig, dp_size: int, **kw):
        from sglang_tpu_backend.parallel.dp_forward import DPForward
        from sglang_tpu_backend.parallel.mesh import make_mesh

        super().__init__(cfg, **kw)
        self.dp = DPForward(cfg, make_mesh(dp_size), impl=self.impl, with_stats=self.with_stats,
                            batch_invariant=self.batch_invariant)
        self.num_ranks = self.dp.dp_size

    def place_params(self, params):
        return self.dp.shard_params(params)

    def param_shardings(self, shapes):
        return self.dp.param_shardings(shapes)

    def init_cache(self, **sizes):
        return self.dp.init_cache(**sizes)

    def place_sampler_state(self, counts, prompt_mask, last_tokens):
        from sglang_tpu_backend.parallel.mesh import rank_spec

        by_slot = self.dp.sharding(rank_spec(self.dp.ep, 0))
        return jax.device_put(counts, by_slot), jax.device_put(prompt_mask, by_slot), last_tokens

    def forward(self, params, cache, batches, from_slot=None, last_tokens=None):
        self._no_in_flight(from_slot)
        return self._split(self.dp(params, cache, self.dp.put_batch(batches)))

    def verify(self, params, cache, batches):
        return self.dp.verify(params, cache, self.dp.put_batch(batches))

    def forward_hidden(self, params, cache, batches):
        *out, hidden = self.dp.forward_hidden(params, cache, self.dp.put_batch(batches))
        return self._split(tuple(out)), hidden

    def verify_hidden(self, params, cache, batches):
        *out, hidden = self.dp.verify_hidden(params, cache, self.dp.put_batch(batches))
        return tuple(out), hidden

    def place_mtp_params(self, mtp_params):
        return self.dp.shard_mtp_params(mtp_params)

    def init_mtp_cache(self, **sizes):
        return self.dp.init_mtp_cache(**sizes)

    def mtp_drafts(self, params, mtp_params, cache, batches, hidden, inps, sampled,
                   accepted_len, num_steps):
        return self.dp.mtp_drafts(params, mtp_params, cache, self.dp.put_batch(batches), hidden,
                                  self.dp.put_mtp_inputs(inps), sampled, accepted_len, num_steps)

    def commit(self, params, cache, states, slots, accepted_len):
        return self.dp.commit(params, cache, states, slots, accepted_len)


class MultiHostDPBackend(DPBackend):
    """DPBackend of the leader (process 0) of several processes; the followers run
    ``parallel/node.run_follower``, which makes the matching collectives in the same order:
    ``init_cache`` (its sizes broadcast first), ``load_params`` (the param shapes checked
    for agreement first; each process reads its devices' share), every step, and ``close``."""

    weight_updates = False
    state_transfer = True  # announced to the followers (``multihost.FollowerOps``)
    verify_steps = False  # the followers run forward steps only
    hidden_states = False

    def __init__(self, cfg: ModelConfig, dp_size: int, **kw):
        super().__init__(cfg, dp_size, **kw)
        self.local_device = jax.local_devices()[0]  # where the sampler runs
        self.closed = False

    def init_cache(self, *, num_pages: int, num_state_slots: int, **rest):
        from sglang_tpu_backend.parallel import multihost

        if self.with_stats == qwen3_5_moe.ROUTED:
            raise ValueError("--enable-return-routed-experts is not supported with --nnodes > 1")
        multihost.broadcast_ints([num_pages, num_state_slots, int(self.with_stats)], 3)
        return super().init_cache(num_pages=num_pages, num_state_slots=num_state_slots, **rest)

    def announce(self, op: int, values: Sequence[int]) -> None:
        """Tell the followers which snapshot copy or state transfer runs next."""
        from sglang_tpu_backend.parallel import multihost

        multihost.send_command(multihost.Op(op), values, self.num_ranks)

    def make_transfer(self, num_pages: int, num_state_slots: int) -> StateTransfer:
        transfer = super().make_transfer(num_pages, num_state_slots)
        transfer.announce = self.announce
        return transfer

    def make_snapshots(self, cache, num_snapshots: int, max_copies: int):
        from sglang_tpu_backend.parallel import multihost

        multihost.broadcast_ints([num_snapshots, max_copies], 2)  # the followers build theirs
        snapshots = super().make_snapshots(cache, num_snapshots, max_copies)
        if snapshots is not None:
            snapshots.announce = self.announce
        return snapshots

    def place_params(self, params):
        from sglang_tpu_backend.parallel import agreement

        agreement.require_agreement("parameters", agreement.param_items(params))
        return super().place_params(params)

    def load_params(self, source):
        from sglang_tpu_backend.parallel import agreement

        agreement.require_agreement("parameters", agreement.param_items(source.shapes()))
        return super().load_params(source)

    def place_sampler_state(self, counts, prompt_mask, last_tokens):
        return jax.device_put((counts, prompt_mask, last_tokens), self.local_device)

    def forward(self, params, cache, batches, from_slot=None, last_tokens=None):
        from sglang_tpu_backend.parallel import multihost

        self._no_in_flight(from_slot)
        if self.closed:
            raise RuntimeError("the multi-host backend is closed: the followers have stopped")
        batches = multihost.broadcast_step(batches, self.num_ranks)
        logits, cache, stats = multihost.step(self.dp, params, cache, batches)
        return jax.device_put(logits, self.local_device), cache, stats

    def close(self) -> None:
        """Tell the followers to stop and leave the process group (once; the caller makes
        sure no step runs any more)."""
        from sglang_tpu_backend.parallel import multihost

        if self.closed:
            return
        self.closed = True
        multihost.broadcast_step(None, self.num_ranks)
        multihost.shutdown()


def make_backend(cfg: ModelConfig, *, dp_size: int = 1, tp_size: int = 1, impl: str = "auto",
                 with_stats: bool | str = True, batch_invariant: bool = False) -> StepBackend:
    """The backend of a runner: TP when ``tp_size`` > 1, one device when ``dp_size`` == 1,
    else DP (over several processes when this one is part of a multi-process group)."""
    kw = dict(impl=impl, with_stats=with_stats, batch_invariant=batch_invariant)
    if tp_size > 1:
        return TPBackend(cfg, tp_size, **kw)
    if dp_size == 1:
        return SingleDeviceBackend(cfg, **kw)
    if jax.process_count() > 1:
        return MultiHostDPBackend(cfg, dp_size, **kw)
    return DPBackend(cfg, dp_size, **kw)
