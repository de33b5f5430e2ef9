"""Safetensors loader: layouts, FP8, config forms, transformers-saved checkpoints, Qwen3-Next."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sglang_tpu_backend.config import model_config_from_dict
from sglang_tpu_backend.model_loader.checkpoint_io import (
    FP8_BLOCK,
    dequantized_reference,
    fused_to_per_expert,
    nested_to_flat,
    quantize_checkpoint_fp8,
    write_checkpoint,
)
from sglang_tpu_backend.model_loader.loader import CheckpointError, load_model, load_mtp_params
from sglang_tpu_backend.model_loader.tiny_model import random_checkpoint_tensors
from sglang_tpu_backend.models.param_shapes import mtp_param_shapes, param_shapes
from sglang_tpu_backend.models.qwen3_5_moe import layer_params

P = "model.language_model."


def nested_config(**text_overrides) -> dict:
    """A 4-layer (3 GDN + 1 attention) qwen3_5_moe config; sizes multiples of 128 for FP8."""
    text = dict(
        model_type="qwen3_5_moe_text", vocab_size=256, hidden_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, eos_token_id=1,
    )
    text.update(text_overrides)
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}


def tensors_for(config: dict, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    return random_checkpoint_tensors(model_config_from_dict(config), seed=seed, dtype=dtype)


def assert_trees_equal(a, b):
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                      err_msg=jax.tree_util.keystr(path))


def test_fused_and_per_expert_layouts_load_identically(tmp_path):
    config = nested_config()
    tensors = tensors_for(config, dtype=ml_dtypes.bfloat16)
    fused = write_checkpoint(tmp_path / "fused", tensors, config)
    per_expert = write_checkpoint(tmp_path / "per", fused_to_per_expert(tensors), config, shards=3)
    assert (per_expert / "model.safetensors.index.json").is_file()
    cfg, a = load_model(fused, dtype=jnp.bfloat16)
    _, b = load_model(per_expert, dtype=jnp.bfloat16)
    assert_trees_equal(a, b)

    # And both equal the checkpoint: routed experts as stored ([out, in]), the rest transposed.
    gate_up = tensors[P + "layers.1.mlp.experts.gate_up_proj"].astype(np.float32)  # [E, 2I, H]
    experts = layer_params(a, cfg, 1)["mlp"]["experts"]
    assert experts["gate_up"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(experts["gate_up"], np.float32), gate_up)
    down = tensors[P + "layers.1.mlp.experts.down_proj"].astype(np.float32)  # [E, H, I]
    np.testing.assert_array_equal(np.asarray(experts["down"], np.float32), down)
    gdn = layer_params(a, cfg, 0)["linear_attn"]
    assert gdn["A_log"].dtype == jnp.float32 and gdn["dt_bias"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(gdn["A_log"]), tensors[P + "layers.0.linear_attn.A_log"])
    np.testing.assert_array_equal(np.asarray(a["lm_head"], np.float32),
                                  tensors["lm_head.weight"].astype(np.float32))  # as stored


def test_fp8_block_scaled_checkpoint_dequantises_to_reference(tmp_path):
    config = nested_config()
    tensors = tensors_for(config)
    fp8 = quantize_checkpoint_fp8(tensors)
    q_name = P + "layers.3.self_attn.q_proj.weight"
    assert fp8[q_name].dtype == ml_dtypes.float8_e4m3fn
    assert fp8[q_name + "_scale_inv"].shape == (2 * 64 * 2 // FP8_BLOCK, 1)
    ref = dequantized_reference(fp8)
    cfg, got = load_model(write_checkpoint(tmp_path / "fp8", fp8, config), dtype=jnp.float32)
    _, want = load_model(write_checkpoint(tmp_path / "ref", ref, config), dtype=jnp.float32)
    assert_trees_equal(got, want)
    # The quantisation itself is faithful (e4m3: 3 mantissa bits).
    q = np.asarray(layer_params(got, cfg, 3)["self_attn"]["q_proj"])
    np.testing.assert_allclose(q, tensors[q_name].T, atol=0.07 * np.abs(tensors[q_name]).max())


def test_keep_fp8_experts_keeps_values_and_scales_as_stored(tmp_path):
    config = nested_config()
    fp8 = quantize_checkpoint_fp8(tensors_for(config, seed=3))
    path = write_checkpoint(tmp_path / "fp8", fp8, config)
    cfg, kept = load_model(path, dtype=jnp.float32, keep_fp8_experts=True, backend="tpu")
    _, deq = load_model(path, dtype=jnp.float32)
    i, bi = cfg.moe_intermediate_size, cfg.moe_intermediate_size // FP8_BLOCK
    ex = layer_params(kept, cfg, 2)["mlp"]["experts"]
    assert ex["gate_up"].dtype == jnp.float8_e4m3fn and ex["down"].dtype == jnp.float8_e4m3fn
    assert ex["gate_up_scale"].shape == (4, 2 * bi, 1) and ex["down_scale"].shape == (4, 1, bi)
    stem = P + "layers.2.mlp.experts.1."
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(bits(ex["gate_up"])[1, :i], bits(fp8[stem + "gate_proj.weight"]))
    np.testing.assert_array_equal(bits(ex["gate_up"])[1, i:], bits(fp8[stem + "up_proj.weight"]))
    np.testing.assert_array_equal(bits(ex["down"])[1], bits(fp8[stem + "down_proj.weight"]))
    np.testing.assert_array_equal(np.asarray(ex["gate_up_scale"])[1, :bi], fp8[stem + "gate_proj.weight_scale_inv"])
    np.testing.assert_array_equal(np.asarray(ex["gate_up_scale"])[1, bi:], fp8[stem + "up_proj.weight_scale_inv"])
    np.testing.assert_array_equal(np.asarray(ex["down_scale"])[1], fp8[stem + "down_proj.weight_scale_inv"])
    # Kept values times their block scales are the dequantised load.
    expand = lambda s: np.repeat(np.repeat(np.asarray(s), FP8_BLOCK, 1), FP8_BLOCK, 2)  # noqa: E731
    deq_ex = layer_params(deq, cfg, 2)["mlp"]["experts"]
    np.testing.assert_array_equal(np.asarray(ex["gate_up"], np.float32) * expand(ex["gate_up_scale"]),
                                  np.asarray(deq_ex["gate_up"]))
    np.testing.assert_array_equal(np.asarray(ex["down"], np.float32) * expand(ex["down_scale"]),
                                  np.asarray(deq_ex["down"]))
    # Everything but the routed experts is dequantised as usual.
    assert_trees_equal(layer_params(kept, cfg, 2)["linear_attn"], layer_params(deq, cfg, 2)["linear_attn"])
    # Both loads have exactly the abstract tree that compiles without weights.
    for params, fp8_experts in ((kept, True), (deq, False)):
        want = param_shapes(cfg, jnp.float32, fp8_experts=fp8_experts)
        assert jax.tree.structure(params) == jax.tree.structure(want)
        got_sd = [(x.shape, x.dtype) for x in jax.tree.leaves(params)]
        assert got_sd == [(x.shape, x.dtype) for x in jax.tree.leaves(want)]


def test_keep_fp8_experts_falls_back_when_width_not_blockable(tmp_path, caplog):
    config = nested_config(moe_intermediate_size=64)
    path = write_checkpoint(tmp_path / "fp8", quantize_checkpoint_fp8(tensors_for(config)), config)
    with caplog.at_level(logging.INFO, logger="sglang_tpu_backend.model_loader.loader"):
        _, kept = load_model(path, dtype=jnp.float32, keep_fp8_experts=True, backend="tpu")
    _, deq = load_model(path, dtype=jnp.float32)
    assert_trees_equal(kept, deq)
    assert "not a multiple of 128" in caplog.text


def test_keep_fp8_experts_dequantised_once_off_tpu(tmp_path, caplog):
    """Off-TPU FP8 experts are dequantised at load (no scales) exactly as without the flag."""
    config = nested_config()
    path = write_checkpoint(tmp_path / "fp8", quantize_checkpoint_fp8(tensors_for(config)), config)
    with caplog.at_level(logging.INFO, logger="sglang_tpu_backend.model_loader.loader"):
        cfg, kept = load_model(path, dtype=jnp.float32, keep_fp8_experts=True, backend="cpu")
    _, deq = load_model(path, dtype=jnp.float32)
    assert_trees_equal(kept, deq)
    assert layer_params(kept, cfg, 2)["mlp"]["experts"].keys() == {"gate_up", "down"}
    assert "dequantising FP8 experts once at load" in caplog.text


def test_nested_and_flat_configs_load_the_same(tmp_path, caplog):
    config = nested_config()
    tensors = tensors_for(config)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    tensors["mtp.layers.0.input_layernorm.weight"] = np.zeros((128,), np.float32)
    flat_tensors, flat_config = nested_to_flat(tensors, config)
    assert flat_config["model_type"] == "qwen3_5_moe_text" and "text_config" not in flat_config
    assert "model.embed_tokens.weight" in flat_tensors
    with caplog.at_level(logging.INFO, logger="sglang_tpu_backend.model_loader.loader"):
        cfg_a, a = load_model(write_checkpoint(tmp_path / "nested", tensors, config), dtype=jnp.float32)
    assert "skipped 2 vision/MTP tensors" in caplog.text
    cfg_b, b = load_model(write_checkpoint(tmp_path / "flat", flat_tensors, flat_config), dtype=jnp.float32)
    assert_trees_equal(a, b)
    assert cfg_a.model_type == "qwen3_5_moe" and cfg_b.model_type == "qwen3_5_moe_text"
    assert {**vars(cfg_a), "model_type": ""} == {**vars(cfg_b), "model_type": ""}


def assert_shaped_like(tree, shapes):
    assert jax.tree.structure(tree) == jax.tree.structure(shapes)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(tree)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(shapes)]


def test_mtp_layers_load_into_their_params(tmp_path):
    """``mtp.*`` -> the MTP params (values transposed to [in, out] like the main layers');
    without ``mtp.*`` tensors, or without MTP layers in the config, the main params load as
    before and there are no MTP params; a missing MTP tensor is named."""
    config = nested_config(mtp_num_hidden_layers=1)
    tensors = tensors_for(config, dtype=ml_dtypes.bfloat16)
    path = write_checkpoint(tmp_path / "mtp", tensors, config)
    cfg, params = load_model(path, dtype=jnp.bfloat16)
    mtp = load_mtp_params(path, cfg, dtype=jnp.bfloat16)
    assert_shaped_like(mtp, mtp_param_shapes(cfg, jnp.bfloat16))
    hf = lambda name: tensors["mtp." + name].astype(np.float32)  # noqa: E731
    got = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_array_equal(got(mtp["fc"]), hf("fc.weight").T)  # [2H, H]: rows [emb | hidden]
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        np.testing.assert_array_equal(got(mtp[name]), hf(f"{name}.weight"))
    layer = mtp["layers"][0]
    np.testing.assert_array_equal(got(layer["self_attn"]["q_proj"]),
                                  hf("layers.0.self_attn.q_proj.weight").T)
    np.testing.assert_array_equal(got(layer["mlp"]["experts"]["gate_up"]),
                                  hf("layers.0.mlp.experts.gate_up_proj"))  # [E, 2I, H] as stored
    shared = np.concatenate([hf("layers.0.mlp.shared_expert.gate_proj.weight"),
                             hf("layers.0.mlp.shared_expert.up_proj.weight")]).T
    np.testing.assert_array_equal(got(layer["mlp"]["shared_expert"]["gate_up"]), shared)

    without = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
    for name, cfg_dict, ts in (("none", config, without), ("plain", nested_config(), tensors)):
        other = write_checkpoint(tmp_path / name, ts, cfg_dict)
        other_cfg, other_params = load_model(other, dtype=jnp.bfloat16)
        assert_trees_equal(other_params, params)
        assert load_mtp_params(other, other_cfg, dtype=jnp.bfloat16) is None

    missing = "mtp.layers.0.self_attn.k_norm.weight"
    broken = write_checkpoint(tmp_path / "broken", {n: t for n, t in tensors.items() if n != missing},
                              config)
    assert_trees_equal(load_model(broken, dtype=jnp.bfloat16)[1], params)  # main load unaffected
    with pytest.raises(CheckpointError, match=missing):
        load_mtp_params(broken, cfg, dtype=jnp.bfloat16)


def test_fp8_mtp_layers_load_like_the_main_layers(tmp_path):
    """FP8 block-scaled ``mtp.*`` (per-expert layout): dequantised to the reference, or with
    kept FP8 experts shaped like ``mtp_param_shapes(fp8_experts=True)``."""
    config = nested_config(mtp_num_hidden_layers=1)
    fp8 = quantize_checkpoint_fp8(tensors_for(config, seed=4))
    assert fp8["mtp.fc.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in fp8
    path = write_checkpoint(tmp_path / "fp8", fp8, config)
    ref = write_checkpoint(tmp_path / "ref", dequantized_reference(fp8), config)
    cfg, _ = load_model(path, dtype=jnp.float32)
    assert_trees_equal(load_mtp_params(path, cfg, dtype=jnp.float32),
                       load_mtp_params(ref, cfg, dtype=jnp.float32))
    kept = load_mtp_params(path, cfg, dtype=jnp.float32, keep_fp8_experts=True, backend="tpu")
    assert_shaped_like(kept, mtp_param_shapes(cfg, jnp.float32, fp8_experts=True))
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(bits(kept["layers"][0]["mlp"]["experts"]["down"])[3],
                                  bits(fp8["mtp.layers.0.mlp.experts.3.down_proj.weight"]))


def test_unknown_tensors_are_warned_about(tmp_path, caplog):
    config = nested_config()
    tensors = tensors_for(config)
    tensors[P + "layers.0.linear_attn.conv1d.bias"] = np.zeros((256,), np.float32)
    with caplog.at_level(logging.WARNING, logger="sglang_tpu_backend.model_loader.loader"):
        load_model(write_checkpoint(tmp_path / "c", tensors, config), dtype=jnp.float32)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "layers.0.linear_attn.conv1d.bias" in warnings[0].getMessage()


def test_tied_embeddings(tmp_path):
    config = nested_config(tie_word_embeddings=True)
    tensors = tensors_for(config)
    assert "lm_head.weight" not in tensors
    cfg, params = load_model(write_checkpoint(tmp_path / "tied", tensors, config), dtype=jnp.float32)
    assert cfg.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), tensors[P + "embed_tokens.weight"])


def _randomise(model, seed: int):
    """transformers zero-initialises norms/routers; give every parameter distinct values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _expected_from_torch(sd: dict, cfg, i: int) -> dict:
    """params.md leaves of layer i built by hand from a transformers state dict (numpy f32)."""
    t = lambda n: sd[f"model.layers.{i}.{n}"].numpy()  # noqa: E731
    out = {"input_layernorm": t("input_layernorm.weight"),
           "post_attention_layernorm": t("post_attention_layernorm.weight")}
    if cfg.layer_types[i] == "full_attention":
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"self_attn.{k}"] = t(f"self_attn.{k}.weight").T
        out["self_attn.q_norm"], out["self_attn.k_norm"] = t("self_attn.q_norm.weight"), t("self_attn.k_norm.weight")
    else:
        for k in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            out[f"linear_attn.{k}"] = t(f"linear_attn.{k}.weight").T
        out["linear_attn.conv1d"] = t("linear_attn.conv1d.weight")[:, 0]
        out["linear_attn.norm"] = t("linear_attn.norm.weight")
        out["linear_attn.A_log"], out["linear_attn.dt_bias"] = t("linear_attn.A_log"), t("linear_attn.dt_bias")
    out["mlp.experts.gate_up"] = t("mlp.experts.gate_up_proj")  # [E, 2I, H]: kept as stored
    out["mlp.experts.down"] = t("mlp.experts.down_proj")  # [E, H, I]
    out["mlp.gate"] = t("mlp.gate.weight").T
    out["mlp.shared_expert.gate_up"] = np.concatenate(
        [t("mlp.shared_expert.gate_proj.weight").T, t("mlp.shared_expert.up_proj.weight").T], axis=1)
    out["mlp.shared_expert.down"] = t("mlp.shared_expert.down_proj.weight").T
    out["mlp.shared_expert_gate"] = t("mlp.shared_expert_gate.weight").T
    return out


