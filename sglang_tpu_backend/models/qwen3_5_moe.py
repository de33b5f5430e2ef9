"""Qwen3.5-MoE text model in plain JAX: a pure forward over a ragged, paged batch.

Layers follow ``cfg.layer_types``: ``full_attention`` layers run gated GQA attention over a
paged KV cache, ``linear_attention`` layers run Gated DeltaNet with per-request conv and
recurrent state slots; every layer's MLP is a sparse MoE (top-k routed experts plus a
sigmoid-gated shared expert) unless the config marks it dense (Qwen3-Next only).

Dimension letters: T tokens in the step, R requests, L logits rows, H hidden, V vocab,
E experts, K top-k, I expert width, N q heads, G kv heads, D head dim.

Parameter pytree (``loader.load_params`` builds it): nested dicts of arrays; every linear
weight is [in, out] (HF's [out, in] transposed) so layers compute ``x @ w``, but for the
routed experts and the head, which keep the checkpoint's [out, in] (the matmul contracts their
last axis; the head is the largest single weight, and loads as stored, with no transpose).

    embed_tokens [V, H], norm [H], lm_head [V, H] (= embed_tokens when tied),
    layer_groups: tuple of ``cfg.layer_period`` dicts, position j holding layers j, j + p, ...
      with every leaf stacked over the groups ([num_groups, ...]; ``stack_layers`` builds it,
      ``layer_params`` slices one layer back out). Each layer's dict holds
      input_layernorm [H], post_attention_layernorm [H] (zero-centred, applied as 1 + w)
      self_attn (full_attention layers):
        q_proj [H, N*2*D] (per head [query(D) | gate(D)]), k_proj [H, G*D], v_proj [H, G*D],
        o_proj [N*D, H], q_norm [D], k_norm [D]
      linear_attn (linear_attention layers), C = 2*Hk*Dk + Hv*Dv in order [q | k | v]:
        in_proj_qkv [H, C], in_proj_z [H, Hv*Dv], in_proj_b [H, Hv], in_proj_a [H, Hv],
        conv1d [C, K], A_log f32[Hv], dt_bias f32[Hv], norm [Dv] (plain weight),
        out_proj [Hv*Dv, H]
      mlp (MoE): gate [H, E]; experts in the checkpoint's [out, in] layout {gate_up [E, 2I, H]
        (rows [gate | up]), down [E, H, I], and with FP8 experts kept: gate_up_scale
        f32[E, 2I/128, H/128], down_scale f32[E, H/128, I/128] (the 128x128 block scales as
        stored, multiply to dequantise)};
        with EPLB (``model_executor/expert_location.py``) the experts' E is P physical slots
        and expert_location {physical i32[E, C], copies i32[E], logical i32[P]} maps them;
        shared_expert {gate_up [H, 2Is], down [Is, H]}; shared_expert_gate [H, 1]
      mlp (dense, Qwen3-Next mlp_only layers): gate_up [H, 2I], down [I, H]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sglang_tpu_backend.config import FULL_ATTENTION, ModelConfig
from sglang_tpu_backend.kernels import gdn, gdn_verify, ragged_paged_attention as rpa
from sglang_tpu_backend.kernels.gdn_common import conv_state_rows
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch
from sglang_tpu_backend.models.layers import (
    apply_partial_rope,
    gated_rms_norm,
    rms_norm,
    rope_cos_sin,
    swiglu_mlp,
)
from sglang_tpu_backend.metrics.router_stats import NUM_STATS, ROUTED, router_stats, slot_counts
from sglang_tpu_backend.models.moe import ep_routed_experts, physical_ids, routed_experts
from sglang_tpu_backend.parallel.mesh import EPContext, TPContext

Params = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """Device state that persists across steps: one array per kind for all layers of that kind.

    Layouts are the kernels' own (dynamic indices in leading dims, see ``kernels/``):
      kv_pages:   [num_attention_layers, num_pages, 2*G, page_size, D]; K of kv head g at
                  index 2g, V at 2g + 1.
      conv_state: [num_gdn_layers, num_slots, rows, C]: rows 0..K-2 the last pre-conv inputs,
                  oldest first; rows = conv_state_rows(K) pads K-1 to a power of two.
      rec_state:  [num_gdn_layers, num_slots, Hv, Dk, Dv] recurrent state (fp32 or bf16).
      kv_scales:  f32[num_attention_layers, num_pages, 2*G, page_size], the scale of each
                  cached K/V row of an FP8 cache (``--kv-cache-dtype fp8_e4m3``, see
                  ``kernels/ragged_paged_attention/quant.py``); None otherwise.
    Attention layer ``a`` (the a-th full_attention layer) owns ``kv_pages[a]`` (and
    ``kv_scales[a]``); GDN layer ``l`` owns ``conv_state[l]`` and ``rec_state[l]``.
    """

    kv_pages: jax.Array
    conv_state: jax.Array
    rec_state: jax.Array
    kv_scales: jax.Array | None = None

    @property
    def num_pages(self) -> int:
        return self.kv_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.kv_pages.shape[3]


def init_cache(
    cfg: ModelConfig,
    *,
    num_pages: int,
    page_size: int,
    num_state_slots: int,
    kv_dtype=jnp.bfloat16,
    state_dtype=jnp.float32,
    conv_dtype=None,
) -> ModelCache:
    """Zeroed KV pages and GDN state slots. Every page and slot id is usable.

    An 8-bit float ``kv_dtype`` (FP8) makes a quantised cache: kv_scales of ones beside the
    pages, and the conv state (default ``kv_dtype``) in ``state_dtype`` instead."""
    quantized = rpa.is_quantized(kv_dtype)
    if conv_dtype is None:
        conv_dtype = state_dtype if quantized else kv_dtype
    n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
    kv_shape = (n_attn, num_pages, 2 * cfg.num_key_value_heads, page_size, cfg.head_dim)
    conv_shape = (n_lin, num_state_slots, conv_state_rows(cfg.linear_conv_kernel_dim),
                  cfg.linear_conv_dim)
    rec_shape = (n_lin, num_state_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                 cfg.linear_value_head_dim)
    return ModelCache(
        kv_pages=jnp.zeros(kv_shape, kv_dtype),
        conv_state=jnp.zeros(conv_shape, conv_dtype),
        rec_state=jnp.zeros(rec_shape, state_dtype),
        kv_scales=jnp.ones(rpa.scales_shape(kv_shape), jnp.float32) if quantized else None,
    )


# Parameters: per-layer dicts <-> groups stacked for the layer scan ---------------------------


def stack_layers(layers: list[Params], cfg: ModelConfig) -> tuple[Params, ...]:
    """Per-layer param dicts -> ``cfg.layer_period`` dicts whose leaves are stacked over groups.

    Position j of the result holds layers ``j, j + p, j + 2p, ...`` (p = layer_period), each
    leaf ``[num_groups, ...]``. Frees each layer's arrays as soon as they are stacked.
    """
    p = cfg.layer_period
    groups = []
    for j in range(p):
        same = [layers[i] for i in range(j, len(layers), p)]
        groups.append(jax.tree.map(lambda *xs: jnp.stack(xs), *same))
        for i in range(j, len(layers), p):
            layers[i] = None
    return tuple(groups)


def layer_params(params: Params, cfg: ModelConfig, layer: int) -> Params:
    """The param dict of one layer, sliced out of ``params["layer_groups"]``."""
    p = cfg.layer_period
    return jax.tree.map(lambda x: x[layer // p], params["layer_groups"][layer % p])


# Blocks -------------------------------------------------------------------------------------


def _project(x, w):
    """``x @ w`` whose output the caller splits into heads: the barrier keeps XLA from
    moving that reshape onto the weight, which under the layer scan made XLA:TPU copy each
    layer's slice of the stacked weight on every step."""
    return jax.lax.optimization_barrier(x @ w)


