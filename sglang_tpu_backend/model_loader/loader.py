"""Safetensors checkpoint -> parameter pytree (layout in ``models/qwen3_5_moe.py``).

Reads HF Qwen3.5-MoE (``model.language_model.`` / ``model.`` prefixes) and Qwen3-Next
checkpoints, fused or per-expert expert layouts, bf16/fp32/FP8-block-scaled weights. Every
expected tensor's name and shape is checked from the file headers before any data is read;
then tensors stream one at a time: read, dequantise, transpose to [in, out] (all but the
routed experts and the head, which keep the checkpoint's [out, in]), cast, place.
``load_params`` skips the multi-token-prediction layers under ``mtp.*``; ``load_mtp_params``
reads them, with the same checks and dtype/FP8 handling (layout in ``models/mtp.py``).

Letters: H hidden, V vocab, E experts, I expert width, Is shared-expert width, Hq/Hkv attention
heads of size D, Hk/Hv GDN key/value heads of sizes Dk/Dv, C = 2*Hk*Dk + Hv*Dv, K conv kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from sglang_tpu_backend.config import FULL_ATTENTION, ModelConfig, load_model_config
from sglang_tpu_backend.model_loader.checkpoint_io import (
    FP8_BLOCK,
    CheckpointError,
    TensorEntry,
    index_checkpoint,
    prefetch,
    read_into,
    read_rows,
    read_tensor,
)
from sglang_tpu_backend.model_loader.checkpoint_shapes import (
    F8_CODES,
    MTP_NORMS,
    Shape,
    cdiv,
    check_entries,
    expected_shapes,
    mtp_expected_shapes,
)
from sglang_tpu_backend.models.qwen3_5_moe import stack_layers

__all__ = ["CheckpointError", "CheckpointLeaves", "Leaf", "expected_shapes", "load_model",
           "load_mtp_params", "load_params"]

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("visual.", "model.visual.", "mtp.", "model.mtp.")  # by load_params
MTP_PREFIXES = ("mtp.", "model.mtp.")
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


# Reading and converting ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Leaf:
    """How one param leaf of one layer (or of the top level) is built from the checkpoint.

    ``read()`` returns the whole leaf as numpy, in the param layout, or with its last two axes
    swapped when ``swapped`` (HF's [out, in] for a param's [in, out]: the transpose is left to
    the device, where it is cheap). A routed-expert leaf (``experts`` True, param shape
    ``[E, ...]``) takes ``read(lo, hi)`` and reads only experts ``lo:hi`` from the files; a
    ``rows`` leaf (a large 2-D one) takes ``read(lo, hi)`` for rows ``lo:hi`` of what ``read()``
    returns. Nothing is read before ``read`` is called.

    ``fill(out, *args)`` puts what ``read(*args)`` returns into ``out`` (C-contiguous, that
    shape and dtype): straight from the files when the leaf has an ``into`` of that signature
    (a tensor stored in the param dtype, FP8 experts kept), else by a copy of ``read``'s array.
    """

    read: Callable[..., np.ndarray]
    experts: bool = False
    swapped: bool = False
    rows: bool = False
    into: Callable[..., None] | None = None

    def fill(self, out: np.ndarray, *args) -> None:
        if self.into is not None:
            self.into(out, *args)
        else:
            np.copyto(out, self.read(*args))


class _Reader:
    """Reads named tensors, dequantises FP8 pairs and casts to the param dtype (numpy)."""

    def __init__(self, entries: dict[str, TensorEntry], dtype: Any):
        self.entries = entries
        self.np_dtype = np.dtype(dtype)

    def raw(self, name: str) -> np.ndarray:
        return read_tensor(self.entries[name])

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        return read_rows(self.entries[name], lo, hi)

    def direct(self, name: str) -> bool:
        """Whether ``name`` is stored as its param is (not FP8, the param dtype): read as is."""
        return not self.is_fp8(name) and self.entries[name].np_dtype == self.np_dtype

    def rows_into(self, name: str, out: np.ndarray, lo: int, hi: int) -> None:
        """``out[...] = cast(rows(name, lo, hi))``, read straight into ``out`` when direct."""
        if self.direct(name):
            read_rows(self.entries[name], lo, hi, out)
        else:
            out[...] = self.rows(name, lo, hi)

    def raw_into(self, name: str, out: np.ndarray) -> None:
        """``out[...] = raw(name)``, read straight into ``out`` when it has the stored dtype."""
        e = self.entries[name]
        if out.flags.c_contiguous and out.dtype == e.np_dtype and out.shape == e.shape:
            read_into(e, out)
        else:
            out[...] = self.raw(name)

    def is_fp8(self, name: str) -> bool:
        return self.entries[name].dtype in F8_CODES

    def hf(self, name: str) -> np.ndarray:
        """HF-layout tensor, dequantised (to f32) when it is FP8 block-scaled."""
        t = self.raw(name)
        if self.is_fp8(name):
            t = dequantize_blocks(t, self.raw(name + "_scale_inv"))
        return t

    def cast(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=self.np_dtype)

    def vec(self, name: str) -> np.ndarray:
        return self.cast(self.raw(name))

    def f32(self, name: str) -> np.ndarray:
        return self.raw(name).astype(np.float32)

    def linear(self, name: str) -> np.ndarray:
        """HF [out, in] weight (the param [in, out] swapped)."""
        return self.cast(self.hf(name))

    def linear_into(self, out: np.ndarray, name: str) -> None:
        """``out[...] = linear(name)``, read straight into ``out`` when direct."""
        if self.direct(name) and out.flags.c_contiguous:
            read_into(self.entries[name], out)
        else:
            out[...] = self.hf(name)

    def gate_up(self, gate: str, up: str) -> np.ndarray:
        """Two HF [I, H] weights -> [2I, H], rows [gate | up] (the param [H, 2I] swapped)."""
        return self.cast(np.concatenate([self.hf(gate), self.hf(up)], axis=0))

    def gate_up_into(self, out: np.ndarray, gate: str, up: str) -> None:
        """``out[...] = gate_up(gate, up)``, each half read straight into its rows when direct."""
        i = self.entries[gate].shape[0]
        self.linear_into(out[:i], gate)
        self.linear_into(out[i:], up)


def dequantize_blocks(q: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """f32 ``q * scale_inv`` with each scale covering a FP8_BLOCK x FP8_BLOCK tile of the last 2 dims."""
    rows, cols = q.shape[-2:]
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, -2), FP8_BLOCK, -1)
    return q.astype(np.float32) * s[..., :rows, :cols]


def _leaf(fn: Callable, *args) -> Leaf:
    return Leaf(functools.partial(fn, *args))


def _swapped(fn: Callable, *args) -> Leaf:
    """A leaf ``fn(*args)`` returns with its last two axes swapped."""
    return Leaf(functools.partial(fn, *args), swapped=True)


def _linear(r: "_Reader", name: str) -> Leaf:
    """HF [out, in] weight ``name``, the param [in, out] swapped; fills read straight in."""
    return Leaf(functools.partial(r.linear, name), swapped=True,
                into=lambda out: r.linear_into(out, name))


def _gate_up(r: "_Reader", gate: str, up: str) -> Leaf:
    """HF gate and up weights as [2I, H], the param [H, 2I] swapped."""
    return Leaf(functools.partial(r.gate_up, gate, up), swapped=True,
                into=lambda out: r.gate_up_into(out, gate, up))


def _attn_leaves(r: _Reader, p: str) -> dict:
    return {**{k: _linear(r, f"{p}{k}.weight") for k in ("q_proj", "k_proj", "v_proj", "o_proj")},
            "q_norm": _leaf(r.vec, f"{p}q_norm.weight"), "k_norm": _leaf(r.vec, f"{p}k_norm.weight")}


def split_qkvz_ba(cfg: ModelConfig, qkvz: np.ndarray, ba: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3-Next fused projections (HF [out, H], interleaved per key-head group) ->
    HF-layout ``in_proj_qkv`` ([q|k|v] rows), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.

    qkvz rows are Hk groups of [q(Dk) | k(Dk) | v(r*Dv) | z(r*Dv)] with r = Hv / Hk; ba rows
    are Hk groups of [b(r) | a(r)]. Value head j of group g is head g*r + j.
    """
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    r = hv // hk
    h = qkvz.shape[-1]
    g = qkvz.reshape(hk, 2 * dk + 2 * r * dv, h)
    q, k = g[:, :dk], g[:, dk : 2 * dk]
    v, z = g[:, 2 * dk : 2 * dk + r * dv], g[:, 2 * dk + r * dv :]
    gba = ba.reshape(hk, 2 * r, h)
    return {
        "in_proj_qkv": np.concatenate([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]),
        "in_proj_z": z.reshape(hv * dv, h),
        "in_proj_b": gba[:, :r].reshape(hv, h),
        "in_proj_a": gba[:, r:].reshape(hv, h),
    }


