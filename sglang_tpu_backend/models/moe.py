"""Routed experts of a MoE layer: on one device, or expert-parallel across the DP ranks.

Dimension letters: T tokens of this device, D devices (DP = EP ranks), K top-k, E experts on
this device, H hidden, I expert width.

Expert-parallel flow (inside ``shard_map``; each device holds E = num_experts / D experts):
  1. all-gather the tokens' hidden states of every DP rank          x_all [D*T, H]
  2. all-gather top-k ids and weights in ONE collective              [D*T, K] each
  3. gather the rows routed to this device's experts, grouped matmuls (SwiGLU fused), weighted
     gather-reduce per token                                        y_all [D*T, H] (partial)
  4. hierarchical reduce-scatter: each rank gets the sum over devices of its own T rows.

With ``ep.overlap_combine`` steps 3-4 run in M = ``ep.num_microbatches`` micro-batches of
this rank's EXPERTS: the E local experts cut into M contiguous groups of E/M. The reduce-scatter
is linear, so the sum over groups of each group's reduce-scatter equals the reduce-scatter of
the full partial sums. Group m's grouped matmuls see only its own experts' weights (a view of
the local weights as [L*M, E/M, ...]), so each expert weight is still read once per layer; the
extra traffic is M partial [D*T, H] outputs and M reduce-scatters. Group m's reduce-scatter
(``kernels/collectives_async.py``: start, ici_start, done) is started right after its expert
outputs; its ici_start runs between group m + 1's gate_up and down matmuls and its done after
them, so its die-to-die transfer overlaps group m + 1's gate_up matmul and its ICI transfer
group m + 1's down matmul and weighted gather-reduce.

With an expert location (EPLB, ``parallel/eplb.py``) the expert weights are stored per
physical slot (P = E + redundant slots, P/D per device) and :func:`physical_ids` maps each
routed (token, k) from its logical expert to one of that expert's copies before step 1; the
flow above then runs on slot ids, unchanged.
"""

from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
from jax import lax

from sglang_tpu_backend.kernels import collectives, collectives_async, gmm, routing
from sglang_tpu_backend.parallel.mesh import EPContext


def physical_ids(top_i, location):
    """Logical top-k ids i32[T, K] -> physical slot ids i32[T, K].

    location: {"physical" i32[E, C] (expert e's slots in its first copies[e] entries),
    "copies" i32[E], "logical" i32[P]} of this layer. Assignment (t, k) of expert e takes
    copy (t + k) mod copies[e]: deterministic, and spreads an expert's rows over its copies.
    Ids outside [0, E) (the padding rows' id E) become P, outside every device's slot range.
    """
    T, K = top_i.shape
    table, copies = location["physical"], location["copies"]
    num_experts, num_slots = table.shape[0], location["logical"].shape[0]
    valid = (top_i >= 0) & (top_i < num_experts)
    e = jnp.where(valid, top_i, 0)
    pick = (jnp.arange(T, dtype=jnp.int32)[:, None] + jnp.arange(K, dtype=jnp.int32)) % copies[e]
    return jnp.where(valid, table[e, pick], num_slots).astype(jnp.int32)


def routed_experts(experts, x, top_i, top_w, num_experts: int, expert_offset, impl, layer=None,
                   expected_rows: int | None = None, between=None):
    """Sum over each token's top-k experts held here: [T, H] (zero for experts elsewhere).

    experts: {gate_up [E, 2I, H] (rows [gate | up]), down [E, H, I] (+ FP8 block scales
    [E, 2I/128, H/128], [E, H/128, I/128]): the checkpoint's [out, in] layout}, or with ``layer`` the
    weights of every layer group stacked ([groups, E, ...]) and read at ``layer`` inside the
    kernels; top_i i32[T, K] global expert ids; top_w f32[T, K]; expert ``expert_offset + e``
    is local expert e. Ids outside the local range (other ranks' experts, and the id
    ``cfg.num_experts`` that the MoE block gives padding rows) are computed by no local expert
    and add nothing, so the group sizes may sum to fewer than T*K rows.

    Only the local rows move: they sort first, and the kernels skip the rows after them (not
    gathered, not multiplied, not written: ``skip_tail``). ``expected_rows`` is how many of
    the T*K assignments are expected here (default all; T*K/D for D expert-parallel devices
    under balanced routing); it sizes the kernels' static cost estimates, nothing else.
    ``between``: called with the SwiGLU output h [T*K, I] between the two grouped matmuls,
    returns the h the down projection reads (the overlapped combine schedules a kernel there).
    """
    token_idx, group_sizes, rows = routing.route_metadata(
        top_i.astype(jnp.int32), num_experts, expert_offset=expert_offset)
    num_local = jnp.sum(group_sizes)  # local rows, sorted first
    expected = top_i.size if expected_rows is None else expected_rows
    xs = routing.gather_rows(x, token_idx, num_rows=num_local, cost_rows=expected,
                             impl=impl)  # [T*K, H] sorted by expert, local rows first
    h = gmm.gmm_swiglu(xs, experts["gate_up"], group_sizes, rhs_scale=experts.get("gate_up_scale"),
                       out_dtype=x.dtype, impl=impl, layer=layer, skip_tail=True,
                       cost_rows=expected)  # [T*K, I]
    if between is not None:
        h = between(h)
    hidden = x.shape[1]
    split = routing.row_split(hidden, x.dtype) if hidden % 128 == 0 else None
    y = gmm.gmm(h, experts["down"], group_sizes, rhs_scale=experts.get("down_scale"),
                out_dtype=x.dtype, impl=impl, layer=layer, skip_tail=True, cost_rows=expected,
                row_split=split)  # [T*K, P, H/P]: each row one slab, as gather_reduce reads it
    return routing.gather_reduce(y, rows, top_w, cost_reads=expected, impl=impl)  # [T, H]