def attention_block(p: Params, x, kv_pages, kv_scales, layer, cos, sin, batch: ForwardBatch,
                    cfg, impl, batch_invariant: bool = False):
    """Gated GQA attention of attention layer ``layer``. x: [T, H] -> ([T, H], kv_pages,
    kv_scales); kv_scales None unless the cache is FP8 (then the new K/V go in unrounded and
    are quantised with their scales)."""
    T = x.shape[0]
    N, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_gate = _project(x, p["q_proj"]).reshape(T, N, 2 * D)  # per head [query | gate]
    q, gate = q_gate[..., :D], q_gate[..., D:]  # [T, N, D] each
    k = _project(x, p["k_proj"]).reshape(T, G, D)
    v = _project(x, p["v_proj"]).reshape(T, G, D)
    q = apply_partial_rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), cos, sin)
    k = apply_partial_rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), cos, sin)
    cast = (lambda a: a) if kv_scales is not None else (lambda a: a.astype(kv_pages.dtype))
    out = rpa.ragged_paged_attention(
        q,
        kv_pages,
        batch.kv_lens,
        batch.page_table,
        batch.cu_q_lens,
        batch.num_seqs,
        sm_scale=D**-0.5,
        new_k=cast(k),
        new_v=cast(v),
        layer=layer,
        impl=impl,
        batch_invariant=batch_invariant,
        kv_scales=kv_scales,
    )  # o: [T, N, D]
    o, kv_pages, kv_scales = out if kv_scales is not None else (*out, None)
    o = o.reshape(T, N * D) * jax.nn.sigmoid(gate.reshape(T, N * D))
    return o @ p["o_proj"], kv_pages, kv_scales