def _leaf(tree: dict, dotted: str):
    for k in dotted.split("."):
        tree = tree[k]
    return np.asarray(tree)


def test_transformers_save_pretrained_checkpoint_matches_torch_weights(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    text = nested_config()["text_config"]
    text.update(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=32,
                linear_key_head_dim=16, linear_value_head_dim=16)
    hf_cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    torch.manual_seed(0)
    model = _randomise(Qwen3_5MoeForCausalLM(hf_cfg).float(), seed=0)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_model(tmp_path / "hf", dtype=jnp.float32)
    assert cfg.model_type == "qwen3_5_moe_text"
    sd = model.state_dict()
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]), sd["model.embed_tokens.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(params["norm"]), sd["model.norm.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), sd["lm_head.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        expected = _expected_from_torch(sd, cfg, i)
        got_leaves = {jax.tree_util.keystr(p, simple=True, separator="."): x
                      for p, x in jax.tree_util.tree_leaves_with_path(layer_params(params, cfg, i))}
        assert set(got_leaves) == set(expected)
        for name, want in expected.items():
            np.testing.assert_array_equal(np.asarray(got_leaves[name]), want, err_msg=f"layer {i} {name}")


def test_qwen3_next_fused_projections_split_like_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    hf_cfg = Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=16, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1],
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = _randomise(Qwen3NextForCausalLM(hf_cfg).float(), seed=1).eval()
    model.save_pretrained(tmp_path / "next")
    cfg, params = load_model(tmp_path / "next", dtype=jnp.float32)
    assert cfg.model_type == "qwen3_next" and cfg.dense_mlp_layers == (1,)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2))
    for i in cfg.linear_layers:
        attn = model.model.layers[i].linear_attn
        with torch.no_grad():
            q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
        flat = lambda t: t.reshape(1, 5, -1).numpy()  # noqa: E731
        want = {"in_proj_qkv": np.concatenate([flat(q), flat(k), flat(v)], -1), "in_proj_z": flat(z),
                "in_proj_b": flat(b), "in_proj_a": flat(a)}
        for name, ref in want.items():
            got = x.numpy() @ np.asarray(layer_params(params, cfg, i)["linear_attn"][name])
            np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5, err_msg=f"layer {i} {name}")
    dense = model.model.layers[1].mlp
    np.testing.assert_array_equal(
        np.asarray(layer_params(params, cfg, 1)["mlp"]["gate_up"]),
        np.concatenate([dense.gate_proj.weight.detach().numpy().T, dense.up_proj.weight.detach().numpy().T], 1))
    np.testing.assert_array_equal(np.asarray(layer_params(params, cfg, 1)["mlp"]["down"]),
                                  dense.down_proj.weight.detach().numpy().T)
    assert "experts" in layer_params(params, cfg, 0)["mlp"] and "experts" not in layer_params(params, cfg, 1)["mlp"]


