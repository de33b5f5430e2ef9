"""The embedded default model: a tiny random Qwen3.5-MoE generated on first use.

The repo ships only the tokenizer and ``config.json`` (``assets/tiny-qwen3.5-moe/``); the
weights come from a seeded numpy generator and are written once into a cache directory
(``$STB_CACHE_DIR`` or ``~/.cache/sglang_tpu_backend/``) as an HF-style bf16 checkpoint
(prefix ``model.language_model.``, fused expert layout) with one MTP layer under ``mtp.*``
(each tensor drawn from its own name's stream, so the main tensors do not depend on it).
``random_checkpoint_tensors`` also builds random checkpoints of any other config for tests
(qwen3_next included).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from sglang_tpu_backend.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, model_config_from_dict
from sglang_tpu_backend.model_loader.checkpoint_io import (
    atomic_replace_dir, copy_tokenizer_files, write_safetensors)

ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen3.5-moe"
GENERATOR_VERSION = 2  # bump whenever random_checkpoint_tensors changes its output
SEED = 0
WEIGHT_STD = 0.02  # linear layers and embeddings
ROUTER_STD = 0.1  # wider so top-k routing is decisive (few ties in bf16)
NORM_STD = 0.05  # zero-centred (1 + w) RMSNorm weights
CONV_STD = 0.3  # depthwise conv taps (fan-in is only the kernel width)


def tiny_config_dict(vocab_size: int, eos_token_id: int, pad_token_id: int = 0) -> dict:
    """HF ``qwen3_5_moe`` config.json of the embedded model (text fields under text_config)."""
    layers = 8
    text = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": layers,
        "layer_types": [FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(layers)],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 32768,
        "initializer_range": WEIGHT_STD,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "bfloat16",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "mtp_num_hidden_layers": 1,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "transformers_version": "5.23.0",
    }


# Random weights --------------------------------------------------------------------------
def _rng(seed: int, name: str) -> np.random.Generator:
    """An independent stream per tensor name, so each tensor depends only on (seed, name)."""
    digest = hashlib.sha256(name.encode()).digest()
    return np.random.Generator(np.random.PCG64([seed, int.from_bytes(digest[:8], "little")]))


def _hf_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, init kind) for a fused-expert checkpoint of ``cfg``: the main model,
    then the ``mtp.*`` layers when the config lists any."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out = {f"{prefix}embed_tokens.weight": ((v, h), "w"), f"{prefix}norm.weight": ((h,), "norm")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((v, h), "w")
    for n, kind in enumerate(cfg.layer_types):
        out.update(_hf_layer_shapes(cfg, f"{prefix}layers.{n}.", kind, cfg.is_moe_layer(n)))
    if cfg.mtp_num_hidden_layers:
        out["mtp.fc.weight"] = ((h, 2 * h), "w")
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{name}.weight"] = ((h,), "norm")
        for n in range(cfg.mtp_num_hidden_layers):
            out.update(_hf_layer_shapes(cfg, f"mtp.layers.{n}.", FULL_ATTENTION, True))
    return out


def _hf_layer_shapes(cfg: ModelConfig, p: str, kind: str, moe: bool
                     ) -> dict[str, tuple[tuple[int, ...], str]]:
    """One decoder layer's tensors under ``p`` (``...layers.N.``)."""
    h, e = cfg.hidden_size, cfg.num_experts
    i, s = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    hv, dv, c = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_dim
    out = {p + "input_layernorm.weight": ((h,), "norm"),
           p + "post_attention_layernorm.weight": ((h,), "norm")}
    if kind == FULL_ATTENTION:
        a = p + "self_attn."
        out.update({a + "q_proj.weight": ((hq * 2 * d, h), "w"), a + "k_proj.weight": ((hkv * d, h), "w"),
                    a + "v_proj.weight": ((hkv * d, h), "w"), a + "o_proj.weight": ((h, hq * d), "w"),
                    a + "q_norm.weight": ((d,), "norm"), a + "k_norm.weight": ((d,), "norm")})
    else:
        g = p + "linear_attn."
        if cfg.model_type == "qwen3_next":
            out[g + "in_proj_qkvz.weight"] = ((c + hv * dv, h), "w")
            out[g + "in_proj_ba.weight"] = ((2 * hv, h), "w")
        else:
            out.update({g + "in_proj_qkv.weight": ((c, h), "w"), g + "in_proj_z.weight": ((hv * dv, h), "w"),
                        g + "in_proj_b.weight": ((hv, h), "w"), g + "in_proj_a.weight": ((hv, h), "w")})
        out.update({g + "conv1d.weight": ((c, 1, cfg.linear_conv_kernel_dim), "conv"),
                    g + "A_log": ((hv,), "A_log"), g + "dt_bias": ((hv,), "dt_bias"),
                    g + "norm.weight": ((dv,), "gated_norm"), g + "out_proj.weight": ((h, hv * dv), "w")})
    m = p + "mlp."
    if not moe:
        di = cfg.intermediate_size
        out.update({m + "gate_proj.weight": ((di, h), "w"), m + "up_proj.weight": ((di, h), "w"),
                    m + "down_proj.weight": ((h, di), "w")})
        return out
    out.update({m + "gate.weight": ((e, h), "router"), m + "experts.gate_up_proj": ((e, 2 * i, h), "w"),
                m + "experts.down_proj": ((e, h, i), "w")})
    if s:
        out.update({m + "shared_expert.gate_proj.weight": ((s, h), "w"),
                    m + "shared_expert.up_proj.weight": ((s, h), "w"),
                    m + "shared_expert.down_proj.weight": ((h, s), "w"),
                    m + "shared_expert_gate.weight": ((1, h), "w")})
    return out