def gdn_block(p: Params, x, conv_state, rec_state, layer, batch: ForwardBatch, cfg, impl):
    """Gated DeltaNet of GDN layer ``layer``. x: [T, H] -> ([T, H], conv_state, rec_state,
    verify), verify None except in TARGET_VERIFY mode: then the slots are left as they are
    and verify = (windows [R, K-1+n, C], a [R, n, Hv], b [R, n, Hv]) (``kernels/gdn_verify.py``)."""
    T = x.shape[0]
    Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    mixed_qkv = x @ p["in_proj_qkv"]  # [T, C]
    z = _project(x, p["in_proj_z"]).reshape(T, Hv, Dv)
    b = x @ p["in_proj_b"]  # [T, Hv]
    a = x @ p["in_proj_a"]  # [T, Hv]
    if batch.mode.is_verify():
        o, *verify = gdn_verify.gated_delta_net_verify(
            mixed_qkv, a, b, p["conv1d"], p["A_log"], p["dt_bias"], conv_state, rec_state,
            batch.kv_lens, batch.state_slots, batch.num_seqs,
            num_k_heads=cfg.linear_num_key_heads, layer=layer, impl=impl)
        verify = tuple(verify)
    else:
        verify = None
        o, conv_state, rec_state = gdn.gated_delta_net(
            mixed_qkv,
            a,
            b,
            p["conv1d"],
            p["A_log"],
            p["dt_bias"],
            conv_state,
            rec_state,
            batch.cu_q_lens,
            batch.kv_lens,
            batch.state_slots,
            batch.num_seqs,
            num_k_heads=cfg.linear_num_key_heads,
            decode=batch.mode.is_decode(),
            layer=layer,
            impl=impl,
        )  # o: [T, Hv, Dv]
    o = gated_rms_norm(o.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps).reshape(T, Hv * Dv)
    return o @ p["out_proj"], conv_state, rec_state, verify


def route_tokens(router_logits, cfg: ModelConfig, num_valid=None, act_dtype=None):
    """Renormalised top-k routing with padding rows sent nowhere.

    Args:
      router_logits: [T, E] router scores.
      num_valid: i32[] real token rows (rows past it are the step's padding), or None (all
        rows real).
      act_dtype: dtype the weights are rounded through (default: the logits' dtype).
    Returns:
      (top_w f32[T, K] weights rounded through the activation dtype, top_i i32[T, K] global
      expert ids). Padding rows get id ``cfg.num_experts``, outside every rank's expert range
      (``route_metadata``, kernels/routing.py, drops it), and weight 0: no expert computes them and
      the group sizes count only real rows.
    """
    K = cfg.num_experts_per_tok
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [T, E]
    top_w, top_i = jax.lax.top_k(probs, K)  # [T, K]
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w.astype(act_dtype or router_logits.dtype).astype(jnp.float32)
    top_i = top_i.astype(jnp.int32)
    if num_valid is not None:
        real = (jnp.arange(router_logits.shape[0]) < num_valid)[:, None]  # bool[T, 1]
        top_i = jnp.where(real, top_i, cfg.num_experts)
        top_w = jnp.where(real, top_w, 0.0)
    return top_w, top_i