# Sharded loading and dummy weights (one device here; the DP / multi-process engines in
# tests/engine/test_dp_engine.py and test_multihost_engine.py read per device and process).
def test_read_rows_reads_only_those_rows(tmp_path):
    from sglang_tpu_backend.model_loader.checkpoint_io import (
        BYTES_READ, index_checkpoint, read_rows)

    config = nested_config()
    tensors = tensors_for(config)
    path = write_checkpoint(tmp_path / "ckpt", tensors, config)
    name = P + "layers.1.mlp.experts.gate_up_proj"  # [E, 2I, H] f32
    entry = index_checkpoint(path)[name]
    before = BYTES_READ.bytes
    np.testing.assert_array_equal(read_rows(entry, 1, 3), tensors[name][1:3])
    assert BYTES_READ.bytes - before == tensors[name][1:3].nbytes
    with pytest.raises(ValueError, match="rows 3:5 out of range"):
        read_rows(entry, 3, 5)


@pytest.mark.parametrize("host", [False, True], ids=["device-writes", "host-buffers"])
@pytest.mark.parametrize("keep_fp8", [False, True], ids=["dequantised", "fp8-kept"])
def test_sharded_load_equals_whole_load_and_reads_every_byte_once(tmp_path, keep_fp8, host):
    """Both load paths (on CPU devices the host-buffer one by default) give the whole load's
    params, and the host one's arrays are its buffers (no copy)."""
    from jax.sharding import SingleDeviceSharding

    from sglang_tpu_backend.model_loader.checkpoint_io import index_checkpoint
    from sglang_tpu_backend.model_loader.sharded_loader import load_sharded

    config = nested_config()
    path = write_checkpoint(tmp_path / "fp8", quantize_checkpoint_fp8(tensors_for(config, seed=3)),
                            config)
    cfg, whole = load_model(path, dtype=jnp.float32, keep_fp8_experts=keep_fp8, backend="tpu")
    where = SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: where, param_shapes(cfg, jnp.float32, fp8_experts=keep_fp8))
    params, report = load_sharded(path, cfg, shardings, dtype=jnp.float32,
                                  keep_fp8_experts=keep_fp8, backend="tpu", host_buffers=host)
    assert_trees_equal(params, whole)
    if host:  # every leaf in host_empty's page-aligned memory (XLA's own: 64-byte aligned)
        assert all(x.unsafe_buffer_pointer() % 4096 == 0 for x in jax.tree.leaves(params))
    entries = index_checkpoint(path).values()
    assert report.bytes_read == sum(e.end - e.begin for e in entries)
    experts = sum(e.end - e.begin for e in entries if ".mlp.experts." in e.name)
    assert report.expert_bytes == {where.device_set.pop().id: experts}