def _init(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if kind == "A_log":  # A in [1, 16)
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if kind == "dt_bias":  # softplus(dt_bias) = dt in [1e-3, 1e-1)
        return np.log(np.expm1(rng.uniform(1e-3, 1e-1, shape))).astype(np.float32)
    std = {"w": WEIGHT_STD, "router": ROUTER_STD, "norm": NORM_STD, "gated_norm": NORM_STD, "conv": CONV_STD}[kind]
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return x + np.float32(1.0) if kind == "gated_norm" else x


def random_checkpoint_tensors(
    cfg: ModelConfig,
    *,
    seed: int = SEED,
    prefix: str = "model.language_model.",
    dtype=ml_dtypes.bfloat16,
    num_real_tokens: int | None = None,
) -> dict[str, np.ndarray]:
    """Random HF-named tensors (fused experts) for ``cfg``; A_log/dt_bias f32, rest ``dtype``.

    ``num_real_tokens``: the tokenizer's size; embedding and lm_head rows of the padding ids
    above it are zero, so their logits are exactly 0 and greedy decoding rarely picks them.
    """
    out = {}
    for name, (shape, kind) in _hf_shapes(cfg, prefix).items():
        x = _init(_rng(seed, name), shape, kind)
        if num_real_tokens is not None and name in (f"{prefix}embed_tokens.weight", "lm_head.weight"):
            x[num_real_tokens:] = 0.0
        out[name] = x if kind in ("A_log", "dt_bias") else x.astype(dtype)
    return out


# The cached default model ----------------------------------------------------------------
def cache_root() -> Path:
    env = os.environ.get("STB_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sglang_tpu_backend"


def _asset_hash() -> str:
    h = hashlib.sha256(f"generator={GENERATOR_VERSION};seed={SEED};".encode())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        h.update(name.encode() + b"\0" + (ASSET_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def _tokenizer_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json")).get_vocab_size()


def with_default_model(args):
    """``args`` (a ServerArgs) with ``model_path`` set (the embedded tiny model when unset)
    and ``tokenizer_path`` (``model_path`` when unset)."""
    if args.model_path is None:
        args = dataclasses.replace(args, model_path=str(default_model_path()))
    if args.tokenizer_path is None:
        args = dataclasses.replace(args, tokenizer_path=args.model_path)
    return args


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """Directory of the embedded tiny model, generating its weights on first use.

    ``cache_dir`` defaults to ``cache_root()``. The directory name carries a hash of the shipped
    config/tokenizer and the generator version; an existing complete copy is reused. Writing
    goes to a temporary directory renamed into place, so a crash never leaves a partial model.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / f"tiny-qwen3.5-moe-{_asset_hash()}"
    if (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-tiny-", dir=root))
    try:
        tmp.chmod(0o755)
        config = json.loads((ASSET_DIR / "config.json").read_text())
        cfg = model_config_from_dict(config)
        tensors = random_checkpoint_tensors(cfg, num_real_tokens=_tokenizer_size())
        write_safetensors(tmp / "model.safetensors", tensors)
        shutil.copyfile(ASSET_DIR / "config.json", tmp / "config.json")
        copy_tokenizer_files(ASSET_DIR, tmp)
        return atomic_replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_random_model(out_dir: str | Path, *, seed: int, edit=None) -> Path:
    """The tiny model's config and tokenizer with weights drawn from ``seed``: another
    checkpoint of the same architecture (weight-update tests). ``edit(config, tensors)`` may
    change the config dict / tensor dict before they are written. Returns ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((ASSET_DIR / "config.json").read_text())
    tensors = random_checkpoint_tensors(model_config_from_dict(config), seed=seed,
                                        num_real_tokens=_tokenizer_size())
    if edit is not None:
        edit(config, tensors)
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_tokenizer_files(ASSET_DIR, out)
    return out


# A second tiny architecture (parity tests across layouts): another layer pattern (5 layers,
# no period), twice the hidden width, head_dim 128 with 4 query heads per kv head, GDN with 3
# value heads per key head and key/value widths 64/32, 32 experts top-8.
SECOND_ARCHITECTURE = dict(
    hidden_size=256, num_hidden_layers=5,
    layer_types=[LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION,
                 FULL_ATTENTION],
    num_attention_heads=4, num_key_value_heads=1, head_dim=128,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=64,
    linear_value_head_dim=32, num_experts=32, num_experts_per_tok=8,
    moe_intermediate_size=128, shared_expert_intermediate_size=256, mtp_num_hidden_layers=0,
)


def write_architecture(out_dir: str | Path, text_config: dict, *, seed: int = SEED) -> Path:
    """A random checkpoint of the tiny model's config with ``text_config`` overrides (another
    architecture: layer pattern, widths, heads, experts), the shipped tokenizer. Returns
    ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((ASSET_DIR / "config.json").read_text())
    config["text_config"].update(text_config)
    tensors = random_checkpoint_tensors(model_config_from_dict(config), seed=seed,
                                        num_real_tokens=_tokenizer_size())
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_tokenizer_files(ASSET_DIR, out)
    return out


def write_looping_model(out_dir: str | Path, scale: float = 1000.0) -> Path:
    """The tiny architecture (seed 0 weights) with its token embeddings scaled by ``scale``:
    the residual stream is then dominated by the current token, so the greedy continuation
    falls into a loop and repeats a passage it has seen, as small language models' greedy
    continuations do. A repetitive workload for n-gram drafting (the random default's
    continuations never repeat). Returns ``out_dir``."""
    def edit(config, tensors):
        name = "model.language_model.embed_tokens.weight"
        tensors[name] = tensors[name] * scale
    return write_random_model(out_dir, seed=0, edit=edit)


def write_shipped_config() -> Path:
    """Rewrite ``assets/tiny-qwen3.5-moe/config.json`` from the shipped tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json"))
    vocab = -(-tok.get_vocab_size() // 64) * 64
    config = tiny_config_dict(vocab, tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    path = ASSET_DIR / "config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


if __name__ == "__main__":
    if "--write-config" in sys.argv:
        print(f"wrote {write_shipped_config()}")
    else:
        print(default_model_path())
