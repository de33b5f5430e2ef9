"""The model step with tensor-parallel attention (SGLang's ``--tp-size``), for comparison with
the DP-attention step (``dp_forward.py``).

All ``tp`` devices of the mesh run every request of the batch. Each device holds a slice of
every token mixer's heads and computes them for all tokens; the layer's output projection
(rows split like the heads) gives a partial sum that one all-reduce completes:

  attention  q heads split (N/tp per device); kv heads split when G >= tp, else each device
             holds the ONE kv head its q heads read (kv heads replicated tp/G times: the KV
             cache of every request is then stored tp/G times over the devices, which is what
             caps concurrency compared with DP attention).
  GDN        value heads split (Hv/tp); key heads split when Hk >= tp, else replicated like kv
             heads; conv channels and states follow their heads.
  MoE        routed experts split over the devices (E/tp each) as in the DP step; every device
             routes all tokens, runs its own experts, one all-reduce sums them. Router, shared
             expert, norms, embeddings and lm_head are replicated.

So a device runs ``models.qwen3_5_moe.forward`` with a *local* config (its head counts) on its
weight shards, and the model all-reduces (``TPContext``) after each output projection and the
routed experts. Global layouts, tp devices, d = device index (``chip * dies + die``):
  q_proj [.., H, N*2D], in_proj_z/a/b, A_log, dt_bias: split on the head columns as stored.
  k_proj, v_proj [.., H, tp*g*D]: device d's g kv heads side by side (g = max(1, G/tp)).
  in_proj_qkv [.., H, tp*c], conv1d [.., tp*c, K]: device d's [q | k | v] channels (c local
             channels) side by side, so a contiguous split hands each device its own layout.
  o_proj, out_proj [.., N*D or Hv*Dv, H]: split on rows.
  kv_pages [La, pages, tp*2g, S, D], conv_state [Lg, slots, rows, tp*c],
  rec_state [Lg, slots, Hv, Dk, Dv]: split on the head / channel axis; pages and slots are
  shared by all devices (one pool, as with one device).
  batch and logits: replicated.

Speculative decoding: ``verify`` runs ``model_executor/verify.forward_verify`` on every device
over its heads; its ``VerifyStates`` (windows [Lyr, R, K-1+n, tp*c], a / b [Lyr, R, n, tp*hv])
are split on their last axis like conv_state's channels and rec_state's value heads, and
``commit`` runs ``verify.commit_accepted`` on each device's share of them, writing its heads
and channels of the shared slots (slot ids and accepted lengths replicated). NEXTN: ``forward_hidden`` / ``verify_hidden`` also
return the hidden states [T, H] (replicated), and ``mtp_drafts`` runs
``model_executor/nextn_step.mtp_drafts`` on every device: the MTP layer's weights laid out
and split by name like the main layers' (routed experts [E, ...] split on E), its KV pages
[n, pages, tp*2g, S, D] split on the head axis like the main pages.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor import verify
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch
from sglang_tpu_backend.model_executor.weight_layout import is_routed_expert
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.parallel.dp_forward import global_array, jit_programs, place_params
from sglang_tpu_backend.parallel.mesh import CHIP_AXIS, DIE_AXIS, TPContext, canonical_spec

REPLICATED = PartitionSpec()


def heads_of_device(num_heads: int, tp: int, d: int) -> list[int]:
    """The heads device ``d`` of ``tp`` holds: a contiguous num_heads/tp of them, or the one
    head its share of the q (value) heads reads when num_heads < tp."""
    if num_heads >= tp:
        per = num_heads // tp
        return list(range(d * per, (d + 1) * per))
    return [d // (tp // num_heads)]


def _check_divisible(cfg: ModelConfig, tp: int) -> None:
    pairs = {"num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": cfg.num_key_value_heads,
             "linear_num_key_heads": cfg.linear_num_key_heads,
             "linear_num_value_heads": cfg.linear_num_value_heads}
    for name, n in pairs.items():
        if n % tp and tp % n:
            raise ValueError(f"--tp-size {tp}: {name}={n} must divide it or be divisible by it")
    for name in ("num_attention_heads", "linear_num_value_heads"):
        if pairs[name] % tp:
            raise ValueError(f"--tp-size {tp} must divide {name}={pairs[name]}")
    if cfg.num_experts % tp:
        raise ValueError(f"--tp-size {tp} must divide num_experts {cfg.num_experts}")


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one device of ``tp`` runs: its head counts."""
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=len(heads_of_device(cfg.num_key_value_heads, tp, 0)),
        linear_num_key_heads=len(heads_of_device(cfg.linear_num_key_heads, tp, 0)),
        linear_num_value_heads=cfg.linear_num_value_heads // tp,
    )


def _columns(heads: list[int], width: int, offset: int = 0) -> list[int]:
    return [offset + h * width + i for h in heads for i in range(width)]