def test_bf16_host_load_reads_into_place_and_transposes_by_blocks(tmp_path):
    """bf16 weights in a bf16 load: the host path reads each straight into its buffer (the
    transposed ones through a scratch buffer) and gives what the device path gives."""
    from jax.sharding import SingleDeviceSharding

    from sglang_tpu_backend.model_loader import host_load
    from sglang_tpu_backend.model_loader.sharded_loader import load_sharded

    src = np.arange(3 * 200 * 70, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(3, 200, 70)
    dst = np.empty((3, 70, 200), src.dtype)
    host_load.transpose_into(dst, src)  # 200 rows: blocks of 64 and a partial one
    np.testing.assert_array_equal(dst.view(np.uint16), src.view(np.uint16).transpose(0, 2, 1))

    config = nested_config()
    path = write_checkpoint(tmp_path / "bf16", tensors_for(config, seed=4, dtype=ml_dtypes.bfloat16),
                            config, shards=2)
    cfg = model_config_from_dict(config)
    where = SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: where, param_shapes(cfg, jnp.bfloat16))
    a, ra = load_sharded(path, cfg, shardings, host_buffers=True)
    b, rb = load_sharded(path, cfg, shardings, host_buffers=False)
    assert_trees_equal(a, b)
    assert ra.bytes_read == rb.bytes_read > 0

    for shape in ((8, 8), (1024, 1024)):  # numpy's memory, and a huge-page mapping
        leaf = host_load.HostLeaf(shape, np.float32, where, stacked=False)
        buf = leaf.bufs[where.device_set.pop()]
        buf[...] = 3.0
        x = leaf.array()
        assert host_load.aliases(x, [buf]) and float(x.sum()) == 3.0 * buf.size


