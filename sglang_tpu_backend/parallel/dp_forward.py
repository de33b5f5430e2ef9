"""The model step with data-parallel attention and expert-parallel MoE over a device mesh.

Every device is one DP rank: it runs ``models.qwen3_5_moe.forward`` on its own ragged batch
(its own requests) over its own shard of the caches, so page ids and state slots in a rank's
batch are rank-local. Attention, GDN, norms, router and shared expert weights are replicated;
routed experts are split over the same devices, and each MoE layer moves tokens between the
two layouts with one all-gather of hidden states, one packed all-gather of routing metadata
and a hierarchical reduce-scatter (``models/moe.py``).

Global arrays (D = DP ranks, every rank's part the same bucketed size):
  batch:  each ForwardBatch field is the D ranks' fields concatenated on axis 0
          (input_ids [D*T], cu_q_lens [D*(R+1)], page_table [D*R, P], num_seqs [D], ...),
          split over the ranks. A rank with nothing to do gets an all-padding batch
          (num_seqs 0) and still takes part in every collective.
  cache:  kv_pages [Lyr, D*N, 2G, S, Dh] (FP8: kv_scales [Lyr, D*N, 2G, S]), conv_state [Lyr, D*Sl, rows, C], rec_state
          [Lyr, D*Sl, Hv, Dk, Dv]: pages and slots split over the ranks (rank r owns pages
          r*N .. r*N+N-1, addressed as 0..N-1 in its batch).
  params: expert leaves [groups, E, ...] split on E; everything else replicated.
  logits: [D*L, V], rank r's rows at r*L .. r*L+L-1.

Speculative decoding: ``verify`` runs ``model_executor/verify.forward_verify`` on every rank
(its VerifyStates split over the ranks on the request axis, [Lyr, D*R, ...]) and ``commit``
sets each rank's slots from them (``verify.commit_accepted``, rank-local slot ids). NEXTN:
``forward_hidden`` / ``verify_hidden`` also return the hidden states [D*T, H], and
``mtp_drafts`` runs ``model_executor/nextn_step.mtp_drafts`` on every rank: MTP params
replicated but for the routed experts [E, ...] split on E, MTP KV pages [n, D*N', ...] split
like the main pages, drafts [D*R, k].
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor import verify
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.model_executor.weight_layout import (is_routed_expert, uses_native_layouts,
                                                             weight_formats)
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.parallel.mesh import EPContext, canonical_spec, rank_spec

REPLICATED = PartitionSpec()


def global_array(x, sharding) -> jax.Array:
    """A global array from a full host copy ``x`` that every process holds: each process fills
    only its own devices' shards (one process or several, as on multi-host TPU slices).
    ``sharding``: a Sharding, or a Format (sharding + device layout)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def place_params(params, shardings):
    """``params`` placed by ``shardings`` (a mirror tree) on a mesh: every process passes the
    full params and fills its own devices; on TPU the dense weights in their native tiling
    (``weight_layout.py``)."""
    leaves = jax.tree.leaves(shardings)
    if leaves and uses_native_layouts(leaves[0]):
        shardings = weight_formats(params, shardings)
    return jax.tree.map(global_array, params, shardings)


def jit_programs(backend) -> None:
    """Jit a mesh backend's global programs (``_global_step``, ``_global_verify``,
    ``_global_commit``, ``_global_mtp``) as the runner calls them: the cache (argument 1; the
    MTP pass's, argument 2) donated; the step and verify also as ``with_hidden`` variants
    (NEXTN reads the target's hidden states)."""
    b = backend
    b._step = jax.jit(b._global_step, donate_argnums=(1,))
    b._verify = jax.jit(b._global_verify, donate_argnums=(1,))
    b._commit = jax.jit(b._global_commit, donate_argnums=(1,))
    b._step_hidden = jax.jit(functools.partial(b._global_step, with_hidden=True),
                             donate_argnums=(1,))
    b._verify_hidden = jax.jit(functools.partial(b._global_verify, with_hidden=True),
                               donate_argnums=(1,))
    b._mtp = jax.jit(b._global_mtp, static_argnames=("num_steps",), donate_argnums=(2,))