def moe_block(p: Params, x, cfg: ModelConfig, impl, ep: EPContext | None = None,
              experts: Params | None = None, group=None, tp: TPContext | None = None,
              num_valid=None, with_stats: bool = False):
    """Sparse MoE with renormalised top-k and a sigmoid-gated shared expert. x: [T, H].

    ``ep`` (inside ``shard_map`` only): experts are split over the DP/EP ranks, see
    ``models/moe.py``; the router and the shared expert run on this rank's tokens either way.
    ``tp`` (inside ``shard_map`` only): every device has all tokens and a share of the experts;
    each runs its own experts and one all-reduce sums them.
    ``experts``/``group``: the routed experts of every layer group stacked, read at ``group``
    by the kernels (the layer scan passes them whole); default ``p["experts"]`` (one layer).
    ``num_valid`` (i32[], real token rows): rows past it are padding and are routed to no
    expert (their routed output is 0; :func:`route_tokens`). ``with_stats``: also return the
    router's health summary f32[3] and the real rows per physical slot f32[P] (E without
    EPLB) (``metrics/router_stats.py``; needs ``num_valid``); ``with_stats == ROUTED`` adds
    the routed LOGICAL expert ids i32[T, K] (before EPLB's slot mapping). ``p["expert_location"]``
    (EPLB): routed ids go to physical slots (``models/moe.py``).
    """
    with jax.named_scope("routed_experts"):  # a name the compiled roofline attributes by
        router_logits = x @ p["gate"]  # [T, E]
        top_w, top_i = route_tokens(router_logits, cfg, num_valid, x.dtype)  # [T, K]
        location = p.get("expert_location")
        slot_i = top_i if location is None else physical_ids(top_i, location)  # [T, K]
        num_slots = cfg.num_experts if location is None else location["logical"].shape[0]
        if experts is None:
            experts, group = p["experts"], None
        if tp is not None:
            num_local = experts["gate_up"].shape[0 if group is None else 1]
            first = jax.lax.axis_index(tp.axes) * num_local
            routed = routed_experts(experts, x, slot_i, top_w, num_local, first, impl, group)
            routed = jax.lax.psum(routed, tp.axes)
        elif ep is None:
            routed = routed_experts(experts, x, slot_i, top_w, num_slots, 0, impl, group)
        else:
            routed = ep_routed_experts(experts, x, slot_i, top_w, impl, ep, group)  # [T, H]

    with jax.named_scope("shared_expert"):
        shared = p["shared_expert"]
        shared_out = swiglu_mlp(x, shared["gate_up"], shared["down"])  # [T, H]
        shared_out = jax.nn.sigmoid(x @ p["shared_expert_gate"]) * shared_out
    if not with_stats:
        return routed + shared_out
    stats = (router_stats(router_logits, top_i, num_valid),
             slot_counts(slot_i, num_valid, num_slots))
    if with_stats == ROUTED:  # + the LOGICAL top-k ids i32[T, K] (padding rows: num_experts)
        stats += (top_i,)
    return routed + shared_out, stats


def mlp_block(p: Params, x, cfg: ModelConfig, layer: int, impl, ep: EPContext | None = None,
              experts: Params | None = None, group=None, tp: TPContext | None = None,
              num_valid=None, with_stats: bool = False, num_slots: int = 0):
    """The layer's MLP; with ``with_stats`` also its router stats (f32[3], f32[num_slots]);
    a dense layer's are NaN and zeros. ``num_valid``: real token rows (padding past it is
    routed nowhere), see :func:`moe_block`."""
    if cfg.is_moe_layer(layer):
        return moe_block(p, x, cfg, impl, ep, experts, group, tp, num_valid, with_stats)
    out = swiglu_mlp(x, p["gate_up"], p["down"])
    if not with_stats:
        return out
    return out, (jnp.full((NUM_STATS,), jnp.nan, jnp.float32), jnp.zeros((num_slots,), jnp.float32))


def num_expert_slots(params: Params, cfg: ModelConfig) -> int:
    """P: physical expert slots per MoE layer (E without an expert location)."""
    for p in params["layer_groups"]:
        location = p.get("mlp", {}).get("expert_location")
        if location is not None:
            return location["logical"].shape[-1]
    return cfg.num_experts


