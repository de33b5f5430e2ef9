"""The model on FP8 block-scaled experts kept in FP8 (grouped matmuls with block scales)
equals the model on the same experts dequantised at load time (what a CPU load does)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.model_loader.checkpoint_io import quantize_checkpoint_fp8, write_checkpoint
from sglang_tpu_backend.config import model_config_from_dict
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.models.qwen3_5_moe import layer_params
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache
from sglang_tpu_backend.model_loader.tiny_model import random_checkpoint_tensors

# Expert width 128 so gate|up can stay FP8 blockwise (128x128 scale blocks).
CONFIG = {
    "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
    "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 1,
    "linear_num_value_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
}


def test_fp8_experts_kept_equal_dequantised(tmp_path):
    cfg = model_config_from_dict(CONFIG)
    tensors = quantize_checkpoint_fp8(
        random_checkpoint_tensors(cfg, seed=3, prefix="model.", dtype=np.float32),
        predicate=lambda name: ".mlp.experts." in name,
    )
    path = write_checkpoint(tmp_path / "fp8", tensors, CONFIG)
    # keep_fp8_experts off-TPU: dequantised at load (backend defaults to this CPU run's).
    _, deq = load_model(path, dtype=jnp.float32, keep_fp8_experts=True)
    assert layer_params(deq, cfg, 0)["mlp"]["experts"]["gate_up"].dtype == jnp.float32
    cfg, kept = load_model(path, dtype=jnp.float32, keep_fp8_experts=True, backend="tpu")
    assert layer_params(kept, cfg, 0)["mlp"]["experts"]["gate_up"].dtype == jnp.float8_e4m3fn
    assert "gate_up_scale" in layer_params(kept, cfg, 0)["mlp"]["experts"]

    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 13).tolist()
    outs = []
    for params in (kept, deq):
        cache = init_cache(cfg, num_pages=4, page_size=8, num_state_slots=1,
                           kv_dtype=jnp.float32, state_dtype=jnp.float32)
        batch, _ = build_forward_batch([SeqChunk(prompt, 0, [0, 1], 0, logits="all")], page_size=8)
        logits, _ = forward_jit(params, cache, batch, cfg, impl="reference")
        outs.append(np.asarray(logits))
    # Same FP8 values and scales on both sides; only where dequantisation happens (per call in
    # the reference, once at load for the CPU load) differs.
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-4, rtol=0)
