"""The grouped matmul's weight tiles, fetched one run of visits ahead (``gmm._gmm_kernel``).

As a BlockSpec input, a weight tile is fetched during the grid step before the one that
reads it. When the group changes, the next group's tile -- [tn, K] per half, 8 MiB for the
397B gate_up's gate and up halves, 8 MiB for its down -- then has one step's compute to
arrive in (7.9-9.2k issued bundles, ~5-6 us on a v5e) and needs ~11 us at the 766 GB/s a
Pallas read measured there, so by that estimate the MXU waits at every group change: 128
times in a prefill gate_up of 64 experts and 2 N tiles. On a v5e this pipeline took that
prefill gate_up from 2.535 to 2.218 ms (56.9% -> 65.0% of the MXU; 2026-12-07).

Here the weights stay in HBM (``pl.ANY``) and two VMEM slots hold them: the tile of the run
being computed and the next run's, whose fetch starts as soon as the current run starts. A
*run* is the consecutive visits of one N tile that read one group's tile (at the 397B
prefill shapes ~2 visits a group, 1 at decode). Used when the contraction is one K tile
(the default up to K = 4096); at visit v of N tile n:

  1. v == 0: slot 0; the run's tile is fetched there (an N tile starts with nothing in
     flight, so on a megacore, whose cores split the N tiles, each core's tiles stand alone);
  2. a later run start (``group[v] != group[v - 1]``): the slot flips to the one the previous
     run's start fetched this run's tile into;
  3. at every run start, the run's tile is waited, then the next run's tile
     (``next_group[v]``, -1 for none) starts into the other slot, which the previous run --
     the only reader of that slot -- has finished with.

Every fetch is started once and waited once, with the same descriptors (group, N tile,
slot, half); the last run of an N tile starts none, so nothing is in flight when it ends.
Semaphores are per slot and half (gate, up).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def next_groups(group, num_visits):
    """i32[V]: for each visit, the group of the next run (the first later visit in use whose
    group differs), or -1 when its run is the last. group i32[V]; num_visits the i32 count of
    visits in use (``gmm.make_group_metadata``)."""
    v_max = group.shape[0]
    u = jnp.arange(v_max, dtype=jnp.int32)
    run_start = (u >= 1) & (u < num_visits) & (group != jnp.roll(group, 1))
    start_at = jnp.where(run_start, u, v_max)  # i32[V]: u where a run starts, else V
    after = jnp.concatenate([start_at[1:], jnp.full((1,), v_max, jnp.int32)])
    nxt = lax.cummin(after, reverse=True)  # i32[V]: the first run start after v
    return jnp.where(nxt < v_max, group[jnp.minimum(nxt, v_max - 1)], -1).astype(jnp.int32)


def scratch(halves: int, tn: int, tk: int, dtype) -> list:
    """The VMEM slots [2, halves, tn, tk], the slot in use (SMEM) and the DMA semaphores."""
    return [pltpu.VMEM((2, halves, tn, tk), dtype), pltpu.SMEM((1,), jnp.int32),
            pltpu.SemaphoreType.DMA((2, halves))]


def run_weights(rhs_hbm, w_buf, slot_ref, sems, *, layer, group_ref, next_ref, num_n, tn):
    """Steps 1-3 of the module doc at grid step (n, v); returns the weight tile refs
    [tn, tk] of this visit's group, one per half (gate[, up]).

    rhs_hbm [Lyr, G, halves * Np, K] in HBM; w_buf, slot_ref, sems: ``scratch``."""
    n, v = pl.program_id(0), pl.program_id(1)
    halves = w_buf.shape[1]

    def copies(group, slot):
        return [pltpu.make_async_copy(rhs_hbm.at[layer, group, pl.ds((n + h * num_n) * tn, tn)],
                                      w_buf.at[slot, h], sems.at[slot, h])
                for h in range(halves)]

    group = group_ref[v]
    run_start = (v == 0) | (group != group_ref[jnp.maximum(v - 1, 0)])

    @pl.when(v == 0)
    def _():
        slot_ref[0] = 0
        for cp in copies(group, 0):
            cp.start()

    @pl.when(run_start & (v > 0))
    def _():
        slot_ref[0] = 1 - slot_ref[0]

    slot = slot_ref[0]

    @pl.when(run_start)
    def _():
        for cp in copies(group, slot):
            cp.wait()
        nxt = next_ref[v]

        @pl.when(nxt >= 0)
        def _():
            for cp in copies(nxt, 1 - slot):
                cp.start()

    return [w_buf.at[slot, h] for h in range(halves)]
