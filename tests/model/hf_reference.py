"""Tiny random Qwen3.5-MoE checkpoints made with transformers, the numerical reference.

Every parameter is drawn at random (transformers zero-initialises the router and the norms,
which would make top-k routing a tie-break lottery between implementations).
"""

from __future__ import annotations

import math
from pathlib import Path

CONFIGS = {
    # 4 layers (3 GDN + 1 attention), head_dim 32, 8 experts top-2.
    "small": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=512,
    ),
    # 8 layers (6 GDN + 2 attention), head_dim 64, 3 value heads per key head, 16 experts top-4,
    # tied embeddings.
    "wide": dict(
        vocab_size=320, hidden_size=96, num_hidden_layers=8, num_attention_heads=6,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=24, linear_value_head_dim=32, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    # 5 layers whose kinds never repeat with a period (one scan group of all 5 layers).
    "irregular": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention", "full_attention"],
    ),
}


def make_hf_model(name: str, seed: int = 0):
    """A random fp32 ``Qwen3_5MoeForCausalLM`` for ``CONFIGS[name]``."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        **CONFIGS[name],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, eos_token_id=None, pad_token_id=None, bos_token_id=None,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * math.log(16.0))
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    return model


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path