def _gdn_leaves(r: _Reader, cfg: ModelConfig, p: str) -> dict:
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    if cfg.model_type == "qwen3_next":
        def part(key: str) -> np.ndarray:  # both fused tensors are re-read for each part
            parts = split_qkvz_ba(cfg, r.hf(f"{p}in_proj_qkvz.weight"), r.hf(f"{p}in_proj_ba.weight"))
            return r.cast(parts[key])

        proj = {k: _swapped(part, k) for k in names}
    else:
        proj = {k: _linear(r, f"{p}{k}.weight") for k in names}
    return {
        **proj,
        "conv1d": Leaf(lambda: r.cast(r.raw(f"{p}conv1d.weight")[:, 0, :])),
        "A_log": _leaf(r.f32, f"{p}A_log"),
        "dt_bias": _leaf(r.f32, f"{p}dt_bias"),
        "norm": _leaf(r.vec, f"{p}norm.weight"),
        "out_proj": _linear(r, f"{p}out_proj.weight"),
    }


def _expert_leaves(r: _Reader, cfg: ModelConfig, p: str, keep_fp8: bool) -> dict:
    """Routed experts -> gate_up [E, 2I, H] (rows [gate | up]), down [E, H, I] (+ block
    scales when kept FP8), each readable for a range of experts: the checkpoint's [out, in]
    layout, which is the param layout (nothing to transpose)."""
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if f"{p}gate_up_proj" in r.entries:  # fused [E, 2I, H] / [E, H, I]: rows lo:hi
        fused = lambda name, lo, hi: r.cast(r.rows(f"{p}{name}", lo, hi))  # noqa: E731
        return {k: Leaf(functools.partial(fused, name), experts=True,
                        into=lambda out, lo, hi, name=name: r.rows_into(f"{p}{name}", out, lo, hi))
                for k, name in (("gate_up", "gate_up_proj"), ("down", "down_proj"))}
    names = [(f"{p}{x}.gate_proj.weight", f"{p}{x}.up_proj.weight", f"{p}{x}.down_proj.weight") for x in range(e)]
    fp8 = r.is_fp8(names[0][0])
    if keep_fp8 and fp8 and i % FP8_BLOCK == 0:
        return _fp8_expert_leaves(r, cfg, names)
    if keep_fp8 and not fp8:
        log.info("keep_fp8_experts: experts in %s are not FP8; loading them as %s", p, r.np_dtype)
    elif keep_fp8 and fp8:
        log.info("keep_fp8_experts: expert width %d is not a multiple of %d; dequantising %s", i, FP8_BLOCK, p)

    def gate_up_into(out: np.ndarray, lo: int, hi: int) -> None:  # [e, 2I, H], expert by expert
        for x in range(lo, hi):
            r.gate_up_into(out[x - lo], names[x][0], names[x][1])

    def down_into(out: np.ndarray, lo: int, hi: int) -> None:  # [e, H, I]
        for x in range(lo, hi):
            r.linear_into(out[x - lo], names[x][2])

    def leaf(into: Callable, shape: Shape) -> Leaf:
        def read(lo: int, hi: int) -> np.ndarray:
            out = np.empty((hi - lo, *shape), r.np_dtype)
            into(out, lo, hi)
            return out
        return Leaf(read, experts=True, into=into)

    return {"gate_up": leaf(gate_up_into, (2 * i, h)), "down": leaf(down_into, (h, i))}