def _split_experts(groups: tuple[Params, ...]) -> tuple[tuple[Params, ...], tuple]:
    """Each group position's params without its routed experts, and those experts (or None)."""
    scanned, experts = [], []
    for p in groups:
        mlp = p.get("mlp", {})
        experts.append(mlp.get("experts"))
        if "experts" in mlp:
            p = {**p, "mlp": {k: v for k, v in mlp.items() if k != "experts"}}
        scanned.append(p)
    return tuple(scanned), tuple(experts)


def forward_hidden(params: Params, cache: ModelCache, batch: ForwardBatch, cfg: ModelConfig, impl,
                   ep: EPContext | None = None, tp: TPContext | None = None,
                   with_stats: bool = False, batch_invariant: bool = False):
    """All decoder layers and the final norm. Returns (hidden [T, H], cache, stats, verify):
    stats with ``with_stats`` (else None) the router stats (health f32[num_layers, 3], real
    rows per physical expert slot f32[num_layers, P], summed over the EP ranks with ``ep``;
    ``metrics/router_stats.py``); verify, in TARGET_VERIFY mode only (else None), every GDN
    layer's (windows [Lyr, R, K-1+n, C], a [Lyr, R, n, Hv], b [Lyr, R, n, Hv]), see
    ``gdn_block``.

    The layers run as a ``lax.scan`` over ``num_hidden_layers / layer_period`` groups (the body
    is traced and compiled once, whatever the depth); group g's j-th attention layer is
    attention layer ``g * attn_per_group + j`` of the cache, likewise for GDN layers. The
    caches travel in the carry and the kernels update them in place. Routed expert weights do
    not go through the scan's slicing: the grouped matmuls read the stacked weights at g
    (an XLA slice of them would copy a layer's experts every step).
    With ``tp`` (tensor-parallel attention, ``parallel/tp_forward.py``) ``cfg`` holds this
    device's head counts and each token mixer's output is all-reduced over ``tp.axes``.
    """
    period = cfg.layer_period
    kinds = cfg.layer_types[:period]
    attn_per_group = sum(k == FULL_ATTENTION for k in kinds)
    lin_per_group = period - attn_per_group
    x = params["embed_tokens"][batch.input_ids]  # [T, H]
    cos, sin = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta)

    scanned, experts = _split_experts(params["layer_groups"])
    num_valid = batch.cu_q_lens[batch.num_seqs[0]]  # real token rows; the rest is padding
    num_slots = num_expert_slots(params, cfg)

    def group(carry, xs):
        x, kv_pages, kv_scales, conv_state, rec_state = carry
        group_params, g = xs
        i_attn = i_lin = 0
        stats, verify = [], []
        for j, (p, kind) in enumerate(zip(group_params, kinds)):
            h = rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps)
            if kind == FULL_ATTENTION:
                layer = g * attn_per_group + i_attn
                with jax.named_scope("attention"):
                    h, kv_pages, kv_scales = attention_block(
                        p["self_attn"], h, kv_pages, kv_scales, layer, cos, sin, batch, cfg,
                        impl, batch_invariant)
                i_attn += 1
            else:
                layer = g * lin_per_group + i_lin
                with jax.named_scope("gdn"):
                    h, conv_state, rec_state, ver = gdn_block(p["linear_attn"], h, conv_state,
                                                              rec_state, layer, batch, cfg, impl)
                verify.append(ver)
                i_lin += 1
            if tp is not None:
                h = jax.lax.psum(h, tp.axes)  # heads' partial sums of the output projection
            x = x + h
            h = rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps)
            out = mlp_block(p["mlp"], h, cfg, j, impl, ep, experts[j], g, tp, num_valid,
                            with_stats, num_slots)
            if with_stats:
                out, st = out
                stats.append(st)
            x = x + out
        verify = (tuple(jnp.stack(v) for v in zip(*verify)) if batch.mode.is_verify()
                  else None)  # each [lin_per_group, R, ...]
        stacked = _stack_layer_stats(stats) if with_stats else None
        return (x, kv_pages, kv_scales, conv_state, rec_state), (stacked, verify)

    num_groups = cfg.num_hidden_layers // period
    carry = (x, cache.kv_pages, cache.kv_scales, cache.conv_state, cache.rec_state)
    carry, (stats, verify) = jax.lax.scan(group, carry, (scanned, jnp.arange(num_groups)))
    x, kv_pages, kv_scales, conv_state, rec_state = carry
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    if with_stats:  # [groups, period, n] -> [layers, n] (layer g * period + j)
        health, counts = (s.reshape(cfg.num_hidden_layers, -1) for s in stats[:2])
        if ep is not None:  # every rank's rows: what each EP rank's slots receive
            counts = jax.lax.psum(counts, ep.axes)
        stats = (health, counts) + ((_routed_rows(stats[2]),) if len(stats) == 3 else ())
    if verify is not None:  # [groups, lin_per_group, ...] -> [Lyr, ...] (g * lin_per_group + i)
        verify = tuple(v.reshape(-1, *v.shape[2:]) for v in verify)
    return x, ModelCache(kv_pages, conv_state, rec_state, kv_scales), stats, verify