def ep_routed_experts(experts, x, top_i, top_w, impl, ep: EPContext, layer=None):
    """Expert-parallel :func:`routed_experts` of this rank's tokens x [T, H] -> [T, H]."""
    num_local = experts["gate_up"].shape[0 if layer is None else 1]
    m = ep.num_microbatches
    if (ep.overlap_combine and ep.overlap_split == "tokens" and m > 1
            and x.shape[0] % m == 0):
        return _token_split_routed_experts(experts, x, top_i, top_w, num_local, impl, ep, layer)
    ids_all, w_all = collectives.packed_all_gather(
        top_i.astype(jnp.int32), top_w.astype(jnp.float32), axis_name=ep.axes)  # [D*T, K]
    x_all = lax.all_gather(x, ep.axes, axis=0, tiled=True)  # [D*T, H]
    rank = lax.axis_index(ep.axes)
    if (ep.overlap_combine and ep.overlap_split == "experts" and m > 1
            and num_local % m == 0):
        return _overlapped_routed_experts(experts, x_all, ids_all, w_all, num_local,
                                          rank * num_local, impl, ep, layer, top_i.size // m)
    y_all = routed_experts(experts, x_all, ids_all, w_all, num_local, rank * num_local, impl,
                           layer, expected_rows=top_i.size)  # balanced: T*K rows per device
    m = m if x.shape[0] % m == 0 else 1
    return collectives.hierarchical_reduce_scatter(
        y_all, chip_axis=ep.chip_axis, die_axis=ep.die_axis, num_microbatches=m, impl=impl)


def _expert_group_view(experts, layer, num_groups: int):
    """The local expert weights viewed as ``num_groups`` groups of E/M experts per layer.

    Every array of ``experts`` ([E, ...], or [L, E, ...] with ``layer``) is reshaped to
    [L*M, E/M, ...]: only leading dimensions merge, so XLA keeps it a view (no copy). Returns
    the view and a function m -> the index of group m of ``layer`` in it; a grouped matmul
    given the view and that index reads, and its cost estimate charges, group m's weights only.
    """
    def view(a):
        lead = 1 if layer is None else 2  # dims up to and including E
        return a.reshape(-1, a.shape[lead - 1] // num_groups, *a.shape[lead:])

    base = 0 if layer is None else layer * num_groups
    return {name: view(a) for name, a in experts.items()}, lambda m: base + m


def _overlapped_routed_experts(experts, x_all, ids_all, w_all, num_local, expert_offset,
                               impl, ep: EPContext, layer, expected_rows: int):
    """Steps 3-4 in M expert groups, each group's reduce-scatter in flight during the next
    group's expert matmuls: x_all [D*T, H], ids_all / w_all [D*T, K] -> this rank's [T, H].

    Group m holds local experts [m*E/M, (m+1)*E/M); its weighted gather-reduce gives the
    partial sums [D*T, H] of only its (token, k) assignments. ``expected_rows`` (T*K/M under
    balanced routing) sizes each group's kernel cost estimates.

    The optimization barriers pin the schedule XLA would otherwise pick freely, per group m:
    start(m - 1) -> gate_up(m) -> ici_start(m - 1) -> down(m) -> done(m - 1) -> start(m):
    group m - 1's die-to-die phase is in flight while group m's gate_up matmul runs, its ICI
    phase while group m's down matmul and gather-reduce run. The groups' results are summed in
    group order."""
    num_mb = ep.num_microbatches
    group = num_local // num_mb
    weights, group_layer = _expert_group_view(experts, layer, num_mb)

    def group_experts(m, inputs, between):  # [D*T, H] partial sums of group m
        return routed_experts(weights, *inputs, group, expert_offset + m * group, impl,
                              group_layer(m), expected_rows=expected_rows, between=between)

    outs = _pipelined_reduce_scatters(num_mb, lambda m: (x_all, ids_all, w_all), group_experts,
                                      dict(chip_axis=ep.chip_axis, die_axis=ep.die_axis, impl=impl))
    return functools.reduce(operator.add, outs)  # [T, H], summed in group order


def _token_split_routed_experts(experts, x, top_i, top_w, num_local, impl, ep: EPContext,
                                layer):
    """Steps 1-4 in M token micro-batches of this rank's rows, each chunk's reduce-scatter in
    flight during the next chunk's expert matmuls: x [T, H], top_i / top_w [T, K] -> [T, H].

    Chunk m is rows [m*T/M, (m+1)*T/M) of every rank: its all-gathers give x_c [D*T/M, H] (and
    its ids / weights), its routed experts the partial sums [D*T/M, H] of those rows, and its
    reduce-scatter this rank's rows of the chunk [T/M, H], the synchronous path's result for
    them (the same terms summed in the same order per row; only the kernel's block size
    differs). The chunks' outputs are concatenated in order. Every chunk reads the local
    expert weights (M reads per layer); the reduce-scatter moves one step's bytes in M parts.

    The optimization barriers pin, per chunk m > 0, the schedule
    start(m - 1) -> gate_up(m) -> ici_start(m - 1) -> down(m) -> done(m - 1) -> start(m), as
    in :func:`_overlapped_routed_experts`. The chunks' all-gathers are not pinned: XLA may
    issue them early."""
    num_mb = ep.num_microbatches
    chunk = x.shape[0] // num_mb
    offset = lax.axis_index(ep.axes) * num_local

    def chunk_inputs(m):  # x_c [D*T/M, H], ids / weights [D*T/M, K] of chunk m
        rows = slice(m * chunk, (m + 1) * chunk)
        ids_all, w_all = collectives.packed_all_gather(
            top_i[rows].astype(jnp.int32), top_w[rows].astype(jnp.float32), axis_name=ep.axes)
        return lax.all_gather(x[rows], ep.axes, axis=0, tiled=True), ids_all, w_all

    def chunk_experts(m, inputs, between):  # [D*T/M, H] partial sums of chunk m
        return routed_experts(experts, *inputs, num_local, offset, impl, layer,
                              expected_rows=chunk * top_i.shape[1], between=between)

    outs = _pipelined_reduce_scatters(num_mb, chunk_inputs, chunk_experts,
                                      dict(chip_axis=ep.chip_axis, die_axis=ep.die_axis, impl=impl))
    return jnp.concatenate(outs, axis=0)  # [T, H]


def _pipelined_reduce_scatters(num_mb: int, inputs_of, experts_of, axes: dict) -> list:
    """The overlapped combine's pipeline over ``num_mb`` micro-batches: ``inputs_of(m)`` gives
    micro-batch m's expert inputs, ``experts_of(m, inputs, between)`` its partial sums
    [rows, H] (``between``: the hook :func:`routed_experts` runs between its two matmuls); each
    is reduce-scattered by the async kernels. Optimization barriers pin, per m > 0,
    start(m - 1) -> gate_up(m) -> ici_start(m - 1) -> down(m) -> done(m - 1) -> start(m).
    Returns each micro-batch's reduce-scattered rows [rows / D, H], in order."""
    outs, future = [], None
    for m in range(num_mb):
        inputs, ici, between = inputs_of(m), [None], None
        if future is not None:
            future, inputs = lax.optimization_barrier((future, inputs))
            between = _ici_start_between(future, ici, axes)
        y = experts_of(m, inputs, between)
        if ici[0] is not None:
            pending, y = lax.optimization_barrier((ici[0], y))
            outs.append(collectives_async.reduce_scatter_done(pending, **axes))
        future = collectives_async.reduce_scatter_start(y, **axes)
    outs.append(collectives_async.reduce_scatter_done(future, **axes))  # ici_start + done
    return outs


def _ici_start_between(started, out: list, axes: dict):
    """The ``between`` hook of :func:`routed_experts` that runs the ici_start kernel of the
    started reduce-scatter ``started`` after the gate_up matmul and before the down matmul;
    stores its future in ``out[0]``."""
    def between(h):
        fut, h = lax.optimization_barrier((started, h))  # after gate_up
        out[0], h = lax.optimization_barrier(
            (collectives_async.reduce_scatter_ici_start(fut, **axes), h))
        return h  # the down matmul reads h after ici_start
    return between
