"""Model configuration read from a checkpoint's ``config.json``.

Supported ``model_type`` values: ``qwen3_5_moe`` (text fields nested under ``text_config``),
``qwen3_5_moe_text`` (flat) and ``qwen3_next`` (flat; fused ``in_proj_qkvz``/``in_proj_ba``
projections and optional dense-MLP layers). Anything else is rejected by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class ConfigError(ValueError):
    """A checkpoint's config.json cannot describe a model we serve."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Text-model hyper-parameters. Sizes are element counts, not bytes."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # FULL_ATTENTION or LINEAR_ATTENTION per layer
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Gated attention (full_attention layers).
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet (linear_attention layers).
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # Mixture of experts.
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    # Layers with a dense SwiGLU MLP instead of MoE (qwen3_next only; empty for Qwen3.5).
    dense_mlp_layers: tuple[int, ...] = ()
    intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # Multi-token-prediction layers shipped under ``mtp.*`` (0: none; ``models/mtp.py``).
    mtp_num_hidden_layers: int = 0

    # Derived sizes -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that get RoPE (rotate-half pairs (i, i+d/2))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN causal conv: [q | k | v]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_mlp_layers

    @property
    def layer_period(self) -> int:
        """Smallest p dividing the depth such that layers i and i + p are of the same kind
        (token mixer and MLP). The model runs ``num_hidden_layers / p`` groups of p layers in a
        ``lax.scan`` (Qwen3.5: p = 4, three GDN layers then one attention layer); a pattern
        that never repeats gives p = num_hidden_layers, one group.
        """
        n = self.num_hidden_layers
        kind = [(t, self.is_moe_layer(i)) for i, t in enumerate(self.layer_types)]
        for p in range(1, n + 1):
            if n % p == 0 and all(kind[i] == kind[i % p] for i in range(n)):
                return p
        return n


def _text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(raw.get("architectures") or []) or "unknown"
        raise ConfigError(
            f"unsupported model_type {model_type!r} (architectures: {arch}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "qwen3_5_moe":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json: model_type 'qwen3_5_moe' needs a 'text_config' object")
        return {**text, "model_type": model_type}
    return raw


def _rope(fields: dict[str, Any]) -> tuple[float, float]:
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    theta = rope.get("rope_theta", fields.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", fields.get("partial_rotary_factor", 0.25))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"config.json: rope_type {rope_type!r} is not supported (only default)")
    return float(theta), float(factor)


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (nested or flat)."""
    f = _text_fields(raw)
    required = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size",
    )
    missing = [k for k in required if k not in f]
    if missing:
        raise ConfigError(f"config.json ({f['model_type']}) lacks fields: {', '.join(missing)}")
    n_layers = int(f["num_hidden_layers"])
    layer_types = f.get("layer_types")
    if layer_types is None:
        interval = int(f.get("full_attention_interval", 4))
        layer_types = [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)
        ]
    if len(layer_types) != n_layers or any(
        t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in layer_types
    ):
        raise ConfigError(
            f"config.json: layer_types must list {n_layers} entries of "
            f"'{FULL_ATTENTION}'/'{LINEAR_ATTENTION}', got {layer_types}"
        )
    dense: tuple[int, ...] = ()
    if f["model_type"] == "qwen3_next":
        step = int(f.get("decoder_sparse_step", 1))
        only = set(f.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step != 0)
    theta, factor = _rope(f)
    eos = f.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    hidden, n_heads = int(f["hidden_size"]), int(f["num_attention_heads"])
    return ModelConfig(
        model_type=f["model_type"],
        vocab_size=int(f["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=tuple(layer_types),
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        max_position_embeddings=int(f.get("max_position_embeddings", 32768)),
        num_attention_heads=n_heads,
        num_key_value_heads=int(f["num_key_value_heads"]),
        head_dim=int(f.get("head_dim") or hidden // n_heads),
        rope_theta=theta,
        partial_rotary_factor=factor,
        linear_num_key_heads=int(f["linear_num_key_heads"]),
        linear_num_value_heads=int(f["linear_num_value_heads"]),
        linear_key_head_dim=int(f["linear_key_head_dim"]),
        linear_value_head_dim=int(f["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(f.get("linear_conv_kernel_dim", 4)),
        num_experts=int(f["num_experts"]),
        num_experts_per_tok=int(f["num_experts_per_tok"]),
        moe_intermediate_size=int(f["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(f.get("shared_expert_intermediate_size", 0)),
        norm_topk_prob=bool(f.get("norm_topk_prob", True)),
        dense_mlp_layers=dense,
        intermediate_size=int(f.get("intermediate_size", 0)),
        eos_token_ids=eos_ids,
        mtp_num_hidden_layers=int(f.get("mtp_num_hidden_layers") or 0),
    )


def load_model_config(checkpoint_dir: str | Path) -> ModelConfig:
    """Read ``<checkpoint_dir>/config.json``; raises ConfigError naming what is wrong."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in checkpoint directory {checkpoint_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None
    return model_config_from_dict(raw)


# Serving dtype ---------------------------------------------------------------------------
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}  # served
DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16",
               "float32": "float32", "float": "float32"}


def config_dtype(raw: dict[str, Any]) -> str | None:
    """The dtype a config.json states for the text model (``text_config`` first, then the top
    level; ``dtype`` before the older ``torch_dtype``), normalised, or None when it states none
    we know."""
    for d in (raw.get("text_config") or {}, raw):
        for key in ("dtype", "torch_dtype"):
            name = d.get(key)
            if isinstance(name, str):
                return DTYPE_NAMES.get(name.removeprefix("torch.").lower())
    return None


def resolve_dtype(dtype: str, checkpoint_dir: str | Path) -> str:
    """``--dtype`` -> the dtype served. ``"auto"``: the dtype the checkpoint's config states,
    bfloat16 when it states none. Unlike SGLang on GPUs (which serves a float32 checkpoint in
    float16), a float32 checkpoint is served in float32: TPUs have no fast float16 path, and a
    user who wants the downcast passes ``--dtype bfloat16``. Any other value is returned as
    given."""
    if dtype != "auto":
        return dtype
    raw = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    return config_dtype(raw) or "bfloat16"


def cache_storage_dtype(dtype, backend: str):
    """The dtype to keep the KV pages and conv states in, for a model computing in ``dtype``
    on ``backend`` (``jax.default_backend()``).

    On XLA:CPU a 16-bit float cache is stored as f32: XLA:CPU has no bf16 / f16 scatter or
    dynamic-update-slice, so it converts the whole cache to f32 and back for every write into
    it (``benchmarks/bench_cache_dtype.py`` measures the cost). The values stored are the
    step's own, no longer rounded to ``dtype`` on the way in, so logits move within bf16 noise
    and get no less accurate (``tests/model/test_cache_storage.py``); the pools take twice
    the bytes. Elsewhere (TPU) the cache keeps ``dtype``. Every process of a replica (the
    engine and multi-host followers) must use this one rule.
    """
    if backend == "cpu" and jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating):
        return jnp.float32
    return dtype
