"""Roofline for Qwen3.5-397B on one Ironwood host (4 chips, 8 TensorCores, DP8 x EP8) at
concurrency 64: each term stated, and the published 3,707 (8K/1K) and 677 (1K/8K) total
tokens/s per chip bounded from above within 2.5x."""

from __future__ import annotations

import pytest

from sglang_tpu_backend.roofline import (
    CONFIG_397B, HARDWARE, ceiling, expert_coverage, load_config, main, model_sizes, step_terms)

CFG = load_config(CONFIG_397B)
TPU = HARDWARE["tpu7x"]


def test_model_sizes_from_the_config():
    s = model_sizes(CFG, "bf16", "bf16")
    H, I, E = 4096, 1024, 512
    assert s.expert_params == 3 * H * I  # gate_up [H, 2I] + down [I, H]
    assert s.expert_bytes == 2 * 3 * H * I
    assert s.lm_head_params == 248320 * H
    # 60 layers x (512 experts + dense) + embedding + lm_head ~ 397B parameters.
    total = 60 * E * s.expert_params + s.dense_bytes / 2 + 2 * s.lm_head_params
    assert 390e9 < total < 405e9


def test_decode_terms_at_concurrency_64():
    # 64 requests over 8 ranks: 8 tokens per device; 64 tokens x 10 experts cover
    # 1 - (1 - 10/512)^64 = 71.7% of the experts.
    assert expert_coverage(64, 512, 10) == pytest.approx(0.7170, abs=1e-4)
    t = step_terms(CFG, tokens=8, seqs=8, kv_len=1024 + 4096, devices=8, decode=True)
    s = model_sizes(CFG)
    assert t["touched_local_experts"] == pytest.approx(0.7170 * 64, rel=1e-3)
    assert t["expert_weight_bytes"] == pytest.approx(0.7170 * 64 * s.expert_bytes * 60, rel=1e-3)
    assert t["dense_weight_bytes"] == s.dense_bytes  # one replica per device, read once
    # KV: 15 attention layers x 8 requests x 5120 tokens x (K + V) x 2 heads x 256 x bf16.
    assert t["kv_bytes"] == 15 * (8 * 5120 + 8) * 2 * 2 * 256 * 2
    # GDN state: 45 layers x 8 requests x (read + write) x 64 heads x 128 x 128 x bf16 (+ conv).
    rec = 45 * 8 * 2 * 64 * 128 * 128 * 2
    assert rec < t["gdn_state_bytes"] < 1.05 * rec
    assert t["attention_flops"] == 4 * 8 * 32 * 256 * 5120 * 15


@pytest.mark.parametrize("inp,out,published", [(8192, 1024, 3707), (1024, 8192, 677)])
def test_ceilings_bound_the_published_numbers(inp, out, published):
    c = ceiling(CFG, TPU, input_len=inp, output_len=out, concurrency=64, num_chips=4)
    assert published < c.tokens_per_s_per_chip < 2.5 * published, c.tokens_per_s_per_chip
    assert c.decode_bound == "memory"
    assert 5e-3 < c.decode_step_s < 50e-3


def test_cli_prints_the_implied_efficiency(capsys):
    c = main(["--hardware", "tpu7x", "--input-len", "8192", "--output-len", "1024",
              "--concurrency", "64"])
    printed = capsys.readouterr().out
    assert "implied efficiency" in printed and f"{c.tokens_per_s_per_chip:.0f}" in printed
    h = main(["--hardware", "h200", "--input-len", "1024", "--output-len", "8192"])
    assert h.tokens_per_s_per_chip > 0


def test_cpu_hardware_is_measured():
    c = main(["--hardware", "cpu", "--input-len", "128", "--output-len", "16", "--concurrency", "4",
              "--num-chips", "1"])
    assert c.tokens_per_s_per_chip > 0