def kv_columns(cfg: ModelConfig, tp: int) -> np.ndarray:
    """Columns of k_proj / v_proj [H, G*D] that make the global [H, tp*g*D] layout."""
    G, D = cfg.num_key_value_heads, cfg.head_dim
    return np.array([c for d in range(tp) for c in _columns(heads_of_device(G, tp, d), D)])


def conv_channels(cfg: ModelConfig, tp: int) -> np.ndarray:
    """Channels of in_proj_qkv / conv1d ([q | k | v], C) that make the global [tp*c] layout."""
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    out = []
    for d in range(tp):
        keys = heads_of_device(Hk, tp, d)
        out += _columns(keys, Dk) + _columns(keys, Dk, Hk * Dk)
        out += _columns(heads_of_device(Hv, tp, d), Dv, 2 * Hk * Dk)
    return np.array(out)


# How each weight is laid out for TP (by its name in the param tree): the axis split over the
# devices, counted from the end, and the index map applied to that axis first (if any).
_SPLIT_LAST = {"q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
               "in_proj_a", "A_log", "dt_bias"}
_SPLIT_ROWS = {"o_proj", "out_proj", "conv1d"}


def _leaf_role(path) -> tuple[str | None, bool]:
    """(weight name, is a routed-expert leaf) from a param-tree path."""
    return getattr(path[-1], "key", None), is_routed_expert(path)


