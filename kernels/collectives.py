"""Collectives of the DP-attention -> EP-MoE transition of one expert-parallel MoE layer.

Two ops, both called *inside* ``shard_map`` over the ("chip", "die") mesh (4 x 2 on Ironwood):

* :func:`packed_all_gather` -- the routing metadata (top-k ids i32 and weights f32) of every
  device in **one** all-gather: the weights are bitcast to int32 and concatenated with the ids.
* :func:`hierarchical_reduce_scatter` -- the MoE output back to the owning DP rank. Equal to
  ``lax.psum_scatter(x, (chip, die), scatter_dimension=0, tiled=True)`` but done in two stages,
  die-local first (the fast intra-chip link), then across chips, in ``num_microbatches``
  pipelined micro-batches of rows. The Pallas TPU kernel moves data with remote DMAs.

Dimension letters: T tokens per device, K top-k, D devices (= C chips x E dies per chip),
N rows to reduce-scatter per device, H hidden, M micro-batches, R = N / (D * M) rows of one
destination block in one micro-batch.

Row layout of the reduce-scatter: x[N, H] viewed as x[C, E, M, R, H]; rows x[c, e] (one block
of N / D rows) belong to the device at mesh position (chip c, die e), whose linear index in
the (chip, die) axes is c * E + e; inside a block, micro-batch m is rows [m * R, (m + 1) * R).

TPU assumptions of the kernel: x stays in HBM (``pl.ANY``); the reductions run on [R, H]
VMEM tiles (R a multiple of 8 for f32 / 16 for bf16, H a multiple of 128 on hardware); the
receive buffers and stage-1 partial sums live in HBM, passed as extra outputs because Pallas
TPU has no HBM scratch; peers synchronise once through the barrier semaphore (collective_id 0).

Interpret mode (CPU tests): the kernel runs with ``dma_execution_mode="eager"`` (it also passes
with "on_wait"). On a 2-core machine keep each device's x under ~100 KiB: PJRT CPU copies bigger
arrays on its thread pool, which 8 interpreted devices blocked in semaphore waits can exhaust,
and the call hangs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import dispatch
from .cost import Cost

MAX_MICROBATCHES = 4
# collective_id of the reduce-scatter kernel's barrier semaphore (one per collective kernel).
REDUCE_SCATTER_COLLECTIVE_ID = 0
VMEM_HEADROOM_BYTES = 4 * 1024 * 1024
VMEM_MAX_BYTES = 60 * 1024 * 1024  # Ironwood: 64 MiB VMEM per TensorCore

_semaphore_signal = getattr(pl, "semaphore_signal", None) or pltpu.semaphore_signal
_semaphore_wait = getattr(pl, "semaphore_wait", None) or pltpu.semaphore_wait


@dataclasses.dataclass(frozen=True)
class ReduceScatterLayout:
    """Static geometry of one hierarchical reduce-scatter call (all counts per device)."""

    num_rows: int  # N
    hidden: int  # H
    num_chips: int  # C
    num_dies: int  # E
    num_microbatches: int  # M

    @property
    def num_devices(self) -> int:  # D = C * E
        return self.num_chips * self.num_dies

    @property
    def rows_per_block(self) -> int:  # rows each device ends with, N / D
        return self.num_rows // self.num_devices

    @property
    def rows_per_microbatch(self) -> int:  # R, rows of one block in one micro-batch
        return self.rows_per_block // self.num_microbatches


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def ref_packed_all_gather(topk_ids, topk_weights, *, axis_name):
    """Two separate tiled all-gathers (the reference for :func:`packed_all_gather`)."""
    ids = lax.all_gather(topk_ids, axis_name, axis=0, tiled=True)  # i32[D*T, K]
    weights = lax.all_gather(topk_weights, axis_name, axis=0, tiled=True)  # f32[D*T, K]
    return ids, weights


def ref_hierarchical_reduce_scatter(x, *, chip_axis="chip", die_axis="die", num_microbatches=2):
    """Flat ``psum_scatter`` over (chip, die): device (c, e) gets the sum of row block c*E+e."""
    del num_microbatches  # the flat collective has no schedule
    return lax.psum_scatter(x, (chip_axis, die_axis), scatter_dimension=0, tiled=True)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _check_routing(topk_ids, topk_weights):
    if topk_ids.ndim != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T, k], got {topk_ids.shape} and "
            f"{topk_weights.shape}"
        )
    if topk_ids.dtype != jnp.int32 or topk_weights.dtype != jnp.float32:
        raise ValueError(
            f"expected topk_ids int32 and topk_weights float32, got {topk_ids.dtype} and "
            f"{topk_weights.dtype}"
        )


def _check_reduce_scatter(x, num_chips, num_dies, num_microbatches) -> ReduceScatterLayout:
    if x.ndim != 2:
        raise ValueError(f"x must be [N, H], got shape {x.shape}")
    if not 1 <= num_microbatches <= MAX_MICROBATCHES:
        raise ValueError(
            f"num_microbatches must be in 1..{MAX_MICROBATCHES}, got {num_microbatches}"
        )
    n, h = x.shape
    step = num_chips * num_dies * num_microbatches
    if n % step:
        raise ValueError(
            f"x rows N={n} (x shape {x.shape}) must be divisible by num_chips*num_dies*"
            f"num_microbatches = {num_chips}*{num_dies}*{num_microbatches} = {step}"
        )
    return ReduceScatterLayout(n, h, num_chips, num_dies, num_microbatches)


# ----------------------------------------------------------------------------------------------
# Packed all-gather (one collective)
# ----------------------------------------------------------------------------------------------


def packed_all_gather(topk_ids, topk_weights, *, axis_name):
    """All-gather top-k ids and weights of every device in a single collective.

    Args:
      topk_ids: i32[T, K] this device's expert ids.
      topk_weights: f32[T, K] this device's routing weights.
      axis_name: mesh axis name (or tuple of names) to gather over, D devices in all.

    Returns:
      (i32[D*T, K], f32[D*T, K]) -- bit-identical to two tiled ``lax.all_gather`` calls
      (weights travel as their int32 bit pattern, so NaN payloads, -0.0 and denormals survive).
    """
    _check_routing(topk_ids, topk_weights)
    k = topk_ids.shape[1]
    weight_bits = lax.bitcast_convert_type(topk_weights, jnp.int32)  # i32[T, K]
    packed = jnp.concatenate([topk_ids, weight_bits], axis=1)  # i32[T, 2K]
    gathered = lax.all_gather(packed, axis_name, axis=0, tiled=True)  # i32[D*T, 2K]
    ids = gathered[:, :k]  # i32[D*T, K]
    weights = lax.bitcast_convert_type(gathered[:, k:], jnp.float32)  # f32[D*T, K]
    return ids, weights


# ----------------------------------------------------------------------------------------------
# Hierarchical reduce-scatter: lax schedule (non-TPU path)
# ----------------------------------------------------------------------------------------------


def _reduce_scatter_lax(x, layout: ReduceScatterLayout, chip_axis, die_axis):
    """The two-stage micro-batched schedule with one lax collective per stage and micro-batch."""
    lo = layout
    x5 = x.reshape(lo.num_chips, lo.num_dies, lo.num_microbatches, lo.rows_per_microbatch, -1)
    outs = []
    for m in range(lo.num_microbatches):
        # stage 1, dies of one chip: keep the rows of chips' blocks owned by my die, summed.
        partial = lax.psum_scatter(x5[:, :, m], die_axis, scatter_dimension=1)  # [C, R, H]
        # stage 2, across chips: keep my chip's block, summed over chips.
        outs.append(lax.psum_scatter(partial, chip_axis, scatter_dimension=0))  # [R, H]
    return jnp.concatenate(outs, axis=0)  # [N/D, H]


# ----------------------------------------------------------------------------------------------
# Hierarchical reduce-scatter: Pallas TPU kernel (remote DMA)
# ----------------------------------------------------------------------------------------------


def _reduce_scatter_kernel(
    # Prefetch
    coords_ref,  # i32[2 + (E-1) + 2*(C-1)] SMEM, see _peer_coords
    # Input
    x_hbm,  # [C, E, M, R, H] HBM, this device's rows
    # Output
    out_hbm,  # [M, R, H] HBM, my block summed over all devices
    # Outputs used as HBM scratch (Pallas has no HBM scratch on TPU)
    recv1_hbm,  # [M, E-1, C, R, H] stage-1 rows from the other dies, slot = die offset - 1
    part_hbm,  # [M, C, R, H] stage-1 sums (my die, every chip's block), source of stage 2
    recv2_hbm,  # [M, C, R, H] stage-2 partial sums of my block, slot = source chip
    # Scratch
    a_vmem,  # [R, H] accumulator tile
    b_vmem,  # [R, H] operand tile
    local_sem,  # DMA semaphore for local HBM <-> VMEM copies
    s1_send,  # DMA[M, E-1]
    s1_recv,  # DMA[M, E-1]
    s2_send,  # DMA[M, C-1]
    s2_recv,  # DMA[M, C]
    *,
    layout: ReduceScatterLayout,
    chip_axis: str,
    die_axis: str,
):
    C, E, M = layout.num_chips, layout.num_dies, layout.num_microbatches
    chip, die = coords_ref[0], coords_ref[1]

    def die_plus(k):  # (die + k) % E, 1 <= k < E
        return coords_ref[1 + k]

    def chip_plus(k):  # (chip + k) % C, 1 <= k < C
        return coords_ref[E + k]

    def chip_minus(k):  # (chip - k) % C, 1 <= k < C
        return coords_ref[E + C - 1 + k]

    def device(c, e):
        return {chip_axis: c, die_axis: e}

    def local_copy(src, dst):
        copy = pltpu.make_async_copy(src, dst, local_sem)
        copy.start()
        copy.wait()

    # Barrier with every peer (other dies of my chip, my die on other chips): nobody writes
    # into a peer's buffers before the peer has entered the kernel.
    barrier = pltpu.get_barrier_semaphore()
    peers = [device(chip, die_plus(k)) for k in range(1, E)]
    peers += [device(chip_plus(k), die) for k in range(1, C)]
    for peer in peers:
        _semaphore_signal(barrier, 1, device_id=peer)  # dict -> mesh coordinates
    _semaphore_wait(barrier, len(peers))

    # Stage 1 sends: to die (die + k) % E the rows of every block that die owns (one per chip).
    # Slots and semaphores are indexed by the sender's offset k, so the same descriptor also
    # describes what I receive from die (die - k) % E (wait_recv only uses dst and recv_sem).
    def stage1_copy(m, k):
        return pltpu.make_async_remote_copy(
            src_ref=x_hbm.at[:, die_plus(k), m],  # [C, R, H] strided
            dst_ref=recv1_hbm.at[m, k - 1],  # [C, R, H]
            send_sem=s1_send.at[m, k - 1],
            recv_sem=s1_recv.at[m, k - 1],
            device_id=device(chip, die_plus(k)),
        )

    # Stage 2 sends: to chip (chip + k) % C my die-local sum of its block; slot = my chip.
    def stage2_copy(m, k):
        dst_chip = chip_plus(k)
        return pltpu.make_async_remote_copy(
            src_ref=part_hbm.at[m, dst_chip],  # [R, H]
            dst_ref=recv2_hbm.at[m, chip],  # [R, H]
            send_sem=s2_send.at[m, k - 1],
            recv_sem=s2_recv.at[m, chip],
            device_id=device(dst_chip, die),
        )

    def stage2_wait_recv(m, k):
        # Descriptor of what chip (chip - k) % C sent me; only its destination side is used.
        src_chip = chip_minus(k)
        pltpu.make_async_remote_copy(
            src_ref=part_hbm.at[m, chip],
            dst_ref=recv2_hbm.at[m, src_chip],
            send_sem=s2_send.at[m, k - 1],
            recv_sem=s2_recv.at[m, src_chip],
            device_id=device(src_chip, die),
        ).wait_recv()

    def stage1_reduce(m):
        """Sum my rows and the other dies' rows of every block my die owns, micro-batch m."""
        for k in range(1, E):
            stage1_copy(m, k).wait_recv()
        for c in range(C):
            local_copy(x_hbm.at[c, die, m], a_vmem)
            for k in range(1, E):
                local_copy(recv1_hbm.at[m, k - 1, c], b_vmem)
                a_vmem[...] = a_vmem[...] + b_vmem[...]
            local_copy(a_vmem, part_hbm.at[m, c])
        # My own block's partial goes straight into my recv2 slot, the others to their chips.
        local_copy(part_hbm.at[m, chip], recv2_hbm.at[m, chip])
        for k in range(1, C):
            stage2_copy(m, k).start()

    def stage2_reduce(m):
        """Sum the C die-local partials of my block in chip order 0..C-1; write out rows m."""
        for k in range(1, C):
            stage2_wait_recv(m, k)
        local_copy(recv2_hbm.at[m, 0], a_vmem)
        for c in range(1, C):
            local_copy(recv2_hbm.at[m, c], b_vmem)
            a_vmem[...] = a_vmem[...] + b_vmem[...]
        local_copy(a_vmem, out_hbm.at[m])

    # Software pipeline over micro-batches: the stage-1 transfer of m + 1 and the stage-2
    # transfer of m are in flight while micro-batch m is reduced (stage 1) and m - 1 (stage 2).
    for k in range(1, E):
        stage1_copy(0, k).start()
    for m in range(M):
        if m + 1 < M:
            for k in range(1, E):
                stage1_copy(m + 1, k).start()
        stage1_reduce(m)
        if m >= 1:
            stage2_reduce(m - 1)
    stage2_reduce(M - 1)

    # Every outgoing DMA must finish before the kernel (and its source buffers) goes away.
    for m in range(M):
        for k in range(1, E):
            stage1_copy(m, k).wait_send()
        for k in range(1, C):
            stage2_copy(m, k).wait_send()


