"""Software pipeline of the state DMAs of the GDN decode kernel (``gdn_kernels._decode_kernel``).

The decode grid is (head block j "parallel", grid step i "arbitrary"); step i handles the rb
consecutive decode rows t = i * rb + r, r = 0..rb-1 (the wrapper pads the rows up to a
multiple of rb with padding rows). For one j the steps run in order on one core (on a
megacore each core takes whole j sequences), and every real row moves its state block HBM ->
VMEM (fetch) and back (write-back). A grid step has a fixed cost (its automatic BlockSpec
DMAs, the step itself), so rb rows share one; and the state DMAs are pipelined across steps:
the state scratch is double buffered by step -- buffer ``i % 2`` holds the rb rows of step i,
row position r in its slot r -- so the rb fetches of step i+1 run while step i computes.

At step i (``cur = i % 2``, ``other = (i + 1) % 2``):

  0. (i == 0 only) every row of step 0 that fetches starts its fetch into (cur, r);
  then for r = 0..rb-1 in order (row t = i * rb + r):
  1. if row t - rb (step i-1, same position) is real, its write-back, which left from
     (other, r), is waited -- before (other, r) is refilled; it was started about one step
     earlier;
  2. if row t + rb (step i+1) will be fetched: its fetch into (other, r) is started;
  3. row t: a padding row only zeroes its output; a FRESH row zeroes (cur, r); a fetched row
     waits for its fetch (started one step earlier, in step 0 by 0.); a real row is computed
     in (cur, r) and its write-back is started from (cur, r);
  4. (last step only, after all rows) the write-back of every real row of the step is waited:
     nothing is left in flight when the kernel ends.

What is outstanding is a function of the scalar-prefetched row flags alone: the write-back of
a real row t of step i is started at 3. and waited at 1. of row t + rb, or at 4. when step i
is the last; the fetch of a real non-FRESH row t is started at 2. of row t - rb (at 0. in step
0) and waited at 3. So every start is matched by exactly one wait under the same condition,
the wait rebuilt from the same descriptors (same refs, same shapes, same semaphore).
Semaphores are per direction (FETCH, WRITE_BACK), buffer and row position, so no two copies in
flight share one. Padding rows move nothing.

Hazards. Fetches of step i+1 run while rows of step i compute and write back, and while the
write-backs of step i-1 finish: they must not read an HBM state that another row of the batch
writes. All of these rows are different requests of one decode step, and the real requests of
a batch own distinct state slots (the scheduler hands each running request its own slot from
the state-slot pool, ``batch_builder`` copies it into ``state_slots``; the reference's scatter
would be ill-defined with duplicates too), so their HBM blocks are disjoint; padding rows --
whose slot indices do repeat (0, or clipped) -- never fetch or write back. Head blocks touch
disjoint channels and heads. Hence no guard: with a duplicated slot the result would be
undefined (a fetch could overlap a write-back of the same block), not just reordered. The
speculative verify kernel (``gdn_verify_kernel``) reads states only and is not pipelined here.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
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


def pipelined_steps(flags_ref, rb, transfer, *, zero_state, compute, padding):
    """Run grid step i = ``pl.program_id(1)``, rows i*rb .. i*rb+rb-1, with the state DMAs
    pipelined across steps (module doc). flags_ref: i32[T'] row flags, T' = steps * rb.

    transfer(row, buf, r, direction) -> the async copies moving decode ``row``'s state between
    HBM and slot r of buffer ``buf`` (FETCH: into VMEM; WRITE_BACK: out of it), built the same
    way for the start and the wait; zero_state(buf, r): a FRESH row's zero state;
    compute(buf, r): real row ``i*rb + r``'s step on the state in (buf, r); padding(r): a
    padding row's output. r is a traced i32 (the rows run in a ``lax.fori_loop``).
    """
    i, n = pl.program_id(1), pl.num_programs(1)
    cur, other = i % 2, (i + 1) % 2
    not_ = jnp.logical_not

    @pl.when(i == 0)
    def _():
        def first(r, carry):
            @pl.when(_row_flags(flags_ref, r)[1])
            def _():
                _start(transfer(r, cur, r, FETCH))
            return carry

        lax.fori_loop(0, rb, first, 0)

    def row(r, carry):
        t = i * rb + r
        prev, nxt = jnp.maximum(t - rb, 0), jnp.minimum(t + rb, n * rb - 1)  # (clipped)
        real, fetch = _row_flags(flags_ref, t)
        prev_wrote = (i > 0) & _row_flags(flags_ref, prev)[0]
        next_fetch = (i + 1 < n) & _row_flags(flags_ref, nxt)[1]

        @pl.when(prev_wrote)  # slot (other, r) is about to be refilled (or left): drain it
        def _():
            _wait(transfer(prev, other, r, WRITE_BACK))

        @pl.when(next_fetch)
        def _():
            _start(transfer(nxt, other, r, FETCH))

        @pl.when(not_(real))
        def _():
            padding(r)

        @pl.when(real & not_(fetch))
        def _():
            zero_state(cur, r)

        @pl.when(fetch)
        def _():
            _wait(transfer(t, cur, r, FETCH))

        @pl.when(real)
        def _():
            compute(cur, r)
            _start(transfer(t, cur, r, WRITE_BACK))

        return carry

    lax.fori_loop(0, rb, row, 0)

    @pl.when(i == n - 1)  # nothing may be left in flight when the kernel ends
    def _():
        def drain(r, carry):
            @pl.when(_row_flags(flags_ref, i * rb + r)[0])
            def _():
                _wait(transfer(i * rb + r, cur, r, WRITE_BACK))
            return carry

        lax.fori_loop(0, rb, drain, 0)
