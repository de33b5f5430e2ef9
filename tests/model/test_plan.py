"""Per-device memory planner (sglang_tpu_backend.planning.plan) on the shipped Qwen3.5-397B config.

Expected sizes are written out from the config's numbers (H 4096, V 248320, 60 layers = 45
GDN + 15 attention, N 32 / G 2 heads of 256, Hk 16 / Hv 64 GDN heads of 128, K 4 taps,
E 512 experts of width 1024, shared expert 1024), not from the planner's helpers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from sglang_tpu_backend.config import model_config_from_dict
from sglang_tpu_backend.planning.plan import DEFAULT_CONFIG, main, plan

CFG = model_config_from_dict(json.loads(DEFAULT_CONFIG.read_text()))
COMMON = dict(context_length=9216, page_size=256, expert_dtype="fp8", kv_dtype="bf16",
              state_dtype="bf16")

# Weights, bytes (bf16 = 2 B/element, FP8 = 1 B + f32 scales per 128x128 block).
EMBED_AND_HEAD = 2 * 248320 * 4096 * 2 + 4096 * 2  # embed_tokens, lm_head, final norm
PER_LAYER = (2 * 4096 * 2                            # input / post-attention norms
             + 4096 * 512 * 2                        # router
             + (4096 * 2 * 1024 + 1024 * 4096) * 2   # shared expert gate_up, down
             + 4096 * 1 * 2)                         # shared expert gate
ATTN_PROJ = (4096 * (32 * 2 * 256) + 2 * 4096 * (2 * 256) + (32 * 256) * 4096) * 2
ATTN_NORMS = 2 * 256 * 2                             # q_norm, k_norm
GDN_C = 2 * 16 * 128 + 64 * 128                      # conv channels [q | k | v] = 12288
# in_proj_qkv, in_proj_z, in_proj_b + in_proj_a, conv1d, out_proj (bf16); A_log, dt_bias (f32).
GDN_PROJ = (4096 * GDN_C + 4096 * 64 * 128 + 2 * 4096 * 64 + GDN_C * 4 + 64 * 128 * 4096) * 2 \
    + 2 * 64 * 4
GDN_NORM = 128 * 2
EXPERTS_PER_DEVICE_EP8 = (60 * 64 * (4096 * 2048 + 1024 * 4096)      # FP8 gate_up + down
                          + 60 * 64 * (32 * 16 + 8 * 32) * 4)        # their f32 block scales
REPLICATED_DP = EMBED_AND_HEAD + 60 * PER_LAYER + 15 * (ATTN_PROJ + ATTN_NORMS) \
    + 45 * (GDN_PROJ + GDN_NORM)
# TP8: q/o split 8 ways, k/v one of the 2 kv heads, GDN 2 of 16 key heads and 8 of 64 value heads.
ATTN_PROJ_TP8 = (4096 * (32 * 2 * 256) // 8 + 2 * 4096 * 256 + (32 * 256) * 4096 // 8) * 2
GDN_C_TP8 = 2 * 2 * 128 + 8 * 128
GDN_PROJ_TP8 = (4096 * GDN_C_TP8 + 4096 * 8 * 128 + 2 * 4096 * 8 + GDN_C_TP8 * 4
                + 8 * 128 * 4096) * 2 + 2 * 8 * 4
REPLICATED_TP = EMBED_AND_HEAD + 60 * PER_LAYER + 15 * ATTN_NORMS + 45 * GDN_NORM


def test_weights_dp8_ep8_equal_hand_computed_sizes():
    p = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, **COMMON)
    assert p.weights_sharded == EXPERTS_PER_DEVICE_EP8
    assert p.weights_replicated == REPLICATED_DP
    bf16 = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=0,
                **{**COMMON, "expert_dtype": "bf16"})
    assert bf16.weights_sharded == 60 * 64 * (4096 * 2048 + 1024 * 4096) * 2


def test_weights_tp8_equal_hand_computed_sizes():
    p = plan(CFG, "tpu7x:2x2x1", tp=8, ep=8, running_requests=0, **COMMON)
    assert (p.dp, p.tp, p.ep) == (1, 8, 8)
    assert p.weights_replicated == REPLICATED_TP
    assert p.weights_sharded == EXPERTS_PER_DEVICE_EP8 + 15 * ATTN_PROJ_TP8 + 45 * GDN_PROJ_TP8


def test_kv_and_gdn_state_for_64_requests_per_rank():
    p = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, **COMMON)
    assert p.requests_per_device == 64
    # 64 requests x ceil(9216/256)=36 pages x 15 attention layers x [2*G=4, 256, 256] bf16.
    assert p.kv_pages == 64 * 36 * 15 * (2 * 2 * 256 * 256 * 2)
    # 64 x 45 GDN layers x (conv [4 rows, 12288] bf16 + recurrent [64, 128, 128] bf16).
    assert p.gdn_state == 64 * 45 * (4 * 12288 * 2 + 64 * 128 * 128 * 2)
    fp8 = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512,
               **{**COMMON, "kv_dtype": "fp8", "state_dtype": "fp32"})
    # FP8 KV (--kv-cache-dtype fp8_e4m3): 1 byte per element + an f32 scale per K/V row; the
    # conv state then stays in the state dtype (fp32 here).
    assert fp8.kv_pages == 64 * 36 * 15 * (2 * 2 * 256 * (256 * 1 + 4))
    assert fp8.gdn_state == 64 * 45 * (4 * 12288 * 4 + 64 * 128 * 128 * 4)


def test_fp8_kv_raises_max_running_requests_at_9k():
    auto = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, **COMMON)
    fp8 = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, **{**COMMON, "kv_dtype": "fp8"})
    print(f"max running requests per host at 9K, DP8+EP8: KV bf16 {auto.max_running_requests}, "
          f"KV fp8_e4m3 {fp8.max_running_requests}")
    assert fp8.max_running_requests > auto.max_running_requests
    per_req = lambda p: (p.kv_pages + p.gdn_state) / p.requests_per_device  # noqa: E731
    assert per_req(fp8) < per_req(auto)


def test_activations_formula():
    p = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, **COMMON)
    T, M = 1024, 8 * 1024 * 10
    assert p.activations == 2 * (2 * T * 4096 + 8 * T * 4096 + M * (2 * 4096 + 1024)) \
        + 4 * 64 * 248320


def test_dp8_ep8_fits_512_and_tp8_does_not():
    dp = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, **COMMON)
    assert dp.headroom > 0 and dp.max_running_requests >= 512
    tp = plan(CFG, "tpu7x:2x2x1", tp=8, ep=8, running_requests=512, **COMMON)
    # TP8 holds one kv head (of 2) of every running request of the host on each device.
    assert tp.kv_pages == 512 * 36 * 15 * (2 * 1 * 256 * 256 * 2)
    assert tp.headroom < 0
    print(f"max running requests per host at 9K: DP8+EP8 {dp.max_running_requests}, "
          f"TP8+EP8 {tp.max_running_requests}")
    assert tp.max_running_requests < 512 < dp.max_running_requests
    # The cap is exact: one more request does not fit.
    at_max = plan(CFG, "tpu7x:2x2x1", tp=8, running_requests=tp.max_running_requests, **COMMON)
    over = plan(CFG, "tpu7x:2x2x1", tp=8, running_requests=tp.max_running_requests + 1, **COMMON)
    assert at_max.headroom >= 0 > over.headroom


def test_two_hosts_split_requests_over_16_ranks():
    p = plan(CFG, "tpu7x:2x2x2", running_requests=512, **COMMON)
    # 96 GiB per TensorCore, 1.25 GiB of it kept by XLA:TPU (what a program may use: 94.75)
    assert (p.devices, p.hosts, p.dp, p.ep, p.hbm) == (16, 2, 16, 16, (96 << 30) - (5 << 30) // 4)
    assert p.requests_per_device == 64  # 512 per host x 2 hosts / 16 ranks
    assert p.weights_sharded == EXPERTS_PER_DEVICE_EP8 // 2


def test_cli_table_and_json(capsys):
    assert main(["--model-config", str(DEFAULT_CONFIG), "--topology", "tpu7x:2x2x1",
                 "--dp", "8", "--ep", "8", "--max-running-requests", "512"]) == 0
    out = capsys.readouterr().out
    assert "KV pages" in out and "headroom" in out and "16.88 GiB" in out
    assert main(["--tp", "8", "--max-running-requests", "512", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tp"] == 8 and got["headroom"] < 0 and got["max_running_requests"] < 512
    assert got["kv_pages"] == 512 * 36 * 15 * (2 * 1 * 256 * 256 * 2)


def test_cli_context_length_is_the_servers_flag(capsys):
    """One spelling with the server (SGLang's --context-length); the old --context-len too."""
    from sglang_tpu_backend.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--context-length", "4096"]).context_length == 4096
    plans = []
    for flag in ("--context-length", "--context-len"):
        assert main(["--dp", "8", "--ep", "8", flag, "4096", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0] == plans[1] and plans[0]["context_length"] == 4096


def test_cli_kv_cache_dtype_is_the_servers_flag(capsys):
    """``plan --kv-cache-dtype fp8_e4m3`` (the server's flag) plans what ``--kv-dtype fp8``
    does; the server parses the same spelling."""
    from sglang_tpu_backend.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    plans = []
    for flags in (["--kv-cache-dtype", "fp8_e4m3"], ["--kv-dtype", "fp8"], []):
        assert main(["--dp", "8", "--ep", "8", "--json", *flags]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0] == plans[1]
    assert plans[0]["max_running_requests"] > plans[2]["max_running_requests"]


@pytest.mark.parametrize("kwargs, flag", [
    (dict(topology="tpu9:2x2x1"), "--topology"),
    (dict(topology="tpu7x:2x2"), "--topology"),
    (dict(dp=4, tp=4), "--dp"),
    (dict(dp=8, ep=3), "--ep"),
    (dict(dp=4, tp=2, ep=8 * 3), "--ep"),
    (dict(tp=8, dp=1, ep=8, kv_dtype="int4"), "--kv-dtype"),
])
def test_bad_input_names_the_flag(kwargs, flag):
    topology = kwargs.pop("topology", "tpu7x:2x2x1")
    with pytest.raises(ValueError, match=flag):
        plan(CFG, topology, **{**COMMON, **kwargs})


def test_ep_must_divide_num_experts():
    raw = json.loads(DEFAULT_CONFIG.read_text())
    raw["text_config"]["num_experts"] = 500
    cfg = model_config_from_dict(raw)
    with pytest.raises(ValueError, match=r"--ep 8 does not divide num_experts \(500\)"):
        plan(cfg, "tpu7x:2x2x1", dp=8, ep=8)


def test_cli_bad_input_exits_with_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--topology", "tpu7x:2x2x1", "--dp", "4", "--tp", "4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--dp 4 x --tp 4" in err and "8 devices" in err
    with pytest.raises(SystemExit):
        main(["--topology", "v5e:4x4"])
    assert "--topology" in capsys.readouterr().err


def test_redundant_experts_weights_equal_hand_computed_sizes():
    """EPLB: 512 + 32 expert slots over EP8 = 68 per device; the replicated maps per MoE
    layer are physical i32[512, 33], copies i32[512], logical i32[544]."""
    p = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, redundant_experts=32, **COMMON)
    assert p.expert_slots_per_device == 68 and p.redundant_experts == 32
    assert p.weights_sharded == EXPERTS_PER_DEVICE_EP8 * 68 // 64
    assert p.weights_replicated == REPLICATED_DP + 60 * (512 * 33 + 512 + 544) * 4
    with pytest.raises(ValueError, match="--ep-num-redundant-experts 4"):
        plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, redundant_experts=4, **COMMON)


