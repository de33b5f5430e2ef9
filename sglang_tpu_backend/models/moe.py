"""Routed experts of a MoE layer: on one device, or expert-parallel across the DP ranks.

Dimension letters: T tokens of this device, D devices (DP = EP ranks), K top-k, E experts on
this device, H hidden, I expert width.

Expert-parallel flow (inside ``shard_map``; each device holds E = num_experts / D experts):
  1. all-gather the tokens' hidden states of every DP rank          x_all [D*T, H]
  2. all-gather top-k ids and weights in ONE collective              [D*T, K] each
  3. gather the rows routed to this device's experts, grouped matmuls (SwiGLU fused), weighted
     gather-reduce per token                                        y_all [D*T, H] (partial)
  4. hierarchical reduce-scatter: each rank gets the sum over devices of its own T rows.

With an expert location (EPLB, ``parallel/eplb.py``) the expert weights are stored per
physical slot (P = E + redundant slots, P/D per device) and :func:`physical_ids` maps each
routed (token, k) from its logical expert to one of that expert's copies before step 1; the
flow above then runs on slot ids, unchanged.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sglang_tpu_backend.kernels import collectives, gmm, routing
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
                   expected_rows: int | None = None):
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
    hidden = x.shape[1]
    split = routing.row_split(hidden, x.dtype) if hidden % 128 == 0 else None
    y = gmm.gmm(h, experts["down"], group_sizes, rhs_scale=experts.get("down_scale"),
                out_dtype=x.dtype, impl=impl, layer=layer, skip_tail=True, cost_rows=expected,
                row_split=split)  # [T*K, P, H/P]: each row one slab, as gather_reduce reads it
    return routing.gather_reduce(y, rows, top_w, cost_reads=expected, impl=impl)  # [T, H]


def ep_routed_experts(experts, x, top_i, top_w, impl, ep: EPContext, layer=None):
    """Expert-parallel :func:`routed_experts` of this rank's tokens x [T, H] -> [T, H]."""
    num_local = experts["gate_up"].shape[0 if layer is None else 1]
    ids_all, w_all = collectives.packed_all_gather(
        top_i.astype(jnp.int32), top_w.astype(jnp.float32), axis_name=ep.axes)  # [D*T, K]
    x_all = lax.all_gather(x, ep.axes, axis=0, tiled=True)  # [D*T, H]
    rank = lax.axis_index(ep.axes)
    y_all = routed_experts(experts, x_all, ids_all, w_all, num_local, rank * num_local, impl,
                           layer, expected_rows=top_i.size)  # balanced: T*K rows per device
    m = ep.num_microbatches if x.shape[0] % ep.num_microbatches == 0 else 1
    return collectives.hierarchical_reduce_scatter(
        y_all, chip_axis=ep.chip_axis, die_axis=ep.die_axis, num_microbatches=m, impl=impl)
