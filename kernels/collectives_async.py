"""The hierarchical reduce-scatter as three asynchronous Pallas TPU kernels.

:func:`reduce_scatter_start` issues the remote DMAs of stage 1 (rows to the other dies of my
chip) and returns at once; :func:`reduce_scatter_ici_start` waits for them, reduces, issues
the remote DMAs of stage 2 (partial sums to my die on the other chips, over ICI) and returns
at once; :func:`reduce_scatter_done` waits for those and reduces again. Whatever the program
runs on the TensorCore between start and ici_start overlaps the die-to-die transfer, and
what it runs between ici_start and done overlaps the ICI transfer. (The MoE combine that
overlapped them with the next expert group's or token chunk's matmuls measured slower than
the synchronous kernel at every 397B shape and was removed; these kernels stay, tested, for a
schedule that wins: README, "Overlap of the combine with the expert matmuls".) Same result and the same summation order as
``collectives.hierarchical_reduce_scatter`` with one micro-batch; call all three inside
``shard_map`` over the ("chip", "die") mesh. ``reduce_scatter_done`` given the stage-1 future
runs ici_start itself (the two-kernel form: start ... ici_start + done).

Dimension letters as in ``kernels/collectives.py``: C chips, E dies per chip, D = C * E
devices, N rows per device, H hidden, R = N / D rows of one destination block. x[N, H] is
viewed as x[C, E, R, H]; block (c, e) belongs to the device at mesh position (chip c, die e).

What travels between the kernels (:class:`ReduceScatterFuture`, then
:class:`ReduceScatterIciFuture`), as the "Pallas Async Operations" design of JAX describes:
the receive buffers and the DMA semaphores are *outputs* of the kernel that allocates them, so
XLA keeps them alive until their consumer has run. The source rows x go through the start
kernel aliased to an output and into ici_start, which waits for its stage-1 sends before it
returns; the stage-1 partial sums (the stage-2 DMA source) are an output of ici_start and an
input of done, which waits for its stage-2 sends before it returns, so XLA can neither free
nor reuse a DMA source while a DMA reads it. The stage-2 receive buffer is allocated by the
start kernel and aliased through ici_start and done. Cross-device safety: a peer writes into
my buffers (stage 1 from start, stage 2 from ici_start) only after my start kernel's barrier
(so my start has run and allocated both receive buffers), and my ici_start / done return
only after every peer's write into them has landed (they wait on the receive semaphores), so
no write reaches a buffer XLA has reused.

Interpret mode: jax's TPU interpreter cannot return semaphores from a ``pallas_call``
(``NotImplementedError: nan + dma_sem`` when it allocates the output), so under
``impl="interpret"`` start and ici_start only carry x and the done runs the three bodies in
one kernel (:func:`_fused_kernel`), which checks the bodies' slots, peers and sums on CPU
devices. ``impl="reference"`` carries x and runs the lax two-stage schedule in done.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import collectives, dispatch
from .cost import Cost

# collective_id of the start kernel's barrier (the synchronous kernel uses 0).
ASYNC_COLLECTIVE_ID = 1


class ReduceScatterFuture(NamedTuple):
    """A started reduce-scatter (per device). Under "pallas" every field is set; under
    "interpret" / "reference" only ``x`` (the done computes everything)."""

    x: jax.Array  # [C, E, R, H] this device's rows (the DMA source)
    recv1: jax.Array | None = None  # [E-1, C, R, H] stage-1 rows from die (die - k) % E
    recv2: jax.Array | None = None  # [C, R, H] stage-2 partials of my block, slot = chip
    s1_send: jax.Array | None = None  # DMA semaphores [E-1]
    s1_recv: jax.Array | None = None  # DMA semaphores [E-1]
    s2_recv: jax.Array | None = None  # DMA semaphores [C]


class ReduceScatterIciFuture(NamedTuple):
    """A reduce-scatter whose stage 2 (ICI) is in flight (per device). Under "pallas" every
    field is set; under "interpret" / "reference" only ``x`` (the done computes everything)."""

    x: jax.Array  # [C, E, R, H] under "interpret" / "reference"; [C, R, H] part under "pallas"
    recv2: jax.Array | None = None  # [C, R, H] stage-2 partials of my block, slot = chip
    s2_send: jax.Array | None = None  # DMA semaphores [max(C-1, 1)]
    s2_recv: jax.Array | None = None  # DMA semaphores [C]


class _Peers:
    """Mesh positions of my peers, read from the scalar-prefetched coordinates
    (``collectives._peer_coords``: chip, die, (die+k)%E, (chip+k)%C, (chip-k)%C)."""

    def __init__(self, coords_ref, num_chips, num_dies, chip_axis, die_axis):
        self.coords, self.C, self.E = coords_ref, num_chips, num_dies
        self.chip_axis, self.die_axis = chip_axis, die_axis
        self.chip, self.die = coords_ref[0], coords_ref[1]

    def die_plus(self, k):  # (die + k) % E, 1 <= k < E
        return self.coords[1 + k]

    def chip_plus(self, k):  # (chip + k) % C, 1 <= k < C
        return self.coords[self.E + k]

    def chip_minus(self, k):  # (chip - k) % C, 1 <= k < C
        return self.coords[self.E + self.C - 1 + k]

    def device(self, chip, die):
        return {self.chip_axis: chip, self.die_axis: die}

    def all(self):
        """The other dies of my chip, then my die on the other chips."""
        out = [self.device(self.chip, self.die_plus(k)) for k in range(1, self.E)]
        return out + [self.device(self.chip_plus(k), self.die) for k in range(1, self.C)]


# ----------------------------------------------------------------------------------------------
# Kernel bodies (refs in HBM unless noted)
# ----------------------------------------------------------------------------------------------


def _stage1_copy(p: _Peers, x_hbm, recv1_hbm, s1_send, s1_recv, k):
    """To die (die + k) % E: the rows of every block that die owns (one per chip), slot k - 1.
    The same descriptor describes what I receive from die (die - k) % E (wait_recv only uses
    the destination and its semaphore)."""
    return pltpu.make_async_remote_copy(
        src_ref=x_hbm.at[:, p.die_plus(k)],  # [C, R, H] strided
        dst_ref=recv1_hbm.at[k - 1],  # [C, R, H]
        send_sem=s1_send.at[k - 1], recv_sem=s1_recv.at[k - 1],
        device_id=p.device(p.chip, p.die_plus(k)))


def _start_body(p: _Peers, x_hbm, recv1_hbm, s1_send, s1_recv):
    """Barrier with every peer (nobody writes into a peer's buffers before the peer has
    entered its start kernel), then issue the stage-1 sends."""
    barrier = pltpu.get_barrier_semaphore()
    peers = p.all()
    for peer in peers:
        collectives._semaphore_signal(barrier, 1, device_id=peer)
    collectives._semaphore_wait(barrier, len(peers))
    for k in range(1, p.E):
        _stage1_copy(p, x_hbm, recv1_hbm, s1_send, s1_recv, k).start()


def _local_copy(src, dst, sem):
    copy = pltpu.make_async_copy(src, dst, sem)
    copy.start()
    copy.wait()


def _stage2_copy(p: _Peers, part_hbm, recv2_hbm, s2_send, s2_recv, k, src_chip, dst_chip):
    """From chip src_chip to dst_chip (= src_chip + k): my partial sum of dst_chip's block
    into its stage-2 buffer, slot src_chip."""
    return pltpu.make_async_remote_copy(
        src_ref=part_hbm.at[dst_chip], dst_ref=recv2_hbm.at[src_chip],
        send_sem=s2_send.at[k - 1], recv_sem=s2_recv.at[src_chip],
        device_id=p.device(dst_chip, p.die))


def _ici_start_body(p: _Peers, x_hbm, recv1_hbm, recv2_hbm, s1_send, s1_recv, s2_send,
                    s2_recv, part_hbm, a_vmem, b_vmem, local_sem):
    """Wait for stage 1, reduce it into part_hbm [C, R, H] (block (c, my die) summed over my
    chip's dies, in die order me, me-1, ...), issue the stage-2 sends (not waited here)."""
    C, E, chip = p.C, p.E, p.chip
    stage1 = [_stage1_copy(p, x_hbm, recv1_hbm, s1_send, s1_recv, k) for k in range(1, E)]
    for copy in stage1:
        copy.wait_recv()
    for c in range(C):  # my rows + the other dies' rows of the block (c, my die)
        _local_copy(x_hbm.at[c, p.die], a_vmem, local_sem)
        for k in range(1, E):
            _local_copy(recv1_hbm.at[k - 1, c], b_vmem, local_sem)
            a_vmem[...] = a_vmem[...] + b_vmem[...]
        _local_copy(a_vmem, part_hbm.at[c], local_sem)
    for k in range(1, C):
        _stage2_copy(p, part_hbm, recv2_hbm, s2_send, s2_recv, k, chip, p.chip_plus(k)).start()
    for copy in stage1:  # x and recv1 are released after this kernel
        copy.wait_send()


def _done_body(p: _Peers, part_hbm, recv2_hbm, s2_send, s2_recv, out_hbm, a_vmem, b_vmem,
               local_sem):
    """Wait for stage 2 and reduce it: out_hbm [R, H] my block's sum (chip order 0..C-1)."""
    C, chip = p.C, p.chip
    _local_copy(part_hbm.at[chip], recv2_hbm.at[chip], local_sem)  # no peer writes slot chip
    for k in range(1, C):  # what chip (chip - k) % C sent me: only its destination side
        _stage2_copy(p, part_hbm, recv2_hbm, s2_send, s2_recv, k, p.chip_minus(k),
                     chip).wait_recv()
    _local_copy(recv2_hbm.at[0], a_vmem, local_sem)  # chip order, as the synchronous kernel
    for c in range(1, C):
        _local_copy(recv2_hbm.at[c], b_vmem, local_sem)
        a_vmem[...] = a_vmem[...] + b_vmem[...]
    _local_copy(a_vmem, out_hbm, local_sem)
    for k in range(1, C):  # part must outlive every outgoing DMA
        _stage2_copy(p, part_hbm, recv2_hbm, s2_send, s2_recv, k, chip,
                     p.chip_plus(k)).wait_send()


def _start_kernel(coords_ref, x_hbm, x_out, recv1_hbm, recv2_hbm, s1_send, s1_recv, s2_recv,
                  *, peers):
    del x_out, recv2_hbm, s2_recv  # x_out aliases x_hbm; recv2 and s2_recv are for later
    p = _Peers(coords_ref, *peers)
    _start_body(p, x_hbm, recv1_hbm, s1_send, s1_recv)


def _ici_start_kernel(coords_ref, x_hbm, recv1_hbm, recv2_in, s1_send, s1_recv, s2_recv,
                      part_hbm, recv2_hbm, s2_send, a_vmem, b_vmem, local_sem, *, peers):
    del recv2_in  # aliased to recv2_hbm (peers write into it)
    p = _Peers(coords_ref, *peers)
    _ici_start_body(p, x_hbm, recv1_hbm, recv2_hbm, s1_send, s1_recv, s2_send, s2_recv,
                    part_hbm, a_vmem, b_vmem, local_sem)


def _done_kernel(coords_ref, part_hbm, recv2_in, s2_send, s2_recv, out_hbm, recv2_hbm,
                 a_vmem, b_vmem, local_sem, *, peers):
    del recv2_in  # aliased to recv2_hbm (peers write into it)
    p = _Peers(coords_ref, *peers)
    _done_body(p, part_hbm, recv2_hbm, s2_send, s2_recv, out_hbm, a_vmem, b_vmem, local_sem)


def _fused_kernel(coords_ref, x_hbm, out_hbm, recv1_hbm, part_hbm, recv2_hbm,
                  a_vmem, b_vmem, local_sem, s1_send, s1_recv, s2_send, s2_recv, *, peers):
    """The three bodies in one kernel (interpret mode: no semaphores between calls)."""
    p = _Peers(coords_ref, *peers)
    _start_body(p, x_hbm, recv1_hbm, s1_send, s1_recv)
    _ici_start_body(p, x_hbm, recv1_hbm, recv2_hbm, s1_send, s1_recv, s2_send, s2_recv,
                    part_hbm, a_vmem, b_vmem, local_sem)
    _done_body(p, part_hbm, recv2_hbm, s2_send, s2_recv, out_hbm, a_vmem, b_vmem, local_sem)


# ----------------------------------------------------------------------------------------------
# pallas_calls
# ----------------------------------------------------------------------------------------------

_ANY = pl.BlockSpec(memory_space=pl.ANY)
_SEM = pl.BlockSpec(memory_space=pltpu.SEMAPHORE)


def _geometry(x5):
    C, E, R, H = x5.shape
    return C, E, R, H, max(E - 1, 1)


def _vmem_limit(x5):
    R, H = x5.shape[2:]
    tiles = 2 * R * H * x5.dtype.itemsize
    return min(tiles + collectives.VMEM_HEADROOM_BYTES, collectives.VMEM_MAX_BYTES)


def _call_start(coords, x5, peers):
    C, E, R, H, E1 = _geometry(x5)
    like = functools.partial(collectives._struct_like, dtype=x5.dtype, like=x5)
    out_shape = (like(x5.shape), like((E1, C, R, H)), like((C, R, H)),
                 pltpu.SemaphoreType.DMA((E1,)), pltpu.SemaphoreType.DMA((E1,)),
                 pltpu.SemaphoreType.DMA((C,)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(), in_specs=[_ANY],
        out_specs=[_ANY, _ANY, _ANY, _SEM, _SEM, _SEM])
    outs = pl.pallas_call(
        functools.partial(_start_kernel, peers=peers), name="reduce_scatter_start",
        out_shape=out_shape, grid_spec=grid_spec,
        input_output_aliases={1: 0},  # x (after the coords) -> output 0
        cost_estimate=_cost_estimate(reduce_scatter_start_cost, x5),
        compiler_params=pltpu.CompilerParams(collective_id=ASYNC_COLLECTIVE_ID,
                                             has_side_effects=True),
    )(coords, x5)
    return ReduceScatterFuture(*outs)


def _scratch(R, H, dtype):
    return [pltpu.VMEM((R, H), dtype), pltpu.VMEM((R, H), dtype), pltpu.SemaphoreType.DMA(())]


def _call_ici_start(coords, fut: ReduceScatterFuture, peers) -> ReduceScatterIciFuture:
    C, E, R, H, E1 = _geometry(fut.x)
    like = functools.partial(collectives._struct_like, dtype=fut.x.dtype, like=fut.x)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(), in_specs=[_ANY, _ANY, _ANY, _SEM, _SEM, _SEM],
        out_specs=[_ANY, _ANY, _SEM], scratch_shapes=_scratch(R, H, fut.x.dtype))
    part, recv2, s2_send = pl.pallas_call(
        functools.partial(_ici_start_kernel, peers=peers), name="reduce_scatter_ici_start",
        out_shape=(like((C, R, H)), like((C, R, H)),
                   pltpu.SemaphoreType.DMA((max(C - 1, 1),))),
        grid_spec=grid_spec,
        input_output_aliases={3: 1},  # recv2 -> output 1 (peers write into it)
        cost_estimate=_cost_estimate(reduce_scatter_ici_start_cost, fut.x),
        compiler_params=pltpu.CompilerParams(has_side_effects=True,
                                             vmem_limit_bytes=_vmem_limit(fut.x)),
    )(coords, fut.x, fut.recv1, fut.recv2, fut.s1_send, fut.s1_recv, fut.s2_recv)
    return ReduceScatterIciFuture(part, recv2, s2_send, fut.s2_recv)


def _call_done(coords, fut: ReduceScatterIciFuture, peers):
    C, R, H = fut.x.shape
    x5 = jax.ShapeDtypeStruct((C, peers[1], R, H), fut.x.dtype)  # for the cost and VMEM
    like = functools.partial(collectives._struct_like, dtype=fut.x.dtype, like=fut.x)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(), in_specs=[_ANY, _ANY, _SEM, _SEM],
        out_specs=[_ANY, _ANY], scratch_shapes=_scratch(R, H, fut.x.dtype))
    out, _ = pl.pallas_call(
        functools.partial(_done_kernel, peers=peers), name="reduce_scatter_done",
        out_shape=(like((R, H)), like((C, R, H))),
        grid_spec=grid_spec,
        input_output_aliases={2: 1},  # recv2 -> output 1 (peers write into it)
        cost_estimate=_cost_estimate(reduce_scatter_done_cost, x5),
        compiler_params=pltpu.CompilerParams(has_side_effects=True,
                                             vmem_limit_bytes=_vmem_limit(x5)),
    )(coords, fut.x, fut.recv2, fut.s2_send, fut.s2_recv)
    return out


