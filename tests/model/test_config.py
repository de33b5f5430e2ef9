"""config.json parsing for the supported model types."""

from __future__ import annotations

import pytest

from sglang_tpu_backend.config import (
    FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, model_config_from_dict,
)

TEXT = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)


def test_nested_and_flat_configs_are_the_same_model():
    nested = model_config_from_dict({"model_type": "qwen3_5_moe", "text_config": dict(TEXT)})
    flat = model_config_from_dict({"model_type": "qwen3_5_moe_text", **TEXT})
    assert {**vars(nested), "model_type": None} == {**vars(flat), "model_type": None}
    assert nested.layer_types == tuple(
        FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(8))
    assert nested.rotary_dim == 8 and nested.rope_theta == 1e7
    assert nested.linear_conv_dim == 2 * 2 * 16 + 4 * 16
    assert nested.dense_mlp_layers == ()


def test_qwen3_next_dense_layers_and_legacy_rope_fields():
    raw = {"model_type": "qwen3_next", **TEXT, "mlp_only_layers": [0], "decoder_sparse_step": 2,
           "intermediate_size": 96, "rope_theta": 5e6, "partial_rotary_factor": 0.5}
    del raw["rope_parameters"]
    cfg = model_config_from_dict(raw)
    assert cfg.dense_mlp_layers == (0, 2, 4, 6)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)
    assert cfg.rope_theta == 5e6 and cfg.rotary_dim == 16


@pytest.mark.parametrize("raw, needle", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
    ({"model_type": "qwen3_5_moe"}, "text_config"),
    ({"model_type": "qwen3_5_moe_text", "hidden_size": 8}, "lacks fields"),
    ({"model_type": "qwen3_5_moe_text", **TEXT, "layer_types": ["full_attention"]}, "layer_types"),
    ({"model_type": "qwen3_5_moe_text", **TEXT,
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "yarn"),
])
def test_bad_configs_name_the_problem(raw, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        model_config_from_dict(raw)
    assert "\n" not in str(e.value)
    if raw.get("model_type") == "llama":
        assert "qwen3_5_moe, qwen3_5_moe_text, qwen3_next" in str(e.value)


@pytest.mark.parametrize("layer_types,dense,period", [
    (["linear_attention"] * 3 + ["full_attention"], (), 4),
    ((["linear_attention"] * 3 + ["full_attention"]) * 2, (), 4),
    (["linear_attention", "full_attention"] * 4, (), 2),
    (["linear_attention", "full_attention", "linear_attention", "linear_attention",
      "full_attention"], (), 5),
    ((["linear_attention"] * 3 + ["full_attention"]) * 2, (1,), 8),  # a dense MLP breaks it
    ((["linear_attention"] * 3 + ["full_attention"]) * 2, (1, 5), 4),
])
def test_layer_period_is_the_smallest_repeating_group(layer_types, dense, period):
    cfg = model_config_from_dict({"model_type": "qwen3_5_moe_text", **TEXT,
                                  "num_hidden_layers": len(layer_types),
                                  "layer_types": layer_types})
    import dataclasses
    cfg = dataclasses.replace(cfg, dense_mlp_layers=dense)
    assert cfg.layer_period == period