class DPForward:
    """``forward`` over a (chip, die) mesh: one DP rank per device, experts split over them."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, *, impl: str = "auto",
                 ep: EPContext = EPContext(), with_stats: bool = False,
                 batch_invariant: bool = False):
        """``with_stats``: the step also returns each rank's router health f32[D*layers, 3] and
        the real rows per physical expert slot of all ranks f32[layers, P]; ``ROUTED``
        (``qwen3_5_moe``) adds every rank's routed logical expert ids i32[D*T, moe_layers, K].
        ``batch_invariant``: see ``qwen3_5_moe.forward``."""
        if cfg.num_experts % mesh.size:
            raise ValueError(f"--ep-size {mesh.size} must divide num_experts {cfg.num_experts}")
        self.cfg, self.mesh, self.impl, self.ep = cfg, mesh, impl, ep
        self.with_stats, self.batch_invariant = with_stats, batch_invariant
        self.dp_size = mesh.size
        jit_programs(self)

    # Placement ------------------------------------------------------------------------------
    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """``spec`` on this mesh, in the form step outputs have (``canonical_spec``)."""
        return NamedSharding(self.mesh, canonical_spec(self.mesh, spec))

    def param_specs(self, params) -> Any:
        """Expert leaves [groups, E, ...] split on E over the ranks; the rest replicated."""
        return jax.tree_util.tree_map_with_path(
            lambda path, _: rank_spec(self.ep, 1) if is_routed_expert(path) else REPLICATED,
            params)

    def cache_specs(self, kv_scales: bool = True) -> qwen3_5_moe.ModelCache:
        """Pages and slots split over the ranks. ``kv_scales``: give the FP8 cache's scales a
        spec too (a cache without them takes either; ``jax.tree.map`` over cache and specs
        wants them to match)."""
        spec = rank_spec(self.ep, 1)  # pages / slots
        return qwen3_5_moe.ModelCache(kv_pages=spec, conv_state=spec, rec_state=spec,
                                      kv_scales=spec if kv_scales else None)

    def batch_specs(self, mode: ForwardMode) -> ForwardBatch:
        spec = rank_spec(self.ep, 0)
        names = [f.name for f in ForwardBatch.__dataclass_fields__.values() if f.name != "mode"]
        return ForwardBatch(**{n: spec for n in names}, mode=mode)

    def param_shardings(self, params) -> Any:
        """``param_specs`` as NamedShardings on the mesh (``params``: arrays or shapes)."""
        return jax.tree.map(self.sharding, self.param_specs(params))

    def shard_params(self, params):
        """Place params on the mesh (experts split, the rest replicated; on TPU the dense
        weights in their native tiling, ``weight_layout.py``); every process passes the full
        params and fills its own devices."""
        return place_params(params, self.param_shardings(params))

    def init_cache(self, *, num_pages: int, page_size: int, num_state_slots: int,
                   kv_dtype=jnp.bfloat16, state_dtype=jnp.float32) -> qwen3_5_moe.ModelCache:
        """Zeroed caches with ``num_pages`` pages and ``num_state_slots`` slots PER RANK,
        allocated shard by shard on the devices."""
        make = functools.partial(
            qwen3_5_moe.init_cache, self.cfg, num_pages=num_pages * self.dp_size,
            page_size=page_size, num_state_slots=num_state_slots * self.dp_size,
            kv_dtype=kv_dtype, state_dtype=state_dtype)
        shardings = jax.tree.map(self.sharding, self.cache_specs())
        return jax.jit(make, out_shardings=shardings)()

    def put_batch(self, batches: Sequence[ForwardBatch]) -> ForwardBatch:
        """One rank-local batch per DP rank (equal shapes) -> the global, placed batch. Every
        process passes all ranks' batches (multi-host: see ``parallel/multihost.py``).

        The step is a DECODE (TARGET_VERIFY) step only when every rank's batch is one
        (all-padding batches of idle ranks are built with the common mode by the caller).
        """
        if len(batches) != self.dp_size:
            raise ValueError(f"need {self.dp_size} rank batches, got {len(batches)}")
        modes = {b.mode for b in batches}
        one_kind = {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY}  # kept when all ranks agree
        mode = modes.pop() if len(modes) == 1 and modes <= one_kind else ForwardMode.MIXED
        shapes = {tuple(np.shape(getattr(b, n)) for n in ("input_ids", "cu_q_lens", "page_table",
                                                           "logits_indices")) for b in batches}
        if len(shapes) != 1:
            raise ValueError(f"rank batches must share one bucket, got shapes {sorted(shapes)}")
        fields = {}
        spec = self.sharding(rank_spec(self.ep, 0))
        for name in ForwardBatch.__dataclass_fields__:
            if name == "mode":
                continue
            glob = np.concatenate([np.asarray(getattr(b, name)) for b in batches], axis=0)
            fields[name] = global_array(glob, spec)
        return ForwardBatch(**fields, mode=mode)

    # Step -------------------------------------------------------------------------------------
    def _global_step(self, params, cache, batch, with_hidden: bool = False):
        local = functools.partial(qwen3_5_moe.forward, cfg=self.cfg, impl=self.impl, ep=self.ep,
                                  with_stats=self.with_stats, batch_invariant=self.batch_invariant,
                                  with_hidden=with_hidden)
        out_specs = (rank_spec(self.ep, 0), self.cache_specs())
        if self.with_stats:  # (health per rank, rows per expert slot summed over the ranks)
            routed = (rank_spec(self.ep, 0),) if self.with_stats == qwen3_5_moe.ROUTED else ()
            out_specs += ((rank_spec(self.ep, 0), REPLICATED) + routed,)  # routed [D*T, M, K]
        if with_hidden:
            out_specs += (rank_spec(self.ep, 0),)
        step = jax.shard_map(
            lambda p, c, b: local(p, c, b), mesh=self.mesh,
            in_specs=(self.param_specs(params), self.cache_specs(), self.batch_specs(batch.mode)),
            out_specs=out_specs,
            check_vma=False)
        return step(params, cache, batch)

    def _states_specs(self) -> verify.VerifyStates:
        per_layer = rank_spec(self.ep, 1)  # [Lyr, D*R, ...]
        return verify.VerifyStates(windows=per_layer, a=per_layer, b=per_layer,
                                   fresh=rank_spec(self.ep, 0))

    def _global_verify(self, params, cache, batch, with_hidden: bool = False):
        local = functools.partial(verify.forward_verify, cfg=self.cfg, impl=self.impl,
                                  batch_invariant=self.batch_invariant, ep=self.ep,
                                  with_hidden=with_hidden)
        out_specs = (rank_spec(self.ep, 0), self.cache_specs(), self._states_specs())
        step = jax.shard_map(
            lambda p, c, b: local(p, c, b), mesh=self.mesh,
            in_specs=(self.param_specs(params), self.cache_specs(), self.batch_specs(batch.mode)),
            out_specs=out_specs + ((rank_spec(self.ep, 0),) if with_hidden else ()),
            check_vma=False)
        return step(params, cache, batch)

    def _global_commit(self, params, cache, states, slots, accepted_len):
        by_rank = rank_spec(self.ep, 0)
        local = functools.partial(verify.commit_accepted, cfg=self.cfg, impl=self.impl)
        step = jax.shard_map(
            lambda p, c, s, sl, acc: local(p, c, s, sl, acc), mesh=self.mesh,
            in_specs=(self.param_specs(params), self.cache_specs(), self._states_specs(),
                      by_rank, by_rank),
            out_specs=self.cache_specs(), check_vma=False)
        return step(params, cache, states, slots, accepted_len)

    def verify(self, params, cache, batch: ForwardBatch):
        """A TARGET_VERIFY step on every rank: (logits f32[D*L, V], the cache (donated) with KV
        written, VerifyStates [Lyr, D*R, ...])."""
        return self._verify(params, cache, batch)

    def commit(self, params, cache, states: verify.VerifyStates, slots, accepted_len):
        """Each rank's slots (``slots`` i32[D*R], rank-local ids) := the state after
        ``accepted_len`` i32[D*R] positions, the GDN recurrence of those positions run again
        from the slot (cache donated)."""
        return self._commit(params, cache, states, slots, accepted_len)

    def forward_hidden(self, params, cache, batch: ForwardBatch):
        """``__call__``'s outputs, then every rank's hidden states [D*T, H] (NEXTN)."""
        return self._step_hidden(params, cache, batch)

    def verify_hidden(self, params, cache, batch: ForwardBatch):
        """``verify``'s outputs, then every rank's hidden states [D*T, H] (NEXTN)."""
        return self._verify_hidden(params, cache, batch)

    # NEXTN: the MTP layers ------------------------------------------------------------------
    def mtp_param_specs(self, mtp_params) -> Any:
        """Routed expert leaves [E, ...] (one layer, not stacked) split on E; the rest
        replicated."""
        return jax.tree_util.tree_map_with_path(
            lambda path, _: rank_spec(self.ep, 0) if is_routed_expert(path) else REPLICATED,
            mtp_params)

    def shard_mtp_params(self, mtp_params):
        return place_params(mtp_params, jax.tree.map(self.sharding,
                                                     self.mtp_param_specs(mtp_params)))

    def init_mtp_cache(self, *, num_pages: int, page_size: int, kv_dtype) -> jax.Array:
        """Zeroed MTP KV pages, ``num_pages`` per rank, split like the main pages."""
        from sglang_tpu_backend.models.mtp import init_mtp_cache

        make = functools.partial(init_mtp_cache, self.cfg, num_pages=num_pages * self.dp_size,
                                 page_size=page_size, kv_dtype=kv_dtype)
        return jax.jit(make, out_shardings=self.sharding(rank_spec(self.ep, 1)))()

    def put_mtp_inputs(self, inps: Sequence[Any]) -> Any:
        """One ``MtpInputs`` per rank -> the global, placed one (fields concatenated)."""
        spec = self.sharding(rank_spec(self.ep, 0))
        return jax.tree.map(lambda *xs: global_array(np.concatenate(xs, axis=0), spec), *inps)

    def _global_mtp(self, params, mtp_params, cache, batch, hidden, inp, sampled, accepted_len,
                    num_steps: int):
        from sglang_tpu_backend.model_executor.nextn_step import mtp_drafts

        local = functools.partial(mtp_drafts, cfg=self.cfg, impl=self.impl, num_steps=num_steps,
                                  ep=self.ep)
        by_rank = rank_spec(self.ep, 0)
        step = jax.shard_map(
            lambda *args: local(*args), mesh=self.mesh,
            in_specs=(self.param_specs(params), self.mtp_param_specs(mtp_params),
                      rank_spec(self.ep, 1), self.batch_specs(batch.mode), by_rank,
                      jax.tree.map(lambda _: by_rank, inp), by_rank, by_rank),
            out_specs=(by_rank, rank_spec(self.ep, 1)), check_vma=False)
        return step(params, mtp_params, cache, batch, hidden, inp, sampled, accepted_len)

    def mtp_drafts(self, params, mtp_params, cache, batch: ForwardBatch, hidden, inp, sampled,
                   accepted_len, num_steps: int):
        """``nextn_step.mtp_drafts`` on every rank (cache donated): (drafts i32[D*R, k],
        cache). ``sampled`` [D*R] or [D*R, n], ``accepted_len`` [D*R]: rank r's rows at
        r*R .. r*R+R-1."""
        sampled = jax.device_put(sampled, self.sharding(rank_spec(self.ep, 0)))
        accepted_len = jax.device_put(accepted_len, self.sharding(rank_spec(self.ep, 0)))
        return self._mtp(params, mtp_params, cache, batch, hidden, inp, sampled, accepted_len,
                         num_steps=num_steps)

    def __call__(self, params, cache, batch: ForwardBatch):
        """f32[D*L, V] logits and the updated cache (donated) (+ router stats, see __init__)."""
        return self._step(params, cache, batch)