def _call_fused(coords, x5, peers, interpret):
    C, E, R, H, E1 = _geometry(x5)
    like = functools.partial(collectives._struct_like, dtype=x5.dtype, like=x5)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(), in_specs=[_ANY], out_specs=[_ANY] * 4,
        scratch_shapes=[
            pltpu.VMEM((R, H), x5.dtype), pltpu.VMEM((R, H), x5.dtype),
            pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA((E1,)),
            pltpu.SemaphoreType.DMA((E1,)), pltpu.SemaphoreType.DMA((max(C - 1, 1),)),
            pltpu.SemaphoreType.DMA((C,))])
    out, *_ = pl.pallas_call(
        functools.partial(_fused_kernel, peers=peers), name="reduce_scatter_fused",
        out_shape=(like((R, H)), like((E1, C, R, H)), like((C, R, H)), like((C, R, H))),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(collective_id=ASYNC_COLLECTIVE_ID,
                                             has_side_effects=True,
                                             vmem_limit_bytes=_vmem_limit(x5)),
        interpret=interpret,
    )(coords, x5)
    return out


# ----------------------------------------------------------------------------------------------
# Cost models (per device; start + ici_start + done = hierarchical_reduce_scatter_cost)
# ----------------------------------------------------------------------------------------------


def reduce_scatter_start_cost(num_rows, hidden, *, dtype, num_chips, num_dies) -> Cost:
    """The stage-1 sends: the (E-1)/E * N rows read from HBM and sent to the other dies."""
    sent = (num_dies - 1) * (num_rows // num_dies) * hidden * jnp.dtype(dtype).itemsize
    return Cost(flops=0, bytes_accessed=sent, remote_bytes=sent)


def reduce_scatter_ici_start_cost(num_rows, hidden, *, dtype, num_chips, num_dies) -> Cost:
    """The stage-1 reduction (the rows kept and received, read; the N/E partial sums
    written) and the stage-2 sends: the C-1 partial blocks read and sent to the other chips."""
    item = jnp.dtype(dtype).itemsize
    n, c, e = num_rows, num_chips, num_dies
    block = n // (c * e)
    kept_rows = n // e  # read by the reduction (the start's DMAs read the others)
    stage1_rows = kept_rows + 2 * (e - 1) * (n // e) + n // e  # kept, recv write+read, part
    sent = (c - 1) * block * hidden * item
    return Cost(flops=(e - 1) * (n // e) * hidden,
                bytes_accessed=stage1_rows * hidden * item + sent, remote_bytes=sent)


def reduce_scatter_done_cost(num_rows, hidden, *, dtype, num_chips, num_dies) -> Cost:
    """The stage-2 reduction: everything the start and ici_start kernels do not do."""
    dims = dict(dtype=dtype, num_chips=num_chips, num_dies=num_dies)
    total = collectives.hierarchical_reduce_scatter_cost(num_rows, hidden, **dims)
    rest = reduce_scatter_start_cost(num_rows, hidden, **dims) + reduce_scatter_ici_start_cost(
        num_rows, hidden, **dims)
    return Cost(flops=total.flops - rest.flops,
                bytes_accessed=total.bytes_accessed - rest.bytes_accessed,
                remote_bytes=total.remote_bytes - rest.remote_bytes)


def _cost_estimate(cost_fn, x5):
    C, E, R, H = x5.shape
    return cost_fn(C * E * R, H, dtype=x5.dtype, num_chips=C, num_dies=E).to_pallas()


# ----------------------------------------------------------------------------------------------
# API
# ----------------------------------------------------------------------------------------------


def _layout(x, chip_axis, die_axis):
    return collectives._check_reduce_scatter(
        x, lax.axis_size(chip_axis), lax.axis_size(die_axis), num_microbatches=1)


def reduce_scatter_start(x, *, chip_axis="chip", die_axis="die", impl=None
                         ) -> ReduceScatterFuture:
    """Start the hierarchical reduce-scatter of x [N, H] (N divisible by C * E); returns at once
    on TPU with the stage-1 DMAs in flight. Pass the future to :func:`reduce_scatter_done`."""
    lo = _layout(x, chip_axis, die_axis)
    x5 = x.reshape(lo.num_chips, lo.num_dies, lo.rows_per_block, lo.hidden)
    if dispatch.resolve(impl) != "pallas":
        return ReduceScatterFuture(x5)
    coords = collectives._peer_coords(lo, chip_axis, die_axis)
    return _call_start(coords, x5, (lo.num_chips, lo.num_dies, chip_axis, die_axis))


def reduce_scatter_ici_start(fut: ReduceScatterFuture, *, chip_axis="chip", die_axis="die",
                             impl=None) -> ReduceScatterIciFuture:
    """Finish stage 1 of a started reduce-scatter and start stage 2: returns at once on TPU
    with the ICI DMAs in flight. Pass the future to :func:`reduce_scatter_done`."""
    if dispatch.resolve(impl) != "pallas":
        return ReduceScatterIciFuture(fut.x)
    C, E, R, H = fut.x.shape
    lo = collectives.ReduceScatterLayout(C * E * R, H, C, E, 1)
    coords = collectives._peer_coords(lo, chip_axis, die_axis)
    return _call_ici_start(coords, fut, (C, E, chip_axis, die_axis))


def reduce_scatter_done(fut: ReduceScatterFuture | ReduceScatterIciFuture, *, chip_axis="chip",
                        die_axis="die", impl=None):
    """Finish a started reduce-scatter: [N / (C * E), H], on the device with linear index
    c * E + e the sum over all devices of their row block c * E + e (the result of
    ``collectives.hierarchical_reduce_scatter(x, num_microbatches=1)``, bit for bit). Given
    the stage-1 future (of :func:`reduce_scatter_start`) it runs
    :func:`reduce_scatter_ici_start` first."""
    axes = dict(chip_axis=chip_axis, die_axis=die_axis, impl=impl)
    if isinstance(fut, ReduceScatterFuture):
        fut = reduce_scatter_ici_start(fut, **axes)
    resolved = dispatch.resolve(impl)
    if resolved == "pallas":
        C, R, H = fut.x.shape
        E = lax.axis_size(die_axis)
        lo = collectives.ReduceScatterLayout(C * E * R, H, C, E, 1)
        coords = collectives._peer_coords(lo, chip_axis, die_axis)
        return _call_done(coords, fut, (C, E, chip_axis, die_axis))
    C, E, R, H = fut.x.shape
    lo = collectives.ReduceScatterLayout(C * E * R, H, C, E, 1)
    if resolved == "reference":
        return collectives._reduce_scatter_lax(fut.x.reshape(-1, H), lo, chip_axis, die_axis)
    coords = collectives._peer_coords(lo, chip_axis, die_axis)
    peers = (C, E, chip_axis, die_axis)
    return _call_fused(coords, fut.x, peers, collectives._interpret_params(resolved))
