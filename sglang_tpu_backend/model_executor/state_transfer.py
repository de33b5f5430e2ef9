"""Copy one request's cache state between the device cache and host numpy arrays.

What a request owns in ``models/qwen3_5_moe.ModelCache`` (in its rank's pool under DP):
  kv:   [La, n, 2*G, page, D]   its n KV pages of every attention layer (La layers)
  conv: [Lg, rows, C]           its state slot's conv state of every GDN layer (Lg layers)
  rec:  [Lg, Hv, Dk, Dv]        its state slot's recurrent state of every GDN layer
Under NEXTN the request's MTP KV (``models/mtp.py``'s pages, at the same page ids, in its
rank's part of the MTP pool under DP) moves too: ``gather_mtp`` / ``scatter_mtp``
  mtp_kv: [Lm, n, 2*G, page, D]  its n MTP KV pages of every MTP layer (Lm layers).
``StateTransfer.gather`` reads them out (prefill side of a handover), ``scatter`` writes them
into other pages and another slot (decode side), the cache donated and updated in place.

One program per page-count bucket (powers of two): the page list is padded with index
``num_pages`` (out of range), which the export clamps (rows sliced off after) and the install
drops; a slot index out of range is dropped too. Both touch the request's pages only (no
copy of a pool; ``tests/tpu/test_dp_compile.py`` checks the compiled scratch size). ``warm_up`` compiles every bucket.

With data-parallel ranks (``parallel.DPForward``: pages and slots split over the devices)
the programs are ``shard_map``s in which every rank reads or writes its own shard: the
request's rank gets its page list, the others only padding, so nothing crosses devices and
no pool is gathered. The host then reads the request's rank's output shard alone; a scatter
uploads the arrays to that rank's device (zeros elsewhere, which the padding drops).

Over several processes (a multi-host replica, ``parallel/multihost.py``) every process runs
the same programs: the leader's ``announce`` tells the followers (their ``FollowerOps`` then
call ``gather`` / ``scatter`` alike), and the request's bytes move in one broadcast between
the leader and the process whose device holds the request's rank (none when that is the
leader).

With tensor-parallel heads (``parallel.TPForward``: one pool, kv heads and GDN channels split
over the devices, some replicated) the arrays are converted to and from the one-device layout
on the host, so a TP replica hands over to a DP or one-device replica and back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sglang_tpu_backend.models.qwen3_5_moe import ModelCache
from sglang_tpu_backend.parallel.multihost import Op, share_from

State = tuple[np.ndarray, np.ndarray, np.ndarray]  # kv, conv, rec (layouts above)
# A multi-host leader's announcement of a program to its followers: (multihost.Op, ints).
Announce = Callable[[int, Sequence[int]], None]


def page_bucket(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def page_buckets(max_pages: int) -> list[int]:
    """Every page bucket a request of at most ``max_pages`` pages can use."""
    return [1 << i for i in range(page_bucket(max_pages).bit_length())]


def _take_pages(kv_pages, pages):
    """kv_pages [La, N, 2G, page, D], pages i32[B] (clamped into range) -> [La, B, 2G, page, D].

    One dynamic slice per page: XLA:TPU expands a gather over the page axis by slicing the
    whole pool first (copies of pool size)."""
    n = kv_pages.shape[1]

    def copy(i, out):
        page = lax.dynamic_slice_in_dim(kv_pages, jnp.clip(pages[i], 0, n - 1), 1, axis=1)
        return lax.dynamic_update_slice_in_dim(out, page, i, axis=1)

    out = jnp.zeros((kv_pages.shape[0], pages.shape[0], *kv_pages.shape[2:]), kv_pages.dtype)
    return lax.fori_loop(0, pages.shape[0], copy, out)


def _gather_local(cache: ModelCache, pages, slot):
    """pages: i32[B]; slot: i32[] -> (kv [La, B, 2G, page, D], conv [Lg, rows, C], rec [Lg, Hv, Dk, Dv])."""
    kv = _take_pages(cache.kv_pages, pages)
    slot = jnp.minimum(slot, cache.conv_state.shape[1] - 1)
    return kv, cache.conv_state[:, slot], cache.rec_state[:, slot]


def _scatter_local(cache: ModelCache, kv, conv, rec, pages, slot) -> ModelCache:
    """Write kv [La, B, 2G, page, D] at pages i32[B] and the GDN states conv [Lg, rows, C] /
    rec [Lg, Hv, Dk, Dv] at slot i32[]; out-of-range pages and slots are dropped."""
    return dataclasses.replace(
        cache,
        kv_pages=cache.kv_pages.at[:, pages].set(kv.astype(cache.kv_pages.dtype), mode="drop"),
        conv_state=cache.conv_state.at[:, slot].set(conv.astype(cache.conv_state.dtype), mode="drop"),
        rec_state=cache.rec_state.at[:, slot].set(rec.astype(cache.rec_state.dtype), mode="drop"),
    )


def _gather_mtp(mtp_pages, pages):
    """mtp_pages [Lm, N, 2G, page, D], pages i32[B] (clamped) -> [Lm, B, 2G, page, D]."""
    return _take_pages(mtp_pages, pages)


def _scatter_mtp(mtp_pages, kv, pages):
    """Write kv [Lm, B, 2G, page, D] at pages i32[B] of ``mtp_pages``; out-of-range dropped."""
    return mtp_pages.at[:, pages].set(kv.astype(mtp_pages.dtype), mode="drop")


def check_transferable(cache: ModelCache) -> None:
    """Handover moves (kv, conv, rec) only: an FP8 cache's per-row scales are not carried, so
    its state is refused rather than installed without them."""
    if cache.kv_scales is not None:
        raise NotImplementedError("prefill/decode handover does not carry the KV scales of "
                                  "--kv-cache-dtype fp8_e4m3; use --kv-cache-dtype auto")


class StateTransfer:
    """Request state in and out of one runner's cache.

    Args:
      num_pages / num_slots: pages and state slots per rank.
      dp: the runner's ``DPForward`` (its mesh and rank-split cache), or
      tp: its ``TPForward`` (heads split), or neither: one pool on one device.
    The arrays in and out are always in the one-device layout (module docstring).
    ``export_program(cache, pages, slot)`` and ``install_program(cache, kv, conv, rec, pages,
    slot)`` are the jitted programs (index arrays as ``_pages`` / ``_slot`` build them);
    ``mtp_export_program(mtp_pages, pages)`` / ``mtp_install_program(mtp_pages, kv, pages)``
    the NEXTN MTP KV's.
    ``announce``: set on a multi-host leader (module docstring); None elsewhere.
    """

    def __init__(self, num_pages: int, num_slots: int, dp: Any = None, tp: Any = None,
                 announce: Announce | None = None):
        self.num_pages, self.num_slots, self.dp, self.tp = num_pages, num_slots, dp, tp
        self.announce = announce
        if dp is None:
            out = None if tp is None else jax.tree.map(tp.sharding, tp.cache_specs())
            self.export_program = jax.jit(_gather_local)
            self.install_program = jax.jit(_scatter_local, donate_argnums=(0,), out_shardings=out)
            self.mtp_export_program = jax.jit(_gather_mtp)
            self.mtp_install_program = jax.jit(_scatter_mtp, donate_argnums=(0,))
            return
        from sglang_tpu_backend.parallel.mesh import rank_spec

        ranks = rank_spec(dp.ep, 0)  # a leading rank axis
        self._by_rank = dp.sharding(ranks)
        cache_specs = dp.cache_specs()
        # In the form the step's outputs have, so that step and install take each other's
        # caches without compiling again.
        cache_shardings = jax.tree.map(dp.sharding, cache_specs)

        def gather(cache, pages, slot):  # pages i32[1, B], slot i32[1] on each rank
            return jax.tree.map(lambda a: a[None], _gather_local(cache, pages[0], slot[0]))

        def scatter(cache, kv, conv, rec, pages, slot):
            return _scatter_local(cache, kv[0], conv[0], rec[0], pages[0], slot[0])

        self.export_program = jax.jit(jax.shard_map(
            gather, mesh=dp.mesh, in_specs=(cache_specs, ranks, ranks), out_specs=(ranks,) * 3,
            check_vma=False))
        self.install_program = jax.jit(jax.shard_map(
            scatter, mesh=dp.mesh, in_specs=(cache_specs,) + (ranks,) * 5, out_specs=cache_specs,
            check_vma=False), donate_argnums=(0,), out_shardings=cache_shardings)
        self._init_mtp_programs(dp, ranks)

    def _init_mtp_programs(self, dp: Any, ranks: Any) -> None:
        """The MTP KV's export / install programs under DP: the MTP pool [Lm, D*Nm, ...] is
        split over the ranks on its page axis (``DPForward.init_mtp_cache``); each rank reads
        or writes its own part, as the main programs do."""
        from sglang_tpu_backend.parallel.mesh import rank_spec

        pool = rank_spec(dp.ep, 1)

        def gather(mtp_pages, pages):  # pages i32[1, B] on each rank
            return _gather_mtp(mtp_pages, pages[0])[None]

        def scatter(mtp_pages, kv, pages):
            return _scatter_mtp(mtp_pages, kv[0], pages[0])

        self.mtp_export_program = jax.jit(jax.shard_map(
            gather, mesh=dp.mesh, in_specs=(pool, ranks), out_specs=ranks, check_vma=False))
        self.mtp_install_program = jax.jit(jax.shard_map(
            scatter, mesh=dp.mesh, in_specs=(pool, ranks, ranks), out_specs=pool,
            check_vma=False), donate_argnums=(0,), out_shardings=dp.sharding(pool))

    @property
    def num_ranks(self) -> int:
        return 1 if self.dp is None else self.dp.dp_size

    # Index arrays ----------------------------------------------------------------------------
    def _pages(self, pages: list[int], rank: int, bucket: int | None = None,
               pool_pages: int | None = None) -> np.ndarray:
        """i32[B] (one pool) or i32[D, B] (rank ``rank`` holds ``pages``, the others padding);
        padding is ``pool_pages`` (a rank's pool size, default ``num_pages``): out of range."""
        fill = self.num_pages if pool_pages is None else pool_pages
        out = np.full((self.num_ranks, bucket or page_bucket(len(pages))), fill, np.int32)
        out[rank, : len(pages)] = pages
        return out[0] if self.dp is None else out

    def _slot(self, slot: int, rank: int) -> np.ndarray:
        out = np.full(self.num_ranks, self.num_slots, np.int32)  # out of range: dropped
        out[rank] = slot
        return out[0] if self.dp is None else out

    def _rank_array(self, a: np.ndarray, rank: int) -> jax.Array:
        """[D, *a.shape] split over the ranks: ``a`` on ``rank``'s device, zeros elsewhere."""
        shape = (self.num_ranks, *a.shape)

        def shard(index):
            r = index[0].start or 0
            return a[None] if r == rank else np.zeros((1, *a.shape), a.dtype)

        return jax.make_array_from_callback(shape, self._by_rank, shard)

    def _owner(self, rank: int) -> int:
        """The process whose device holds rank ``rank``."""
        for device, index in self._by_rank.devices_indices_map((self.num_ranks,)).items():
            if (index[0].start or 0) == rank:
                return device.process_index
        raise ValueError(f"no device holds rank {rank}")

    def _rank_shard(self, out: jax.Array, rank: int) -> np.ndarray:
        """Rank ``rank``'s block of a [D, ...] rank-split array, read from its device alone and,
        when another process holds it, sent from there (every process calls this)."""
        owner = self._owner(rank)
        block = np.zeros(out.shape[1:], out.dtype)
        for s in out.addressable_shards:
            if (s.index[0].start or 0) == rank:
                block = np.asarray(s.data)[0]
        if owner == 0:  # the leader (or the only process) holds it: nothing to send
            return block
        return share_from(owner, [block])[0]

    # Transfer --------------------------------------------------------------------------------
    def gather(self, cache: ModelCache, pages: list[int], slot: int, rank: int = 0) -> State:
        """Host copies of the request's KV pages (in ``pages`` order) and GDN states of ``slot``
        on ``rank``."""
        check_transferable(cache)
        if self.announce is not None:
            self.announce(Op.EXPORT, [rank, slot, *pages])
        kv, conv, rec = self.export_program(cache, self._pages(pages, rank),
                                            self._slot(slot, rank))
        if self.dp is None:
            kv, conv, rec = jax.device_get((kv, conv, rec))
        else:
            kv, conv, rec = (self._rank_shard(a, rank) for a in (kv, conv, rec))
        kv = kv[:, : len(pages)]
        if self.tp is not None:
            kv, conv, rec = self.tp.state_to_one_device(kv, conv, rec)
        return np.asarray(kv), np.asarray(conv), np.asarray(rec)

    def scatter(self, cache: ModelCache, kv: np.ndarray, conv: np.ndarray, rec: np.ndarray,
                pages: list[int], slot: int, rank: int = 0) -> ModelCache:
        """``cache`` with ``kv[:, i]`` written to page ``pages[i]`` and the states to ``slot``
        of rank ``rank``. kv: [La, n, 2G, page, D] with n == len(pages); conv/rec as
        ``gather`` returns them."""
        if self.tp is not None:
            kv, conv, rec = self.tp.state_from_one_device(kv, conv, rec)
        check_transferable(cache)
        self._check_shapes(cache, kv, conv, rec, len(pages))
        if self.announce is not None:
            self.announce(Op.INSTALL, [rank, slot, *pages])
        if self.dp is not None and self._owner(rank) != 0:  # the leader's bytes to the owner
            kv, conv, rec = share_from(0, [kv, conv, rec])
        idx = self._pages(pages, rank)
        padded = np.zeros((kv.shape[0], idx.shape[-1], *kv.shape[2:]), kv.dtype)
        padded[:, : len(pages)] = kv
        return self.install_program(cache, *self._placed(padded, conv, rec, rank), idx,
                             self._slot(slot, rank))

    def _placed(self, kv, conv, rec, rank: int):
        if self.dp is None:
            return kv, conv, rec
        return tuple(self._rank_array(a, rank) for a in (kv, conv, rec))

    # NEXTN: the MTP KV ------------------------------------------------------------------------
    @property
    def moves_mtp_kv(self) -> bool:
        """Whether this layout hands the MTP KV over: one device or the DP ranks of one
        process (not TP heads, not several processes)."""
        return self.tp is None and self.announce is None

    def _mtp_index(self, mtp_pages: jax.Array, pages: list[int], rank: int,
                   bucket: int | None = None) -> np.ndarray:
        """``_pages`` for the MTP pool (per rank: the pool's pages, then the chain's scratch)."""
        if not self.moves_mtp_kv:
            raise NotImplementedError("NEXTN handover moves the MTP KV on one device or the "
                                      "--dp-size ranks of one process (not --tp-size > 1 or "
                                      "--nnodes > 1)")
        return self._pages(pages, rank, bucket, pool_pages=mtp_pages.shape[1] // self.num_ranks)

    def gather_mtp(self, mtp_pages: jax.Array, pages: list[int], rank: int = 0) -> np.ndarray:
        """Host copy [Lm, n, 2G, page, D] of the MTP KV at a request's ``pages`` on ``rank``
        (its page ids are the target's, ``pages`` order)."""
        out = self.mtp_export_program(mtp_pages, self._mtp_index(mtp_pages, pages, rank))
        kv = jax.device_get(out) if self.dp is None else self._rank_shard(out, rank)
        return np.asarray(kv)[:, : len(pages)]

    def scatter_mtp(self, mtp_pages: jax.Array, kv: np.ndarray, pages: list[int],
                    rank: int = 0) -> jax.Array:
        """``mtp_pages`` (donated) with ``kv[:, i]`` [Lm, n, 2G, page, D] written at page
        ``pages[i]`` of ``rank``; ValueError when ``kv`` does not fit the pool or ``pages``."""
        want = (mtp_pages.shape[0], len(pages), *mtp_pages.shape[2:])
        if kv.shape != want:
            raise ValueError(f"MTP kv of shape {kv.shape} does not fit {len(pages)} pages of "
                             f"this MTP cache (expected {want})")
        idx = self._mtp_index(mtp_pages, pages, rank)
        padded = np.zeros((kv.shape[0], idx.shape[-1], *kv.shape[2:]), kv.dtype)
        padded[:, : len(pages)] = kv
        placed = padded if self.dp is None else self._rank_array(padded, rank)
        return self.mtp_install_program(mtp_pages, placed, idx)

    def warm_up_mtp(self, mtp_pages: jax.Array, max_pages: int, *, gather: bool,
                    scatter: bool) -> jax.Array:
        """Compile the MTP gather and/or scatter of every page bucket up to ``max_pages`` on
        padding only (reads nothing used, writes nothing); returns the pool (a scatter
        donates it)."""
        for b in page_buckets(max_pages):
            idx = self._mtp_index(mtp_pages, [], 0, bucket=b)
            if gather:
                jax.block_until_ready(self.mtp_export_program(mtp_pages, idx))
            if scatter:
                pad = np.zeros((mtp_pages.shape[0], b, *mtp_pages.shape[2:]), mtp_pages.dtype)
                placed = pad if self.dp is None else self._rank_array(pad, 0)
                mtp_pages = self.mtp_install_program(mtp_pages, placed, idx)
        return jax.block_until_ready(mtp_pages)

    @staticmethod
    def empty_state(cache: ModelCache, n: int) -> State:
        """Zero (kv, conv, rec) arrays of a request of ``n`` pages in ``cache``'s dtypes."""
        La, _, H2, P, D = cache.kv_pages.shape
        return (np.zeros((La, n, H2, P, D), cache.kv_pages.dtype),
                np.zeros(cache.conv_state.shape[:1] + cache.conv_state.shape[2:],
                         cache.conv_state.dtype),
                np.zeros(cache.rec_state.shape[:1] + cache.rec_state.shape[2:],
                         cache.rec_state.dtype))

    def _check_shapes(self, cache: ModelCache, kv, conv, rec, n: int) -> None:
        La, H2, P, D = cache.kv_pages.shape[0], *cache.kv_pages.shape[2:]
        if kv.shape != (La, n, H2, P, D):
            raise ValueError(f"kv of shape {kv.shape} does not fit {n} pages of this cache "
                             f"(expected {(La, n, H2, P, D)})")
        conv_shape = cache.conv_state.shape[:1] + cache.conv_state.shape[2:]
        if conv.shape != conv_shape:
            raise ValueError(f"conv state of shape {conv.shape} does not fit this cache's "
                             f"(expected {conv_shape})")
        rec_shape = cache.rec_state.shape[:1] + cache.rec_state.shape[2:]
        if rec.shape != rec_shape:
            raise ValueError(f"recurrent state of shape {rec.shape} does not fit this cache's "
                             f"(expected {rec_shape})")

    # Warm-up ---------------------------------------------------------------------------------
    def warm_up(self, cache: ModelCache, max_pages: int, *, gather: bool = True,
                scatter: bool = True) -> ModelCache:
        """Compile the gather and/or scatter program of every page bucket up to ``max_pages``
        by running it on padding only (reads nothing used, writes nothing); returns the cache
        (a scatter donates it)."""
        check_transferable(cache)
        if self.announce is not None:
            self.announce(Op.TRANSFER_WARM_UP, [int(gather), int(scatter), max_pages])
        pad_slot = self._slot(self.num_slots, 0)
        for b in page_buckets(max_pages):
            idx = self._pages([], 0, bucket=b)
            if gather:
                jax.block_until_ready(self.export_program(cache, idx, pad_slot))
            if scatter:
                kv, conv, rec = self.empty_state(cache, b)
                cache = self.install_program(cache, *self._placed(kv, conv, rec, 0), idx,
                                             pad_slot)
        return jax.block_until_ready(cache)
