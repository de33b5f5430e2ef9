"""Roofline for Qwen3.5-397B on one Ironwood host (4 chips, 8 TensorCores, DP8 x EP8) at
concurrency 64: each term stated, and the published 3,707 (8K/1K) and 677 (1K/8K) total
tokens/s per chip bounded from above within 2.5x; the speculative (MTP + verify) decode step."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from sglang_tpu_backend.models.param_shapes import mtp_param_shapes, num_param_bytes
from sglang_tpu_backend.planning.roofline import (
    CONFIG_397B, HARDWARE, ceiling, expert_coverage, load_config, main, model_sizes,
    mtp_step_terms, step_terms, verify_step_terms)

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


def test_verify_step_terms_count_every_row_and_the_commit():
    # 8 requests x n = 4 rows per device: 32 tokens, logits for each, experts covered by
    # 256 routed tokens; GDN per request and layer: the verify reads the state once (no
    # per-position writes), the commit reads and writes it and runs the n positions again.
    n, seqs = 4, 8
    v = verify_step_terms(CFG, seqs=seqs, kv_len=5120, devices=8, num_draft_tokens=n)
    d = step_terms(CFG, tokens=seqs, seqs=seqs, kv_len=5120, devices=8, decode=True)
    assert v["lm_head_flops"] == n * d["lm_head_flops"]
    assert v["expert_rows"] == n * d["expert_rows"]
    assert v["touched_local_experts"] == pytest.approx(expert_coverage(256, 512, 10) * 64)
    state, C, Hv = 64 * 128 * 128 * 2, 12288, 64  # bf16 [Hv, Dk, Dv]; conv channels
    verify = state + 2 * C * 3 * 2 + n * (C + 2 * Hv + Hv * 128) * 2  # + conv in, window, io
    commit = 2 * state + (2 * 3 + n) * C * 2 + 2 * n * Hv * 2  # + windows, conv out, a, b
    per_layer = 2 * (C * 4 * 2 + 8 * Hv)  # conv weights, A_log, dt_bias: both kernels
    assert v["gdn_state_bytes"] == 45 * (seqs * (verify + commit) + per_layer)
    steps = 2 * seqs * n * C * 4 + seqs * n * Hv * 8 * 128 * 128  # conv + delta rule
    assert v["gdn_flops"] == 45 * 2 * steps
    assert v["kv_bytes"] == 15 * (8 * 5120 + 32) * 2 * 2 * 256 * 2


def test_mtp_step_reads_one_attention_moe_layer_and_its_fc():
    t = mtp_step_terms(CFG, tokens=8, seqs=8, kv_len=5120, devices=1)
    s = model_sizes(CFG)
    shapes = mtp_param_shapes(CFG, jnp.bfloat16)
    # One device holds all 512 experts; with 8 tokens it touches 1-(1-10/512)^8 of them.
    all_bytes = t["dense_weight_bytes"] + 512 * s.expert_bytes
    assert all_bytes == pytest.approx(num_param_bytes(shapes), rel=1e-4)
    assert t["lm_head_flops"] == 8 * 2 * s.lm_head_params
    assert t["kv_bytes"] == (8 * 5120 + 8) * 2 * 2 * 256 * 2
    # Without the head (a backed-off step's MTP pass) only the LM head's terms go.
    bare = mtp_step_terms(CFG, tokens=8, seqs=8, kv_len=5120, devices=1, head=False)
    assert bare["lm_head_flops"] == 0 and bare["kv_bytes"] == t["kv_bytes"]
    assert bare["dense_weight_bytes"] == t["dense_weight_bytes"]


def test_speculation_pays_only_above_its_break_even_accept_length():
    kw = dict(input_len=1024, output_len=8192, concurrency=64, num_chips=4)
    plain = ceiling(CFG, TPU, **kw).tokens_per_s_per_chip
    spec = {a: ceiling(CFG, TPU, num_draft_tokens=4, accept_length=a, **kw) for a in (1.0, 2.5, 4.0)}
    assert spec[1.0].tokens_per_s_per_chip < plain < spec[2.5].tokens_per_s_per_chip
    assert spec[2.5].tokens_per_s_per_chip < spec[4.0].tokens_per_s_per_chip
    # A verify step costs more than a decode step, and the MTP drafts are part of it.
    assert spec[1.0].decode_step_s > ceiling(CFG, TPU, **kw).decode_step_s
    assert 0 < spec[1.0].draft_s < spec[1.0].decode_step_s
    with pytest.raises(ValueError, match="accept_length"):
        ceiling(CFG, TPU, num_draft_tokens=4, accept_length=5.0, **kw)


def test_cli_prints_the_speculative_ceiling_beside_the_published_figure(capsys):
    c = main(["--input-len", "1024", "--output-len", "8192", "--speculative-num-draft-tokens",
              "4", "--accept-length", "2.5"])
    printed = capsys.readouterr().out
    assert "ceiling without speculation" in printed and "published: 677" in printed
    backed_off = float(re.search(r"no chain\): [\d.]+ ms, x([\d.]+) of the plain", printed)[1])
    assert 0.9 < backed_off < 1.0  # the MTP pass: one layer of 61
    assert f"{c.tokens_per_s_per_chip:.0f} total tok/s/chip" in printed


def test_each_tpu_generation_has_its_peaks():
    """The backend knows its TPU from JAX's device_kind and plans with that generation's
    peaks: a v5e ("TPU v5 lite") at 819 GB/s and 197 bf16 TFLOP/s, with no fp8 MXU (FP8
    weights run at the bf16 peak), Ironwood with its fp8 peak; an unknown kind is named."""
    from sglang_tpu_backend.planning import roofline

    v5e = roofline.hardware_for("TPU v5 lite")
    assert (v5e.name, v5e.hbm_bandwidth, v5e.bf16_flops) == ("v5e", 819e9, 197e12)
    assert v5e.fp8_flops == v5e.bf16_flops and v5e.hbm_bytes == 16 * 2**30
    assert roofline.hardware_for("TPU v6 lite").name == "v6e"
    ironwood = roofline.hardware_for("TPU7x")
    assert ironwood.fp8_flops == 2 * ironwood.bf16_flops
    with pytest.raises(ValueError, match="'TPU v9'"):
        roofline.hardware_for("TPU v9")