def _struct_like(shape, dtype, like):
    """ShapeDtypeStruct varying over the same manual mesh axes as ``like`` (for check_vma)."""
    aval = jax.typeof(like)
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    for field in ("manual_axis_type", "vma"):  # name differs between jax versions
        if field in params and getattr(aval, field, None) is not None:
            return jax.ShapeDtypeStruct(shape, dtype, **{field: getattr(aval, field)})
    return jax.ShapeDtypeStruct(shape, dtype)


def _peer_coords(layout: ReduceScatterLayout, chip_axis, die_axis):
    """i32[2 + (E-1) + 2*(C-1)]: my chip, my die, (die+k)%E, (chip+k)%C, (chip-k)%C for k>=1.

    Computed outside the kernel (scalar prefetch) so the kernel body does no index arithmetic
    on ``axis_index`` values, which the TPU interpreter cannot do under ``check_vma=True``.
    """
    C, E = layout.num_chips, layout.num_dies
    chip = lax.axis_index(chip_axis)
    die = lax.axis_index(die_axis)
    ks_e = jnp.arange(1, E, dtype=jnp.int32)
    ks_c = jnp.arange(1, C, dtype=jnp.int32)
    return jnp.concatenate([
        jnp.stack([chip, die]).astype(jnp.int32),
        (die + ks_e) % E,
        (chip + ks_c) % C,
        (chip - ks_c + C) % C,
    ])