def test_mtp_layer_weights_and_kv_pages_equal_hand_computed_sizes(capsys):
    """--mtp: the shipped config's one MTP layer adds fc [2H, H], three norms and one
    full-attention MoE layer (experts split over EP like the main ones) and one attention
    layer's KV pages."""
    assert CFG.mtp_num_hidden_layers == 1
    base = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, **COMMON)
    p = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, mtp=True, **COMMON)
    assert (base.mtp_layers, p.mtp_layers) == (0, 1)
    fc_and_norms = 2 * 4096 * 4096 * 2 + 3 * 4096 * 2
    assert p.weights_replicated == REPLICATED_DP + fc_and_norms + PER_LAYER + ATTN_PROJ + ATTN_NORMS
    assert p.weights_sharded == EXPERTS_PER_DEVICE_EP8 * 61 // 60
    assert p.kv_pages == 64 * 36 * 16 * (2 * 2 * 256 * 256 * 2)
    assert p.max_running_requests < base.max_running_requests
    assert main(["--mtp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mtp_layers"] == 1
    no_mtp = dataclasses.replace(CFG, mtp_num_hidden_layers=0)
    with pytest.raises(ValueError, match="--mtp"):
        plan(no_mtp, "tpu7x:2x2x1", mtp=True, **COMMON)


def test_verify_step_states_and_logits_are_planned():
    """--speculative-num-draft-tokens 4: per request, 45 GDN layers x (a conv window of 3 + 4
    rows of 12,288 bf16 channels + the gate inputs a, b of 4 x 64 bf16) and 4 rows of f32
    logits (3 more than without drafts); no per-position recurrent state, so 512 requests of
    9K still fit, but fewer than without drafts."""
    base = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, **COMMON)
    p = plan(CFG, "tpu7x:2x2x1", dp=8, ep=8, running_requests=512, num_draft_tokens=4, **COMMON)
    per_req = 45 * ((3 + 4) * 12288 * 2 + 2 * 4 * 64 * 2) + 3 * 4 * 248320
    assert p.activations - base.activations == 64 * per_req
    assert (p.weights, p.kv_pages, p.gdn_state) == (base.weights, base.kv_pages, base.gdn_state)
    assert p.num_draft_tokens == 4 and 512 < p.max_running_requests < base.max_running_requests
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        plan(CFG, "tpu7x:2x2x1", num_draft_tokens=0, **COMMON)