def test_dummy_params_are_the_seeds_and_shaped_like_the_config():
    from jax.sharding import SingleDeviceSharding

    from sglang_tpu_backend.model_loader.sharded_loader import dummy_params

    cfg = model_config_from_dict(nested_config())
    shapes = param_shapes(cfg, jnp.float32, fp8_experts=True)  # every kind of leaf, FP8 too
    where = SingleDeviceSharding(jax.devices()[0])
    make = lambda seed: dummy_params(cfg, jax.tree.map(lambda _: where, shapes),  # noqa: E731
                                     dtype=jnp.float32, fp8_experts=True, seed=seed)
    a, b, c = make(0), make(0), make(1)  # one program, the seed an argument
    assert_trees_equal(a, b)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(a)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(shapes)]
    assert not np.array_equal(a["embed_tokens"], c["embed_tokens"])
    assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in jax.tree.leaves(a))
    gdn = layer_params(a, cfg, 0)["linear_attn"]  # (1 + w) norms near 0, the gated norm near 1
    assert abs(float(gdn["norm"].mean()) - 1) < 0.05
    assert abs(float(layer_params(a, cfg, 0)["input_layernorm"].mean())) < 0.05
    assert float(gdn["A_log"].min()) >= 0 and float(gdn["A_log"].max()) < np.log(16)