def _reduce_scatter_pallas(x, layout: ReduceScatterLayout, chip_axis, die_axis, interpret):
    lo = layout
    C, E, M, R, H = (
        lo.num_chips, lo.num_dies, lo.num_microbatches, lo.rows_per_microbatch, lo.hidden,
    )
    x5 = x.reshape(C, E, M, R, H)  # free view; ref reshapes inside kernels are avoided
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = (
        _struct_like((M, R, H), x.dtype, x),  # out
        _struct_like((M, max(E - 1, 1), C, R, H), x.dtype, x),  # recv1 (scratch)
        _struct_like((M, C, R, H), x.dtype, x),  # part (scratch)
        _struct_like((M, C, R, H), x.dtype, x),  # recv2 (scratch)
    )
    kernel = functools.partial(
        _reduce_scatter_kernel, layout=lo, chip_axis=chip_axis, die_axis=die_axis
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(),
        in_specs=[any_spec],
        out_specs=[any_spec] * len(out_shape),
        scratch_shapes=[
            pltpu.VMEM((R, H), x.dtype),  # a_vmem: accumulator tile
            pltpu.VMEM((R, H), x.dtype),  # b_vmem: operand tile
            pltpu.SemaphoreType.DMA(()),  # local_sem
            pltpu.SemaphoreType.DMA((M, max(E - 1, 1))),  # s1_send
            pltpu.SemaphoreType.DMA((M, max(E - 1, 1))),  # s1_recv
            pltpu.SemaphoreType.DMA((M, max(C - 1, 1))),  # s2_send
            pltpu.SemaphoreType.DMA((M, C)),  # s2_recv
        ],
    )
    out, *_ = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            collective_id=REDUCE_SCATTER_COLLECTIVE_ID,
            has_side_effects=True,
            # two [R, H] tiles (+ headroom); N=8192, H=4096 f32 at M=2: 2 x 8 MiB
            vmem_limit_bytes=min(
                2 * R * H * x.dtype.itemsize + VMEM_HEADROOM_BYTES, VMEM_MAX_BYTES
            ),
        ),
        cost_estimate=hierarchical_reduce_scatter_cost(
            lo.num_rows, H, dtype=x.dtype, num_chips=C, num_dies=E, num_microbatches=M
        ).to_pallas(),
        interpret=interpret,
    )(_peer_coords(lo, chip_axis, die_axis), x5)
    return out.reshape(M * R, H)  # [N/D, H]


