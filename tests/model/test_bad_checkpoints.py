"""Broken checkpoints fail with one-line CheckpointError/ConfigError messages naming the cause."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.config import ConfigError, model_config_from_dict
from sglang_tpu_backend.model_loader.checkpoint_io import CheckpointError, write_checkpoint
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.model_loader.tiny_model import random_checkpoint_tensors
from sglang_tpu_backend.models.qwen3_5_moe import layer_params
from sglang_tpu_backend.tokenizer import load_tokenizer

CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 64,
    "hidden_size": 32, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1,
    "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 2,
    "num_experts_per_tok": 1, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
}


def tensors() -> dict[str, np.ndarray]:
    return random_checkpoint_tensors(model_config_from_dict(CONFIG), prefix="model.", dtype=np.float32)


def error_of(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_valid_checkpoint_loads(tmp_path):  # the baseline every case below breaks
    cfg, params = load_model(write_checkpoint(tmp_path, tensors(), CONFIG), dtype=jnp.float32)
    assert layer_params(params, cfg, 1)["self_attn"]["q_proj"].shape == (32, 64)


def test_unknown_architecture_names_it_and_lists_supported(tmp_path):
    config = {**CONFIG, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    msg = error_of(ConfigError, load_model, write_checkpoint(tmp_path, tensors(), config))
    assert "'llama'" in msg and "LlamaForCausalLM" in msg
    assert all(t in msg for t in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"))


def test_missing_tensor_is_named_with_its_shape(tmp_path):
    t = tensors()
    del t["model.layers.1.self_attn.k_proj.weight"]
    msg = error_of(CheckpointError, load_model, write_checkpoint(tmp_path, t, CONFIG))
    assert "lacks 1 tensor" in msg
    assert "model.layers.1.self_attn.k_proj.weight (expected shape [16, 32])" in msg


def test_many_missing_tensors_stay_on_one_line(tmp_path):
    t = {k: v for k, v in tensors().items() if "layers.1." not in k}
    msg = error_of(CheckpointError, load_model, write_checkpoint(tmp_path, t, CONFIG))
    assert "model.layers.1.input_layernorm.weight" in msg and "more" in msg


def test_missing_untied_lm_head(tmp_path):
    t = tensors()
    del t["lm_head.weight"]
    msg = error_of(CheckpointError, load_model, write_checkpoint(tmp_path, t, CONFIG))
    assert "lm_head.weight (expected shape [64, 32])" in msg


def test_wrong_shape_names_tensor_expected_and_actual(tmp_path):
    t = tensors()
    t["model.layers.0.linear_attn.in_proj_z.weight"] = np.zeros((8, 32), np.float32)
    msg = error_of(CheckpointError, load_model, write_checkpoint(tmp_path, t, CONFIG))
    assert "model.layers.0.linear_attn.in_proj_z.weight expected shape [16, 32], got [8, 32]" in msg


def test_wrong_fused_expert_shape(tmp_path):
    t = tensors()
    t["model.layers.0.mlp.experts.down_proj"] = np.zeros((2, 16, 32), np.float32)
    msg = error_of(CheckpointError, load_model, write_checkpoint(tmp_path, t, CONFIG))
    assert "model.layers.0.mlp.experts.down_proj expected shape [2, 32, 16], got [2, 16, 32]" in msg


def test_pickle_only_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    msg = error_of(CheckpointError, load_model, tmp_path)
    assert "pytorch_model.bin" in msg and "pickle" in msg and "safetensors" in msg
    assert "for safety" in msg


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    msg = error_of(CheckpointError, load_model, tmp_path)
    assert "no *.safetensors" in msg and str(tmp_path) in msg


def test_truncated_file(tmp_path):
    path = write_checkpoint(tmp_path, tensors(), CONFIG) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    msg = error_of(CheckpointError, load_model, tmp_path)
    assert "truncated" in msg


def test_index_naming_a_missing_shard(tmp_path):
    write_checkpoint(tmp_path, tensors(), CONFIG, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    msg = error_of(CheckpointError, load_model, tmp_path)
    assert "model-00002-of-00002.safetensors" in msg


def test_missing_tokenizer_names_directory_and_file(tmp_path):
    write_checkpoint(tmp_path, tensors(), CONFIG)
    msg = error_of(CheckpointError, load_tokenizer, tmp_path)
    assert str(tmp_path) in msg and "tokenizer.json" in msg


def test_checkpoint_errors_are_value_errors():
    assert issubclass(CheckpointError, ValueError) and issubclass(ConfigError, ValueError)


def test_corrupt_header(tmp_path):
    write_checkpoint(tmp_path, tensors(), CONFIG)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    msg = error_of(CheckpointError, load_model, tmp_path)
    assert "model.safetensors" in msg and "corrupt safetensors header" in msg