def _fp8_expert_leaves(r: _Reader, cfg: ModelConfig, names: list[tuple[str, str, str]]) -> dict:
    """FP8 experts kept as stored, weights and block scales each read straight into their
    expert's slot: gate_up fp8[E, 2I, H], down fp8[E, H, I], gate_up_scale f32[E, 2I/128,
    H/128], down_scale f32[E, H/128, I/128]."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    bh, bi = cdiv(h, FP8_BLOCK), i // FP8_BLOCK

    def stacked(shape: Shape, dtype, fill: Callable[[np.ndarray, int], None]) -> Leaf:
        def into(out: np.ndarray, lo: int, hi: int) -> None:
            for x in range(lo, hi):
                fill(out[x - lo], x)

        def read(lo: int, hi: int) -> np.ndarray:
            out = np.empty((hi - lo, *shape), dtype)
            into(out, lo, hi)
            return out
        return Leaf(read, experts=True, into=into)

    def gate_up(dst: np.ndarray, x: int) -> None:
        r.raw_into(names[x][0], dst[:i])
        r.raw_into(names[x][1], dst[i:])

    def gate_up_scale(dst: np.ndarray, x: int) -> None:
        r.raw_into(names[x][0] + "_scale_inv", dst[:bi])
        r.raw_into(names[x][1] + "_scale_inv", dst[bi:])

    def down(dst: np.ndarray, x: int) -> None:
        r.raw_into(names[x][2], dst)

    def down_scale(dst: np.ndarray, x: int) -> None:
        r.raw_into(names[x][2] + "_scale_inv", dst)

    return {
        "gate_up": stacked((2 * i, h), _FP8, gate_up),
        "down": stacked((h, i), _FP8, down),
        "gate_up_scale": stacked((2 * bi, bh), np.float32, gate_up_scale),
        "down_scale": stacked((bh, bi), np.float32, down_scale),
    }


def _mlp_leaves(r: _Reader, cfg: ModelConfig, moe: bool, p: str, keep_fp8: bool) -> dict:
    if not moe:
        return {"gate_up": _gate_up(r, f"{p}gate_proj.weight", f"{p}up_proj.weight"),
                "down": _linear(r, f"{p}down_proj.weight")}
    mlp = {"gate": _linear(r, f"{p}gate.weight"), "experts": _expert_leaves(r, cfg, f"{p}experts.", keep_fp8)}
    if cfg.shared_expert_intermediate_size:
        s = f"{p}shared_expert."
        mlp["shared_expert"] = {"gate_up": _gate_up(r, f"{s}gate_proj.weight", f"{s}up_proj.weight"),
                                "down": _linear(r, f"{s}down_proj.weight")}
        mlp["shared_expert_gate"] = _linear(r, f"{p}shared_expert_gate.weight")
    return mlp


def _detect_prefix(entries: dict[str, TensorEntry]) -> str:
    if any(n.startswith("model.language_model.") for n in entries):
        return "model.language_model."
    return "model."


def _report_leftovers(entries: dict[str, TensorEntry], used: set[str], cfg: ModelConfig) -> None:
    left = [n for n in entries if n not in used]
    skipped = [n for n in left if n.startswith(SKIPPED_PREFIXES)]
    if skipped:
        log.info("skipped %d vision/MTP tensors (visual.*, mtp.*)", len(skipped))
    unknown = [n for n in left if not n.startswith(SKIPPED_PREFIXES)
               and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if unknown:
        more = f", ... ({len(unknown)} in all)" if len(unknown) > 5 else ""
        log.warning("ignored %d unexpected checkpoint tensors: %s%s", len(unknown), ", ".join(unknown[:5]), more)


class CheckpointLeaves:
    """A checkpoint directory, indexed and checked, as lazily read param leaves.

    ``top()`` holds ``embed_tokens``, ``norm`` and ``lm_head``; ``layer(i)`` layer ``i``'s param
    dict (layout in ``models/qwen3_5_moe.py``), every leaf a :class:`Leaf`. Building them
    reads nothing; every tensor's name and shape was checked against the headers first.
    """

    def __init__(self, checkpoint_dir: str | Path, cfg: ModelConfig, *, dtype: Any,
                 keep_fp8_experts: bool):
        self.dir, self.cfg, self.keep_fp8 = Path(checkpoint_dir), cfg, keep_fp8_experts
        self.entries = index_checkpoint(self.dir)
        self.prefix = _detect_prefix(self.entries)
        self.expected = expected_shapes(cfg, self.prefix, self.entries)
        check_entries(self.dir, self.expected, self.entries)
        _report_leftovers(self.entries, set(self.expected), cfg)
        self.reader = _Reader(self.entries, dtype)
        self.layer_names: dict[int, list[str]] = {}
        for name in self.expected:
            m = re.match(rf"{re.escape(self.prefix)}layers\.(\d+)\.", name)
            self.layer_names.setdefault(int(m.group(1)) if m else -1, []).append(name)

    @classmethod
    def from_reader(cls, reader: "_Reader", cfg: ModelConfig, prefix: str, *, label: str,
                    keep_fp8_experts: bool) -> "CheckpointLeaves":
        """Leaves over ``reader`` (its ``entries`` index every tensor the leaves read; a
        ``_Reader`` subclass may serve them from memory: ``tensor_update.py``), without a
        directory or checks; ``label`` names the source in messages."""
        self = cls.__new__(cls)
        self.dir, self.cfg, self.keep_fp8 = Path(label), cfg, keep_fp8_experts
        self.entries, self.prefix, self.reader = reader.entries, prefix, reader
        self.expected, self.layer_names = {}, {}
        return self

    def prefetch(self, layer: int, experts: list[tuple[int, int]]) -> None:
        """Start reading ``layer``'s tensors (-1: the top-level ones) into the page cache in
        the background, of the routed experts only those in the ranges ``experts``."""
        for name in self.layer_names.get(layer, []):
            e, m = self.entries[name], re.search(r"\.mlp\.experts\.(\d+)\.", name)
            if m:
                if any(lo <= int(m.group(1)) < hi for lo, hi in experts):
                    prefetch(e)
            elif ".mlp.experts." in name:  # fused: rows are experts
                for lo, hi in experts:
                    prefetch(e, lo, hi)
            else:
                prefetch(e)

    def _row_leaf(self, name: str, swapped: bool) -> Leaf:
        """A 2-D tensor read whole or by rows (cast only); FP8 ones whole (dequantised)."""
        r = self.reader
        if r.is_fp8(name):
            return Leaf(functools.partial(r.linear, name), swapped=swapped)

        def read(lo: int = 0, hi: int | None = None) -> np.ndarray:
            return r.cast(r.rows(name, lo, self.entries[name].shape[0] if hi is None else hi))

        def into(out: np.ndarray, lo: int = 0, hi: int | None = None) -> None:
            r.rows_into(name, out, lo, self.entries[name].shape[0] if hi is None else hi)

        return Leaf(read, swapped=swapped, rows=True, into=into)

    def top(self) -> dict:
        """``embed_tokens`` [V, H], ``norm``, ``lm_head`` [V, H] (both as stored)."""
        embed = f"{self.prefix}embed_tokens.weight"
        head = embed if self.cfg.tie_word_embeddings else "lm_head.weight"
        return {"embed_tokens": self._row_leaf(embed, False),
                "norm": _leaf(self.reader.vec, f"{self.prefix}norm.weight"),
                "lm_head": self._row_leaf(head, False)}

    def layer(self, i: int) -> dict:
        return self._layer(self.cfg.layer_types[i], self.cfg.is_moe_layer(i),
                           f"{self.prefix}layers.{i}.")

    def _layer(self, kind: str, moe: bool, lp: str) -> dict:
        r = self.reader
        layer = {"input_layernorm": _leaf(r.vec, f"{lp}input_layernorm.weight"),
                 "post_attention_layernorm": _leaf(r.vec, f"{lp}post_attention_layernorm.weight")}
        if kind == FULL_ATTENTION:
            layer["self_attn"] = _attn_leaves(r, f"{lp}self_attn.")
        else:
            layer["linear_attn"] = _gdn_leaves(r, self.cfg, f"{lp}linear_attn.")
        layer["mlp"] = _mlp_leaves(r, self.cfg, moe, f"{lp}mlp.", self.keep_fp8)
        return layer

    def mtp(self) -> dict | None:
        """The MTP params' leaves (layout in ``models/mtp.py``), or None when the config lists
        no MTP layer or the checkpoint has no ``mtp.*`` tensors. Checks the MTP tensors'
        names and shapes first (CheckpointError)."""
        prefix = next((p for p in MTP_PREFIXES if f"{p}fc.weight" in self.entries), None)
        if not self.cfg.mtp_num_hidden_layers or prefix is None:
            if self.cfg.mtp_num_hidden_layers:
                log.info("config lists %d MTP layer(s) but %s has no mtp.* tensors",
                         self.cfg.mtp_num_hidden_layers, self.dir)
            return None
        check_entries(self.dir, mtp_expected_shapes(self.cfg, prefix, self.entries), self.entries)
        r = self.reader
        return {"fc": _linear(r, f"{prefix}fc.weight"),
                **{n: _leaf(r.vec, f"{prefix}{n}.weight") for n in MTP_NORMS},
                "layers": tuple(self._layer(FULL_ATTENTION, True, f"{prefix}layers.{i}.")
                                for i in range(self.cfg.mtp_num_hidden_layers))}


def resolve_keep_fp8(keep_fp8_experts: bool, backend: str | None) -> bool:
    """FP8 experts are kept only for TPU backends (``None``: ``jax.default_backend()``)."""
    backend = backend or jax.default_backend()
    if keep_fp8_experts and backend != "tpu":
        log.info("keep_fp8_experts: backend %s has no FP8 expert kernels; dequantising FP8 "
                 "experts once at load", backend)
        return False
    return keep_fp8_experts


def read_whole(leaf: Leaf, num_experts: int) -> jax.Array:
    """The whole leaf (every expert of a routed-expert leaf) on the default device."""
    x = jnp.asarray(leaf.read(0, num_experts) if leaf.experts else leaf.read())
    return jnp.swapaxes(x, -1, -2) if leaf.swapped else x


def load_params(
    checkpoint_dir: str | Path,
    cfg: ModelConfig,
    *,
    dtype: Any = jnp.bfloat16,
    keep_fp8_experts: bool = False,
    progress: bool | None = None,
    backend: str | None = None,
) -> dict:
    """Load a safetensors checkpoint into the params pytree (layout in ``models/qwen3_5_moe.py``)
    on the default device. ``sharded_loader.load_sharded`` reads it shard by shard instead.

    Args:
      checkpoint_dir: directory with ``*.safetensors`` (and optionally the index json).
      cfg: the model's config (``load_model_config(checkpoint_dir)``).
      dtype: dtype of every parameter except ``A_log``/``dt_bias`` (f32) and kept FP8 experts.
      keep_fp8_experts: keep FP8 routed experts as float8_e4m3fn plus block scales for the
        TPU kernels (needs ``moe_intermediate_size % 128 == 0``; otherwise they are
        dequantised, with a log line). Off-TPU it is ignored (log line): the experts are
        dequantised here, once, instead of on every grouped matmul of every step.
      progress: show a tqdm bar (None: only on a terminal).
      backend: the JAX backend the params are for (None: ``jax.default_backend()``); FP8
        experts are kept only for ``"tpu"``.

    Off-TPU the dequantised experts are ``fp8 * scale`` in f32, exactly the weights the FP8
    grouped-matmul reference computes with, then cast to ``dtype``: identical for f32, one
    bf16 rounding (relative error <= 2^-9 per weight) for bf16.

    Raises:
      CheckpointError: pickle-only directory, missing tensors or wrong shapes (named by HF name).
    """
    leaves = CheckpointLeaves(checkpoint_dir, cfg, dtype=dtype,
                              keep_fp8_experts=resolve_keep_fp8(keep_fp8_experts, backend))
    read = lambda tree: jax.tree.map(lambda leaf: read_whole(leaf, cfg.num_experts), tree)  # noqa: E731
    disable = None if progress is None else not progress
    layers = [read(leaves.layer(i)) for i in tqdm(range(cfg.num_hidden_layers), desc="loading weights",
                                                  unit="layer", disable=disable)]
    return {**read(leaves.top()), "layer_groups": stack_layers(layers, cfg)}


def load_mtp_params(checkpoint_dir: str | Path, cfg: ModelConfig, *, dtype: Any = jnp.bfloat16,
                    keep_fp8_experts: bool = False, backend: str | None = None) -> dict | None:
    """The checkpoint's MTP params (layout in ``models/mtp.py``) on the default device, or
    None when it has none (``CheckpointLeaves.mtp``). Arguments as for :func:`load_params`,
    whose params (the embedding and LM head the MTP layers share) are loaded separately."""
    leaves = CheckpointLeaves(checkpoint_dir, cfg, dtype=dtype,
                              keep_fp8_experts=resolve_keep_fp8(keep_fp8_experts, backend))
    tree = leaves.mtp()
    return None if tree is None else jax.tree.map(lambda leaf: read_whole(leaf, cfg.num_experts), tree)


def load_model(
    checkpoint_dir: str | Path,
    *,
    dtype: Any = jnp.bfloat16,
    keep_fp8_experts: bool = False,
    progress: bool | None = None,
    backend: str | None = None,
) -> tuple[ModelConfig, dict]:
    """``(load_model_config(dir), load_params(dir, cfg, ...))``; raises ConfigError/CheckpointError."""
    cfg = load_model_config(checkpoint_dir)
    return cfg, load_params(checkpoint_dir, cfg, dtype=dtype, keep_fp8_experts=keep_fp8_experts,
                            progress=progress, backend=backend)