class TPForward:
    """``forward`` over a (chip, die) mesh of ``tp`` devices with tensor-parallel attention."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, *, impl: str = "auto",
                 with_stats: bool = False, batch_invariant: bool = False):
        """``with_stats``: the step also returns the router health f32[layers, 3].
        ``batch_invariant``: see ``qwen3_5_moe.forward``."""
        self.tp = mesh.size
        self.with_stats, self.batch_invariant = with_stats, batch_invariant
        _check_divisible(cfg, self.tp)
        self.cfg, self.mesh, self.impl = cfg, mesh, impl
        self.local_cfg = local_config(cfg, self.tp)
        self.ctx = TPContext(axes=(CHIP_AXIS, DIE_AXIS))
        self._kv_cols = kv_columns(cfg, self.tp)
        self._conv_ch = conv_channels(cfg, self.tp)
        jit_programs(self)

    # Layouts ----------------------------------------------------------------------------------
    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """``spec`` on this mesh, in the form step outputs have (``canonical_spec``)."""
        return NamedSharding(self.mesh, canonical_spec(self.mesh, spec))

    def _split(self, ndim: int, axis: int) -> PartitionSpec:
        """Split dim ``axis`` (Python indexing: negative counts from the end) over the devices."""
        dims: list[Any] = [None] * ndim
        dims[axis] = self.ctx.axes
        return PartitionSpec(*dims)

    def param_specs(self, params, expert_axis: int = 1) -> Any:
        """Each leaf's split by its name; routed experts split on E (``expert_axis``: 1 for
        the main layers' [groups, E, ...], 0 for the MTP layer's [E, ...])."""
        def spec(path, x):
            name, expert = _leaf_role(path)
            if expert:
                return self._split(x.ndim, expert_axis)
            if name in _SPLIT_LAST:
                return self._split(x.ndim, -1)
            if name in _SPLIT_ROWS:
                return self._split(x.ndim, -2)
            return REPLICATED
        return jax.tree_util.tree_map_with_path(spec, params)

    def tp_params(self, params) -> Any:
        """Reorder (and replicate) kv-head and GDN channel columns into the global TP layout.
        Works on host arrays, device arrays and under ``jax.eval_shape``."""
        def lay(path, x):
            name, expert = _leaf_role(path)
            if expert:
                return x
            if name in ("k_proj", "v_proj"):
                return x.take(self._kv_cols, axis=-1)
            if name == "in_proj_qkv":
                return x.take(self._conv_ch, axis=-1)
            if name == "conv1d":
                return x.take(self._conv_ch, axis=-2)
            return x
        return jax.tree_util.tree_map_with_path(lay, params)

    def cache_specs(self, kv_scales: bool = True) -> qwen3_5_moe.ModelCache:
        """Heads / channels split over the devices; ``kv_scales``: see ``DPForward``."""
        # kv_pages [Lyr, N, 2*Hkv, S, D], conv [Lyr, slots, K-1, C], rec [Lyr, slots, Hv, Dk, Dv],
        # kv_scales [Lyr, N, 2*Hkv, S]
        return qwen3_5_moe.ModelCache(kv_pages=self._split(5, 2), conv_state=self._split(4, -1),
                                      rec_state=self._split(5, 2),
                                      kv_scales=self._split(4, 2) if kv_scales else None)

    # One request's state in the one-device layout (handover) --------------------------------
    def _kv_slot_heads(self) -> np.ndarray:
        """The model's kv head in each kv-head slot of the global TP cache (i32[tp*g])."""
        G = self.cfg.num_key_value_heads
        return np.array([h for d in range(self.tp) for h in heads_of_device(G, self.tp, d)])

    def state_to_one_device(self, kv, conv, rec):
        """A request's state read from this TP cache (``state_transfer`` layouts, kv
        [La, n, tp*2g, S, D] device-major, conv [Lg, rows, tp*c]) -> the one-device layout
        (kv [La, n, 2G, S, D], conv [Lg, rows, C]): each replicated kv head and GDN key channel
        read once, everything in the model's order. rec (value heads split contiguously) is
        already in order."""
        first_slot = {h: i for i, h in reversed(list(enumerate(self._kv_slot_heads())))}
        kv_idx = [2 * first_slot[h] + t for h in range(self.cfg.num_key_value_heads) for t in (0, 1)]
        first_col = {c: j for j, c in reversed(list(enumerate(self._conv_ch)))}
        conv_idx = [first_col[c] for c in range(self.cfg.linear_conv_dim)]
        return kv[:, :, kv_idx], conv[..., conv_idx], rec

    def state_from_one_device(self, kv, conv, rec):
        """Inverse of :meth:`state_to_one_device` (replicated heads and channels copied)."""
        kv_idx = [2 * h + t for h in self._kv_slot_heads() for t in (0, 1)]
        return kv[:, :, kv_idx], conv[..., self._conv_ch], rec

    def shard_params(self, params):
        """Params in the TP layout, placed on the mesh (every process passes the full params)."""
        params = self.tp_params(params)
        return place_params(params, jax.tree.map(self.sharding, self.param_specs(params)))

    def init_cache(self, *, num_pages: int, page_size: int, num_state_slots: int,
                   kv_dtype, state_dtype) -> qwen3_5_moe.ModelCache:
        """Zeroed caches (one pool of pages and slots; heads split over the devices)."""
        glob = dataclasses.replace(
            self.cfg, num_key_value_heads=self.local_cfg.num_key_value_heads * self.tp,
            linear_num_key_heads=self.local_cfg.linear_num_key_heads * self.tp)
        make = functools.partial(qwen3_5_moe.init_cache, glob, num_pages=num_pages,
                                 page_size=page_size, num_state_slots=num_state_slots,
                                 kv_dtype=kv_dtype, state_dtype=state_dtype)
        shardings = jax.tree.map(self.sharding, self.cache_specs())
        return jax.jit(make, out_shardings=shardings)()

    def put_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """The batch, replicated on every device."""
        where = self.sharding(REPLICATED)
        fields = {n: global_array(getattr(batch, n), where)
                  for n in ForwardBatch.__dataclass_fields__ if n != "mode"}
        return ForwardBatch(**fields, mode=batch.mode)

    # Step -------------------------------------------------------------------------------------
    def _global_step(self, params, cache, batch, with_hidden: bool = False):
        local = functools.partial(qwen3_5_moe.forward, cfg=self.local_cfg, impl=self.impl,
                                  tp=self.ctx, with_stats=self.with_stats,
                                  batch_invariant=self.batch_invariant, with_hidden=with_hidden)
        out_specs = (REPLICATED, self.cache_specs()) + ((REPLICATED,) if self.with_stats else ())
        step = jax.shard_map(
            lambda p, c, b: local(p, c, b), mesh=self.mesh,
            in_specs=(self.param_specs(params), self.cache_specs(), _replicated(batch)),
            out_specs=out_specs + ((REPLICATED,) if with_hidden else ()), check_vma=False)
        return step(params, cache, batch)

    def __call__(self, params, cache, batch: ForwardBatch):
        """f32[L, V] logits (replicated) and the updated cache (donated) (+ router stats)."""
        return self._step(params, cache, batch)

    def forward_hidden(self, params, cache, batch: ForwardBatch):
        """``__call__``'s outputs, then every row's hidden state [T, H] (replicated; NEXTN)."""
        return self._step_hidden(params, cache, batch)

    # Speculative decoding ---------------------------------------------------------------------
    def _states_specs(self) -> verify.VerifyStates:
        """windows [Lyr, R, K-1+n, tp*c] and a / b [Lyr, R, n, tp*hv] split on the channel /
        value head axis like the GDN cache; fresh bool[R] replicated."""
        split = self._split(4, -1)
        return verify.VerifyStates(windows=split, a=split, b=split, fresh=REPLICATED)

    def _global_verify(self, params, cache, batch, with_hidden: bool = False):
        local = functools.partial(verify.forward_verify, cfg=self.local_cfg, impl=self.impl,
                                  batch_invariant=self.batch_invariant, tp=self.ctx,
                                  with_hidden=with_hidden)
        out_specs = (REPLICATED, self.cache_specs(), self._states_specs())
        step = jax.shard_map(
            lambda p, c, b: local(p, c, b), mesh=self.mesh,
            in_specs=(self.param_specs(params), self.cache_specs(), _replicated(batch)),
            out_specs=out_specs + ((REPLICATED,) if with_hidden else ()), check_vma=False)
        return step(params, cache, batch)

    def _global_commit(self, params, cache, states, slots, accepted_len):
        local = functools.partial(verify.commit_accepted, cfg=self.local_cfg, impl=self.impl)
        step = jax.shard_map(
            lambda p, c, s, sl, acc: local(p, c, s, sl, acc), mesh=self.mesh,
            in_specs=(self.param_specs(params), self.cache_specs(), self._states_specs(),
                      REPLICATED, REPLICATED),
            out_specs=self.cache_specs(), check_vma=False)
        return step(params, cache, states, slots, accepted_len)

    def verify(self, params, cache, batch: ForwardBatch):
        """A TARGET_VERIFY step: (logits f32[L, V] replicated, the cache (donated) with KV
        written, VerifyStates split like the GDN cache)."""
        return self._verify(params, cache, batch)

    def verify_hidden(self, params, cache, batch: ForwardBatch):
        """``verify``'s outputs, then every row's hidden state [T, H] (replicated; NEXTN)."""
        return self._verify_hidden(params, cache, batch)

    def commit(self, params, cache, states: verify.VerifyStates, slots, accepted_len):
        """Slots ``slots`` i32[R] := the state after ``accepted_len`` i32[R] positions, each
        device on its channels and value heads (cache donated)."""
        return self._commit(params, cache, states, slots, accepted_len)

    # NEXTN: the MTP layer ---------------------------------------------------------------------
    def shard_mtp_params(self, mtp_params):
        """The MTP params in the TP layout, placed on the mesh."""
        mtp_params = self.tp_params(mtp_params)
        specs = self.param_specs(mtp_params, expert_axis=0)
        return place_params(mtp_params, jax.tree.map(self.sharding, specs))

    def mtp_cache_spec(self) -> PartitionSpec:
        """The MTP KV pages [n, pages, tp*2g, S, D]: split on the head axis."""
        return self._split(5, 2)

    def init_mtp_cache(self, *, num_pages: int, page_size: int, kv_dtype) -> jax.Array:
        """Zeroed MTP KV pages (``mtp_cache_spec``), ``num_pages`` shared by all devices."""
        from sglang_tpu_backend.models.mtp import init_mtp_cache

        glob = dataclasses.replace(
            self.cfg, num_key_value_heads=self.local_cfg.num_key_value_heads * self.tp)
        make = functools.partial(init_mtp_cache, glob, num_pages=num_pages,
                                 page_size=page_size, kv_dtype=kv_dtype)
        return jax.jit(make, out_shardings=self.sharding(self.mtp_cache_spec()))()

    def _global_mtp(self, params, mtp_params, cache, batch, hidden, inp, sampled, accepted_len,
                    num_steps: int):
        from sglang_tpu_backend.model_executor.nextn_step import mtp_drafts

        local = functools.partial(mtp_drafts, cfg=self.local_cfg, impl=self.impl,
                                  num_steps=num_steps, tp=self.ctx)
        step = jax.shard_map(
            lambda *args: local(*args), mesh=self.mesh,
            in_specs=(self.param_specs(params), self.param_specs(mtp_params, expert_axis=0),
                      self.mtp_cache_spec(), _replicated(batch), REPLICATED, _replicated(inp),
                      REPLICATED, REPLICATED),
            out_specs=(REPLICATED, self.mtp_cache_spec()), check_vma=False)
        return step(params, mtp_params, cache, batch, hidden, inp, sampled, accepted_len)

    def mtp_drafts(self, params, mtp_params, cache, batch: ForwardBatch, hidden, inp, sampled,
                   accepted_len, num_steps: int):
        """``nextn_step.mtp_drafts`` on every device (cache donated): (drafts i32[R, k]
        replicated, cache). ``inp``: one ``MtpInputs`` (numpy); ``sampled`` [R] or [R, n],
        ``accepted_len`` [R]."""
        where = self.sharding(REPLICATED)
        inp = jax.tree.map(lambda x: global_array(x, where), inp)
        sampled, accepted_len = jax.device_put((sampled, accepted_len), where)
        return self._mtp(params, mtp_params, cache, batch, hidden, inp, sampled, accepted_len,
                         num_steps=num_steps)


def _replicated(tree) -> Any:
    """A REPLICATED spec for every leaf of ``tree`` (a batch, MTP inputs)."""
    return jax.tree.map(lambda _: REPLICATED, tree)
