"""GDN state snapshots on the device: the arrays, and the copies slot -> snapshot -> slot.

A snapshot holds what a state slot holds for every GDN layer at once, in the cache's layout
and dtypes (``models/qwen3_5_moe.ModelCache``):
  conv: [Lyr, N, rows, C]          (Lyr GDN layers, N snapshots, rows/C as conv_state)
  rec:  [Lyr, N, Hv, Dk, Dv]       (as rec_state, fp32 or bf16)
With tensor-parallel attention the snapshots are split over the heads like the states. With
``dp_size`` D > 1 the snapshot axis holds N per rank (D*N), split over the ranks like the
slots, and every copy runs rank-locally under ``shard_map`` (rank r's rows r*N .. r*N+N-1,
addressed as 0..N-1).

Copies are batched: one jitted program per copy count bucket K (powers of two up to the
running-request limit) and direction (snapshot -> cache slot, slot -> snapshot), the
destination donated and updated in place. Padding entries write to index N (out of range),
which the scatter drops.

Over several processes (a multi-host replica) the leader's ``announce`` tells its followers
each copy before running it, and they run the same copy on their devices
(``parallel/multihost.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.models.qwen3_5_moe import ModelCache
from sglang_tpu_backend.parallel.multihost import Op


def copy_rows(dst_conv, dst_rec, src_conv, src_rec, src_idx, dst_idx):
    """``dst[:, dst_idx[i]] = src[:, src_idx[i]]`` for conv and recurrent state.

    dst_conv: [Lyr, Nd, rows, C]; dst_rec: [Lyr, Nd, Hv, Dk, Dv]; src_*: same with Ns rows on
    axis 1; src_idx, dst_idx: i32[K] (``dst_idx[i] >= Nd`` skips entry i).
    """
    conv = dst_conv.at[:, dst_idx].set(src_conv[:, src_idx].astype(dst_conv.dtype), mode="drop")
    rec = dst_rec.at[:, dst_idx].set(src_rec[:, src_idx].astype(dst_rec.dtype), mode="drop")
    return conv, rec


def _buckets(limit: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


class GDNSnapshots:
    """``num_snapshots`` snapshots per rank, shaped like the slots of ``cache``.

    ``dp`` is the runner's ``parallel.DPForward`` (None with one rank); ``max_copies`` is the
    most copies one step asks for per rank (the running-request limit).
    """

    def __init__(self, cache: ModelCache, num_snapshots: int, max_copies: int, dp=None,
                 announce=None):
        """``announce(op, ints)``: set on a multi-host leader (module docstring)."""
        self.announce = announce
        self.num_snapshots = num_snapshots  # per rank
        self.num_slots = cache.conv_state.shape[1] // (dp.dp_size if dp else 1)  # per rank
        self.dp = dp
        self.buckets = _buckets(max(1, max_copies))
        D = dp.dp_size if dp else 1
        conv_shape = (cache.conv_state.shape[0], D * num_snapshots, *cache.conv_state.shape[2:])
        rec_shape = (cache.rec_state.shape[0], D * num_snapshots, *cache.rec_state.shape[2:])
        zeros = lambda: (jnp.zeros(conv_shape, cache.conv_state.dtype),  # noqa: E731
                         jnp.zeros(rec_shape, cache.rec_state.dtype))
        if dp is None:
            # One pool (one device, or tensor-parallel heads split over a mesh): snapshots
            # sharded like the states they copy; the copies index the unsplit slot axis.
            self.conv, self.rec = jax.jit(zeros, out_shardings=(
                cache.conv_state.sharding, cache.rec_state.sharding))()
            self._copy = jax.jit(copy_rows, donate_argnums=(0, 1))
            return
        from sglang_tpu_backend.parallel.mesh import rank_spec

        state_spec, idx_spec = rank_spec(dp.ep, 1), rank_spec(dp.ep, 0)
        shard = dp.sharding(state_spec)
        self._idx_sharding = dp.sharding(idx_spec)
        self.conv, self.rec = jax.jit(zeros, out_shardings=(shard, shard))()
        local = jax.shard_map(copy_rows, mesh=dp.mesh, in_specs=(state_spec,) * 4 + (idx_spec,) * 2,
                              out_specs=(state_spec, state_spec), check_vma=False)
        self._copy = jax.jit(local, donate_argnums=(0, 1))

    def _indices(self, pairs: Sequence[tuple[int, int, int]], num_dst: int, K: int | None = None):
        """(rank, src, dst) triples -> per-rank-padded i32[D*K] src and dst index arrays (K the
        smallest bucket that fits, unless given)."""
        D = self.dp.dp_size if self.dp else 1
        per_rank = [[(s, d) for r, s, d in pairs if r == k] for k in range(D)]
        if K is None:
            K = next(b for b in self.buckets if b >= max(len(p) for p in per_rank))
        src = np.zeros((D, K), np.int32)
        dst = np.full((D, K), num_dst, np.int32)  # out of range: dropped
        for k, p in enumerate(per_rank):
            for j, (s, d) in enumerate(p):
                src[k, j], dst[k, j] = s, d
        src, dst = src.reshape(-1), dst.reshape(-1)
        if self.dp is None:
            return src, dst
        from sglang_tpu_backend.parallel.dp_forward import global_array

        return global_array(src, self._idx_sharding), global_array(dst, self._idx_sharding)

    def _announce(self, op: Op, triples: Sequence[tuple[int, int, int]]) -> None:
        if self.announce is not None:
            self.announce(op, [v for t in triples for v in t])

    def _operands(self, cache: ModelCache, into_slots: bool,
                  pairs: Sequence[tuple[int, int, int]], K: int | None = None) -> tuple:
        """``_copy``'s arguments copying ``pairs`` (rank, from, to) of snapshots into state
        slots (``into_slots``) or of state slots into snapshots (K: the copy bucket)."""
        if into_slots:
            src, dst = self._indices(pairs, self.num_slots, K)
            return cache.conv_state, cache.rec_state, self.conv, self.rec, src, dst
        src, dst = self._indices(pairs, self.num_snapshots, K)
        return self.conv, self.rec, cache.conv_state, cache.rec_state, src, dst

    def load(self, cache: ModelCache, loads: Sequence[tuple[int, int, int]]) -> ModelCache:
        """Copy snapshots into state slots: ``loads`` are (rank, snapshot, slot). Returns the
        new cache (the old one's state arrays are donated)."""
        operands = self._operands(cache, True, loads)
        self._announce(Op.SNAPSHOT_LOAD, loads)
        conv, rec = self._copy(*operands)
        return dataclasses.replace(cache, conv_state=conv, rec_state=rec)

    def save(self, cache: ModelCache, saves: Sequence[tuple[int, int, int]]) -> None:
        """Copy state slots into snapshots: ``saves`` are (rank, slot, snapshot)."""
        operands = self._operands(cache, False, saves)
        self._announce(Op.SNAPSHOT_SAVE, saves)
        self.conv, self.rec = self._copy(*operands)

    def lower_copies(self, cache: ModelCache) -> list:
        """Tasks lowering each copy program ``warmup`` runs (into the slots, then into the
        snapshots, per bucket; ``parallel_compile`` compiles them ahead). One device only."""
        return [lambda K=K, i=i: self._copy.lower(*self._operands(cache, i, [], K))
                for K in self.buckets for i in (True, False)]

    def warmup(self, cache: ModelCache) -> ModelCache:
        """Compile every copy program (all-padding copies: nothing changes)."""
        self._announce(Op.SNAPSHOT_WARM_UP, [])
        for K in self.buckets:
            conv, rec = self._copy(*self._operands(cache, True, [], K))
            cache = dataclasses.replace(cache, conv_state=conv, rec_state=rec)
            self.conv, self.rec = self._copy(*self._operands(cache, False, [], K))
        return cache