def _stack_layer_stats(stats: list[tuple]) -> tuple:
    """One scan group's per-layer router stats, stacked: (health [period, 3], counts
    [period, P]) and with ``ROUTED`` the MoE layers' ids [moe_per_group, T, K] (a MoE layer's
    stats have them as a third entry, a dense layer's do not)."""
    stacked = tuple(jnp.stack([st[i] for st in stats]) for i in range(2))
    routed = [st[2] for st in stats if len(st) == 3]
    return stacked + ((jnp.stack(routed),) if routed else ())


def _routed_rows(routed):
    """The scan's routed ids [groups, moe_per_group, T, K] -> [T, num_moe_layers, K]: MoE
    layer m = g * moe_per_group + i, the MoE layers in depth order."""
    G, M, T, K = routed.shape
    return jnp.transpose(routed.reshape(G * M, T, K), (1, 0, 2))


def forward(
    params: Params, cache: ModelCache, batch: ForwardBatch, cfg: ModelConfig, impl: str = "auto",
    ep: EPContext | None = None, tp: TPContext | None = None, with_stats: bool = False,
    batch_invariant: bool = False, with_hidden: bool = False,
) -> tuple[jax.Array, ModelCache]:
    """One model step over a ragged batch.

    Returns f32[L, V] logits for the rows ``batch.logits_indices`` and the updated cache.
    Jit with ``static_argnames=("cfg", "impl", "ep")`` and ``donate_argnames=("cache",)``.
    ``ep`` is set only by the data-parallel step (``parallel/dp_forward.py``), which runs this
    function per device under ``shard_map``; ``tp`` likewise by the tensor-parallel step
    (``parallel/tp_forward.py``). ``with_stats``: also return the router stats (health
    f32[num_layers, 3], rows per physical expert slot f32[num_layers, P]) as a third output;
    ``with_stats == ROUTED`` (``--enable-return-routed-experts``) adds to them each row's
    routed LOGICAL expert ids i32[T, num_moe_layers, K] (padding rows: ``num_experts``).
    ``with_hidden``: also return every row's hidden state [T, H] after the final norm as the
    last output (what the MTP drafter reads, ``model_executor/nextn_step.py``).
    ``batch_invariant``:
    a row's result does not depend on the rest of the batch (the XLA attention then reads
    every key from the pages; ``--enable-deterministic-inference``).
    """
    if batch.mode.is_verify():
        raise ValueError("a TARGET_VERIFY batch runs through model_executor.verify.forward_verify")
    hidden, cache, stats, _ = forward_hidden(params, cache, batch, cfg, impl, ep, tp, with_stats,
                                             batch_invariant)
    logits = compute_logits(params, hidden, batch)
    return (logits, cache) + ((stats,) if with_stats else ()) + ((hidden,) if with_hidden else ())


def compute_logits(params: Params, hidden, batch: ForwardBatch):
    """f32[L, V] logits of the rows ``batch.logits_indices`` of hidden [T, H]."""
    with jax.named_scope("lm_head"):
        h = hidden[batch.logits_indices]  # [L, H]
        return (h @ params["lm_head"].T).astype(jnp.float32)  # lm_head [V, H]


forward_jit = jax.jit(forward, static_argnames=("cfg", "impl", "ep", "tp", "with_stats",
                                               "batch_invariant", "with_hidden"),
                      donate_argnames=("cache",))