def _interpret_params(resolved: str):
    """Interpret params for this kernel: DMAs execute as soon as they are issued ("eager"),
    closest to the hardware's overlap of transfers and reductions."""
    if resolved != "interpret":
        return False
    return pltpu.InterpretParams(dma_execution_mode="eager")


def hierarchical_reduce_scatter(
    x, *, chip_axis="chip", die_axis="die", num_microbatches=2, impl=None
):
    """Die-local then cross-chip reduce-scatter of rows, in pipelined micro-batches.

    Call inside ``shard_map`` over a mesh with axes ``chip_axis`` (C) and ``die_axis`` (E).

    Args:
      x: [N, H] this device's rows (float32, bfloat16 or int32), N divisible by C*E*M.
      chip_axis, die_axis: mesh axis names.
      num_microbatches: M in 1..4.
      impl: see ``kernels/dispatch.py``; "reference" runs the same two-stage schedule with lax
        collectives, "pallas"/"interpret" the remote-DMA kernel.

    Returns:
      [N / (C*E), H]: on the device with linear index c*E + e, the sum over all devices of
      their row block c*E + e. Equals ``ref_hierarchical_reduce_scatter`` (exactly for exact
      sums; float rounding may differ since the summation order differs).
    """
    num_chips = lax.axis_size(chip_axis)
    num_dies = lax.axis_size(die_axis)
    layout = _check_reduce_scatter(x, num_chips, num_dies, num_microbatches)
    resolved = dispatch.resolve(impl)
    if resolved == "reference":
        return _reduce_scatter_lax(x, layout, chip_axis, die_axis)
    return _reduce_scatter_pallas(x, layout, chip_axis, die_axis, _interpret_params(resolved))


