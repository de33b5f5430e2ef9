"""The tensors a checkpoint must hold for a config: HF names, shapes, FP8 block scales.

``expected_shapes(cfg, prefix, entries)`` names every tensor the model needs (per-expert or
fused experts and FP8 scales as ``entries``, the checkpoint's index, has them);
``mtp_expected_shapes`` the MTP layers'; ``check_entries`` raises ``CheckpointError`` naming
what is missing or misshapen. Nothing here reads tensor data (``loader.py`` does).

Letters as in ``loader.py``: H hidden, V vocab, E experts, I expert width, C GDN conv width.
"""

from __future__ import annotations

from pathlib import Path

from sglang_tpu_backend.config import FULL_ATTENTION, ModelConfig
from sglang_tpu_backend.model_loader.checkpoint_io import FP8_BLOCK, CheckpointError, TensorEntry

F8_CODES = ("F8_E4M3", "F8_E5M2")  # safetensors dtype codes of FP8 tensors
Shape = tuple[int, ...]
MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _attn_shapes(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        f"{p}q_proj.weight": (hq * 2 * d, h),
        f"{p}k_proj.weight": (hkv * d, h),
        f"{p}v_proj.weight": (hkv * d, h),
        f"{p}o_proj.weight": (h, hq * d),
        f"{p}q_norm.weight": (d,),
        f"{p}k_norm.weight": (d,),
    }


def _gdn_shapes(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    h, hv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    c = cfg.linear_conv_dim
    shapes: dict[str, Shape] = {}
    if cfg.model_type == "qwen3_next":
        shapes[f"{p}in_proj_qkvz.weight"] = (c + hv * dv, h)
        shapes[f"{p}in_proj_ba.weight"] = (2 * hv, h)
    else:
        shapes[f"{p}in_proj_qkv.weight"] = (c, h)
        shapes[f"{p}in_proj_z.weight"] = (hv * dv, h)
        shapes[f"{p}in_proj_b.weight"] = (hv, h)
        shapes[f"{p}in_proj_a.weight"] = (hv, h)
    shapes.update({
        f"{p}conv1d.weight": (c, 1, cfg.linear_conv_kernel_dim),
        f"{p}A_log": (hv,),
        f"{p}dt_bias": (hv,),
        f"{p}norm.weight": (dv,),
        f"{p}out_proj.weight": (h, hv * dv),
    })
    return shapes


def _mlp_shapes(cfg: ModelConfig, moe: bool, p: str, fused: bool) -> dict[str, Shape]:
    h = cfg.hidden_size
    if not moe:
        i = cfg.intermediate_size
        return {f"{p}gate_proj.weight": (i, h), f"{p}up_proj.weight": (i, h), f"{p}down_proj.weight": (h, i)}
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes: dict[str, Shape] = {f"{p}gate.weight": (e, h)}
    if fused:
        shapes[f"{p}experts.gate_up_proj"] = (e, 2 * i, h)
        shapes[f"{p}experts.down_proj"] = (e, h, i)
    else:
        for x in range(e):
            shapes[f"{p}experts.{x}.gate_proj.weight"] = (i, h)
            shapes[f"{p}experts.{x}.up_proj.weight"] = (i, h)
            shapes[f"{p}experts.{x}.down_proj.weight"] = (h, i)
    if s:
        shapes.update({
            f"{p}shared_expert.gate_proj.weight": (s, h),
            f"{p}shared_expert.up_proj.weight": (s, h),
            f"{p}shared_expert.down_proj.weight": (h, s),
            f"{p}shared_expert_gate.weight": (1, h),
        })
    return shapes


def _layer_shapes(cfg: ModelConfig, kind: str, moe: bool, lp: str,
                  entries: dict[str, TensorEntry]) -> dict[str, Shape]:
    """One decoder layer's tensors under ``lp`` (``...layers.N.``)."""
    h = cfg.hidden_size
    shapes = {f"{lp}input_layernorm.weight": (h,), f"{lp}post_attention_layernorm.weight": (h,)}
    if kind == FULL_ATTENTION:
        shapes.update(_attn_shapes(cfg, f"{lp}self_attn."))
    else:
        shapes.update(_gdn_shapes(cfg, f"{lp}linear_attn."))
    fused = f"{lp}mlp.experts.gate_up_proj" in entries
    shapes.update(_mlp_shapes(cfg, moe, f"{lp}mlp.", fused))
    return shapes


def expected_shapes(cfg: ModelConfig, prefix: str, entries: dict[str, TensorEntry]) -> dict[str, Shape]:
    """Every HF tensor name the model needs (FP8 scales included) -> expected shape.
    ``entries`` (the checkpoint's index) decides fused vs per-expert experts and which
    weights are FP8; with ``{}`` it is the per-expert layout without FP8."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, Shape] = {f"{prefix}embed_tokens.weight": (v, h), f"{prefix}norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i, kind in enumerate(cfg.layer_types):
        shapes.update(_layer_shapes(cfg, kind, cfg.is_moe_layer(i), f"{prefix}layers.{i}.", entries))
    return _with_fp8_scales(shapes, entries)


def mtp_expected_shapes(cfg: ModelConfig, prefix: str, entries: dict[str, TensorEntry]
                        ) -> dict[str, Shape]:
    """The MTP tensors under ``prefix`` (``mtp.``) -> expected shape, like ``expected_shapes``:
    ``fc`` [H, 2H] (input columns [embedding | hidden]), three norms, and
    ``mtp_num_hidden_layers`` full-attention MoE decoder layers."""
    h = cfg.hidden_size
    shapes: dict[str, Shape] = {f"{prefix}fc.weight": (h, 2 * h)}
    shapes.update({f"{prefix}{n}.weight": (h,) for n in MTP_NORMS})
    for i in range(cfg.mtp_num_hidden_layers):
        shapes.update(_layer_shapes(cfg, FULL_ATTENTION, True, f"{prefix}layers.{i}.", entries))
    return _with_fp8_scales(shapes, entries)


def _with_fp8_scales(shapes: dict[str, Shape], entries: dict[str, TensorEntry]) -> dict[str, Shape]:
    """``shapes`` plus the ``*_scale_inv`` block scales of the entries stored as FP8."""
    for name, shape in list(shapes.items()):
        e = entries.get(name)
        if e is None or e.dtype not in F8_CODES:
            continue
        if not name.endswith(".weight") or len(shape) != 2:
            raise CheckpointError(f"tensor {name} is {e.dtype} but only 2-D '*.weight' tensors may be FP8")
        shapes[name + "_scale_inv"] = (cdiv(shape[0], FP8_BLOCK), cdiv(shape[1], FP8_BLOCK))
    return shapes


def check_entries(checkpoint_dir: Path, expected: dict[str, Shape], entries: dict[str, TensorEntry]) -> None:
    missing = [f"{n} (expected shape {list(s)})" for n, s in expected.items() if n not in entries]
    wrong = [
        f"{n} expected shape {list(s)}, got {list(entries[n].shape)}"
        for n, s in expected.items()
        if n in entries and tuple(entries[n].shape) != s
    ]

    def few(items: list[str]) -> str:
        more = f"; ... and {len(items) - 5} more" if len(items) > 5 else ""
        return "; ".join(items[:5]) + more

    if missing:
        raise CheckpointError(f"checkpoint {checkpoint_dir} lacks {len(missing)} tensor(s): {few(missing)}")
    if wrong:
        raise CheckpointError(f"checkpoint {checkpoint_dir} has {len(wrong)} tensor(s) of wrong shape: {few(wrong)}")
