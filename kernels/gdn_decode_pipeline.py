"""Software pipeline of the per-row state DMAs of the GDN decode kernel
(``gdn_kernels._decode_kernel``).

The decode grid is (head block j "parallel", decode row t "arbitrary"): for one j the rows run
in order on one core (on a megacore each core takes whole j sequences), and every real row
moves its state block HBM -> VMEM (fetch) and back (write-back). Waiting for each DMA right
after starting it made a row cost two DMA latencies; here the state scratch is double
buffered (buffer slot ``t % 2`` holds row t) so that at row t

  1. (t == 0 only) row 0's fetch is started into buffer slot 0;
  2. if row t+1 will be fetched: the write-back of row t-1, which left from buffer slot
     (t+1) % 2, is waited, then row t+1's fetch into that buffer slot is started;
  3. row t's own fetch (started one step earlier) is waited, row t is computed in its buffer
     slot (a FRESH row first zeroes it, a padding row only zeroes its output);
  4. if step 2 did not wait for row t-1's write-back, it is waited now -- before row t's
     write-back starts, so write-backs land in row order, at most one in flight;
  5. row t's write-back is started, and waited only at step 2 / 4 of row t+1, or right away
     when t is the last row.

What is outstanding is a function of the scalar-prefetched row flags alone (row t-1 real:
its write-back is outstanding at row t; row t+1 real and not FRESH: its fetch is started at
row t), so every start is matched by exactly one wait under the same condition, the wait
rebuilt from the same descriptors (same refs, same shapes, same semaphore). Fetches and
write-backs of each buffer slot signal separate semaphores.

Hazards. The fetch of row t+1 is in flight while row t computes and while row t's
write-back runs: it must not read an HBM state that row t (or t-1) writes. Rows t-1, t and
t+1 are different requests of one decode step, and the real requests of a batch own distinct
state slots (the scheduler hands each running request its own slot from the state-slot pool,
``batch_builder`` copies it into ``state_slots``; the reference's scatter would be ill-defined
with duplicates too), so their HBM blocks are disjoint; padding rows -- whose slot indices do
repeat (0, or clipped) -- never fetch or write back. Head blocks touch disjoint channels and
heads. Hence no guard: with a duplicated slot the result would be undefined (a fetch could
overlap a write-back of the same block), not just reordered. The speculative verify kernel
(``gdn_verify_kernel``) reads states only and is not pipelined here.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from .gdn_common import FRESH, VALID

FETCH, WRITE_BACK = 0, 1  # leading index of the decode kernel's semaphore array


def _row_flags(flags_ref, row):
    """(real, fetch) of a decode row: a real row fetches its state unless it is FRESH."""
    f = flags_ref[row]
    real = (f & VALID) != 0
    return real, real & ((f & FRESH) == 0)


def _start(copies):
    for cp in copies:
        cp.start()


def _wait(copies):
    for cp in copies:
        cp.wait()


def pipelined_rows(flags_ref, transfer, *, zero_state, compute, padding):
    """Run decode row t = ``pl.program_id(1)`` with its state DMAs pipelined (module doc).

    transfer(row, buf, direction) -> the async copies moving ``row``'s state between HBM and
    buffer slot ``buf`` (FETCH: into VMEM; WRITE_BACK: out of it), built the same way for the
    start and the wait; zero_state(buf): a FRESH row's zero state; compute(buf): a real row's
    step on the state in buffer slot buf; padding(): a padding row's output.
    """
    t, T = pl.program_id(1), pl.num_programs(1)
    cur, other = t % 2, (t + 1) % 2  # buffer slots of row t and of rows t-1, t+1
    prev, nxt = jnp.maximum(t - 1, 0), jnp.minimum(t + 1, T - 1)
    real, fetch = _row_flags(flags_ref, t)
    prev_wrote = (t > 0) & _row_flags(flags_ref, prev)[0]  # row t-1's write-back outstanding
    next_fetch = (t + 1 < T) & _row_flags(flags_ref, nxt)[1]
    not_ = jnp.logical_not

    @pl.when((t == 0) & fetch)
    def _():
        _start(transfer(t, cur, FETCH))

    @pl.when(prev_wrote & next_fetch)  # buffer slot `other` is refilled: drain it first
    def _():
        _wait(transfer(prev, other, WRITE_BACK))

    @pl.when(next_fetch)
    def _():
        _start(transfer(nxt, other, FETCH))

    @pl.when(not_(real))
    def _():
        padding()

    @pl.when(real & not_(fetch))
    def _():
        zero_state(cur)

    @pl.when(fetch)
    def _():
        _wait(transfer(t, cur, FETCH))

    @pl.when(real)
    def _():
        compute(cur)

    @pl.when(prev_wrote & not_(next_fetch))  # (before row t's write-back: one in flight)
    def _():
        _wait(transfer(prev, other, WRITE_BACK))

    @pl.when(real)
    def _():
        _start(transfer(t, cur, WRITE_BACK))

    @pl.when(real & (t == T - 1))  # nothing may be left in flight when the kernel ends
    def _():
        _wait(transfer(t, cur, WRITE_BACK))