# ----------------------------------------------------------------------------------------------
# Cost models (per device)
# ----------------------------------------------------------------------------------------------


def hierarchical_reduce_scatter_cost(
    num_rows, hidden, *, dtype=jnp.float32, num_chips=4, num_dies=2, num_microbatches=2
) -> Cost:
    """Adds and HBM traffic of one device's share of the hierarchical reduce-scatter.

    Counted per device (HBM only; VMEM tiles are free): stage 1 reads the N/E rows it keeps
    plus the (E-1)/E * N rows it sends, writes the received rows, reads them back, writes the
    N/E die-local sums; stage 2 reads the (C-1) partials it sends, writes the (C-1) received
    ones (+1 local copy), reads the C partials and writes the N/D result. Remote bytes: the
    (E-1)/E * N rows sent to the other dies and the (C-1) partial blocks sent to other chips.
    """
    del num_microbatches  # same traffic, only the overlap changes
    item = jnp.dtype(dtype).itemsize
    n, h, c, e = num_rows, hidden, num_chips, num_dies
    block = n // (c * e)  # rows of one destination block
    stage1_rows = n + 2 * (e - 1) * (n // e) + n // e  # read all, recv write+read, part write
    stage2_rows = (c - 1) * block + c * block + c * block + block  # send, recv, sum, out
    flops = (e - 1) * (n // e) * h + (c - 1) * block * h  # one add per element per stage
    sent_rows = (e - 1) * (n // e) + (c - 1) * block
    return Cost(flops=flops, bytes_accessed=(stage1_rows + stage2_rows) * h * item,
                remote_bytes=sent_rows * h * item)


def packed_all_gather_cost(num_tokens, top_k, num_devices) -> Cost:
    """HBM traffic of the packed all-gather on one device: pack, gather, unpack (int32)."""
    packed = num_tokens * 2 * top_k * 4  # bytes of one device's packed [T, 2K] rows
    gathered = num_devices * packed
    # read ids+weights, write packed; write gathered; read gathered, write ids+weights
    return Cost(flops=0, bytes_accessed=2 * packed + gathered + 2 * gathered)
