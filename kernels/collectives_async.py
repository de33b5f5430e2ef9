"""The hierarchical reduce-scatter as an asynchronous start / done pair of Pallas TPU kernels.

:func:`reduce_scatter_start` issues the remote DMAs of stage 1 (rows to the other dies of my
chip) and returns at once; :func:`reduce_scatter_done` waits for them, reduces, runs stage 2
(partial sums to my die on the other chips) and reduces again. Whatever the program runs on
the TensorCore between the two calls (the next micro-batch's expert matmuls, in
``models/moe.py``) overlaps the stage-1 transfer; stage 2 (over ICI) runs inside done and
overlaps only done's own reductions. Same result and the same summation order as
``collectives.hierarchical_reduce_scatter`` with one micro-batch; call both inside
``shard_map`` over the ("chip", "die") mesh.

Dimension letters as in ``kernels/collectives.py``: C chips, E dies per chip, D = C * E
devices, N rows per device, H hidden, R = N / D rows of one destination block. x[N, H] is
viewed as x[C, E, R, H]; block (c, e) belongs to the device at mesh position (chip c, die e).

What travels from start to done (:class:`ReduceScatterFuture`), as the "Pallas Async
Operations" design of JAX describes: the receive buffers and the DMA semaphores are *outputs*
of the start kernel, so XLA allocates them and keeps them alive until the done kernel (their
consumer) has run; the source rows go through the start kernel aliased to an output and on
into done, so XLA can neither free nor reuse them while the DMAs read them. Cross-device
safety: a peer writes into my buffers only after the start kernel's barrier (so my start has
run and allocated them), and my done returns only after every peer's write into them has
landed (it waits on their receive semaphores), so no write reaches a buffer XLA has reused.
Stage 2 sends from inside done into the peers' stage-2 buffers, which their start allocated.

Interpret mode: jax's TPU interpreter cannot return semaphores from a ``pallas_call``
(``NotImplementedError: nan + dma_sem`` when it allocates the output), so under
``impl="interpret"`` the start only carries x and the done runs the start and done bodies in
one kernel (:func:`_fused_kernel`), which checks the bodies' slots, peers and sums on CPU
devices. ``impl="reference"`` carries x and runs the lax two-stage schedule in done.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import collectives, dispatch
from kernels.cost import Cost

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


def _done_body(p: _Peers, x_hbm, recv1_hbm, recv2_hbm, s1_send, s1_recv, s2_recv,
               out_hbm, part_hbm, a_vmem, b_vmem, local_sem, s2_send):
    """Stage-1 reduce, stage-2 exchange and reduce; out_hbm [R, H] my block's sum."""
    C, E, chip = p.C, p.E, p.chip

    def local_copy(src, dst):
        copy = pltpu.make_async_copy(src, dst, local_sem)
        copy.start()
        copy.wait()

    def stage2_copy(k, src_chip, dst_chip):  # from chip src_chip to dst_chip, slot src_chip
        return pltpu.make_async_remote_copy(
            src_ref=part_hbm.at[dst_chip], dst_ref=recv2_hbm.at[src_chip],
            send_sem=s2_send.at[k - 1], recv_sem=s2_recv.at[src_chip],
            device_id=p.device(dst_chip, p.die))

    stage1 = [_stage1_copy(p, x_hbm, recv1_hbm, s1_send, s1_recv, k) for k in range(1, E)]
    for copy in stage1:
        copy.wait_recv()
    for c in range(C):  # my rows + the other dies' rows of the block (c, my die)
        local_copy(x_hbm.at[c, p.die], a_vmem)
        for k in range(1, E):
            local_copy(recv1_hbm.at[k - 1, c], b_vmem)
            a_vmem[...] = a_vmem[...] + b_vmem[...]
        local_copy(a_vmem, part_hbm.at[c])
    local_copy(part_hbm.at[chip], recv2_hbm.at[chip])
    sends = [stage2_copy(k, chip, p.chip_plus(k)) for k in range(1, C)]
    for copy in sends:
        copy.start()
    for k in range(1, C):  # what chip (chip - k) % C sent me: only its destination side
        stage2_copy(k, p.chip_minus(k), chip).wait_recv()
    local_copy(recv2_hbm.at[0], a_vmem)  # chip order 0..C-1, as the synchronous kernel
    for c in range(1, C):
        local_copy(recv2_hbm.at[c], b_vmem)
        a_vmem[...] = a_vmem[...] + b_vmem[...]
    local_copy(a_vmem, out_hbm)
    for copy in stage1 + sends:  # the sources must outlive every outgoing DMA
        copy.wait_send()


def _start_kernel(coords_ref, x_hbm, x_out, recv1_hbm, recv2_hbm, s1_send, s1_recv, s2_recv,
                  *, peers):
    del x_out, recv2_hbm, s2_recv  # x_out aliases x_hbm; recv2 and s2_recv are for done
    p = _Peers(coords_ref, *peers)
    _start_body(p, x_hbm, recv1_hbm, s1_send, s1_recv)