def test_dummy_weights_at_397b_shapes_without_materialising_them():
    """``--load-format dummy`` at the 397B config: the generator's abstract output is exactly
    the tree the weight-free step compiles take (FP8 experts), ~400 GB of it, and it lowers
    for a device placement; nothing of that size is allocated here."""
    import json
    from pathlib import Path

    from jax.sharding import SingleDeviceSharding

    from sglang_tpu_backend.models.param_shapes import num_param_bytes
    from sglang_tpu_backend.model_loader.sharded_loader import dummy_init

    config = json.loads((Path(__file__).resolve().parents[2] / "sglang_tpu_backend" / "assets"
                         / "configs" / "qwen3.5-397b-a17b.json").read_text())
    cfg = model_config_from_dict(config)
    init = dummy_init(cfg, dtype=jnp.bfloat16, fp8_experts=True)
    got, want = jax.eval_shape(init, 0), param_shapes(cfg, jnp.bfloat16, fp8_experts=True)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(got)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(want)]
    assert num_param_bytes(got) > 390e9
    where = SingleDeviceSharding(jax.devices()[0])
    lowered = jax.jit(init, out_shardings=jax.tree.map(lambda _: where, want)).lower(0)
    assert len(jax.tree.leaves(lowered.out_info)) == len(jax.tree.leaves(want))