def _done_kernel(coords_ref, x_hbm, recv1_hbm, recv2_in, s1_send, s1_recv, s2_recv,
                 out_hbm, part_hbm, recv2_hbm, a_vmem, b_vmem, local_sem, s2_send, *, peers):
    del recv2_in  # aliased to recv2_hbm (peers write into it)
    p = _Peers(coords_ref, *peers)
    _done_body(p, x_hbm, recv1_hbm, recv2_hbm, s1_send, s1_recv, s2_recv,
               out_hbm, part_hbm, a_vmem, b_vmem, local_sem, s2_send)


def _fused_kernel(coords_ref, x_hbm, out_hbm, recv1_hbm, part_hbm, recv2_hbm,
                  a_vmem, b_vmem, local_sem, s1_send, s1_recv, s2_send, s2_recv, *, peers):
    """Start and done bodies in one kernel (interpret mode: no semaphores between calls)."""
    p = _Peers(coords_ref, *peers)
    _start_body(p, x_hbm, recv1_hbm, s1_send, s1_recv)
    _done_body(p, x_hbm, recv1_hbm, recv2_hbm, s1_send, s1_recv, s2_recv,
               out_hbm, part_hbm, a_vmem, b_vmem, local_sem, s2_send)


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


def _call_done(coords, fut: ReduceScatterFuture, peers):
    C, E, R, H, E1 = _geometry(fut.x)
    like = functools.partial(collectives._struct_like, dtype=fut.x.dtype, like=fut.x)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(), in_specs=[_ANY, _ANY, _ANY, _SEM, _SEM, _SEM],
        out_specs=[_ANY, _ANY, _ANY],
        scratch_shapes=[pltpu.VMEM((R, H), fut.x.dtype), pltpu.VMEM((R, H), fut.x.dtype),
                        pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA((max(C - 1, 1),))])
    out, _, _ = pl.pallas_call(
        functools.partial(_done_kernel, peers=peers), name="reduce_scatter_done",
        out_shape=(like((R, H)), like((C, R, H)), like((C, R, H))),
        grid_spec=grid_spec,
        input_output_aliases={3: 2},  # recv2 -> output 2 (peers write into it)
        cost_estimate=_cost_estimate(reduce_scatter_done_cost, fut.x),
        compiler_params=pltpu.CompilerParams(has_side_effects=True,
                                             vmem_limit_bytes=_vmem_limit(fut.x)),
    )(coords, fut.x, fut.recv1, fut.recv2, fut.s1_send, fut.s1_recv, fut.s2_recv)
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
# Cost models (per device; start + done = collectives.hierarchical_reduce_scatter_cost)
# ----------------------------------------------------------------------------------------------


def reduce_scatter_start_cost(num_rows, hidden, *, dtype, num_chips, num_dies) -> Cost:
    """The stage-1 sends: the (E-1)/E * N rows read from HBM and sent to the other dies."""
    sent = (num_dies - 1) * (num_rows // num_dies) * hidden * jnp.dtype(dtype).itemsize
    return Cost(flops=0, bytes_accessed=sent, remote_bytes=sent)


def reduce_scatter_done_cost(num_rows, hidden, *, dtype, num_chips, num_dies) -> Cost:
    """Everything else: both reductions and the stage-2 exchange."""
    dims = dict(dtype=dtype, num_chips=num_chips, num_dies=num_dies)
    total = collectives.hierarchical_reduce_scatter_cost(num_rows, hidden, **dims)
    start = reduce_scatter_start_cost(num_rows, hidden, **dims)
    return dataclasses.replace(total, bytes_accessed=total.bytes_accessed - start.bytes_accessed,
                               remote_bytes=total.remote_bytes - start.remote_bytes)


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


def reduce_scatter_done(fut: ReduceScatterFuture, *, chip_axis="chip", die_axis="die",
                        impl=None):
    """Finish a started reduce-scatter: [N / (C * E), H], on the device with linear index
    c * E + e the sum over all devices of their row block c * E + e (the result of
    ``collectives.hierarchical_reduce_scatter(x, num_microbatches=1)``, bit for bit)."""
    C, E, R, H = fut.x.shape
    lo = collectives.ReduceScatterLayout(C * E * R, H, C, E, 1)
    resolved = dispatch.resolve(impl)
    if resolved == "reference":
        return collectives._reduce_scatter_lax(fut.x.reshape(-1, H), lo, chip_axis, die_axis)
    coords = collectives._peer_coords(lo, chip_axis, die_axis)
    peers = (C, E, chip_axis, die_axis)
    if resolved == "interpret":
        return _call_fused(coords, fut.x, peers, collectives._interpret_params(resolved))
    return _call_done(coords, fut, peers)