def test_host_filler_raises_an_error_of_any_worker_task_not_only_the_last():
    """A transpose or copy that failed on the worker fails the load, even when later tasks
    succeeded (a finish that waited only for the last task would hand out a half-filled
    buffer)."""
    from sglang_tpu_backend.model_loader import host_load
    from sglang_tpu_backend.model_loader.sharded_loader import LoadReport

    filler = host_load.HostFiller(LoadReport(), num_experts=1)
    dst = np.zeros((3, 2), np.float32)
    filler._submit(host_load.transpose_into, dst, np.ones((3, 2), np.float32))  # wrong shape
    filler._submit(np.copyto, dst, np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="cannot transpose"):
        filler.finish()


def test_is_cpu_reads_layout_formats():
    """A TPU's parameter shardings hold layout ``Format``s (sharding + device layout) for the
    dense weights; ``is_cpu`` reads their shardings (it raised AttributeError on them, which
    stopped the engine from starting on a chip)."""
    from jax.experimental.layout import Format, Layout
    from jax.sharding import SingleDeviceSharding

    from sglang_tpu_backend.model_loader import host_load

    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    tree = {"w": Format(Layout(major_to_minor=(0, 1)), cpu), "b": cpu}
    assert host_load.is_cpu(tree)
    assert host_load.sharding_of(tree["w"]) is cpu and host_load.sharding_of(cpu) is cpu
