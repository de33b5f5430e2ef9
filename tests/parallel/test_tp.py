"""Tensor-parallel attention (parallel/tp_forward.py) on 4 simulated CPU devices equals
single-device generation, at TP=2 (heads split) and TP=4 (kv and GDN key heads replicated).

The run needs 4 devices, fixed before jax starts, so ``tp_run.py`` runs in a subprocess and
writes an .npz; the tests assert on it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sglang_tpu_backend.config import load_model_config
from sglang_tpu_backend.model_loader.tiny_model import ASSET_DIR
from sglang_tpu_backend.parallel.tp_forward import conv_channels, heads_of_device, local_config
from tests.cpu_devices import run_on_cpu_devices

HERE = Path(__file__).resolve().parent
WIDTHS = (2, 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "out.npz"
    run_on_cpu_devices(HERE / "tp_run.py", str(out), num_devices=4)
    return dict(np.load(out))


def test_heads_of_device_split_or_replicate():
    assert [heads_of_device(8, 4, d) for d in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [heads_of_device(2, 8, d) for d in range(8)] == [[0]] * 4 + [[1]] * 4


def test_local_config_and_channel_layout_of_the_tiny_model():
    cfg = load_model_config(ASSET_DIR)
    loc = local_config(cfg, 4)
    assert (loc.num_attention_heads, loc.num_key_value_heads) == (1, 1)
    assert (loc.linear_num_key_heads, loc.linear_num_value_heads) == (1, 1)
    ch = conv_channels(cfg, 4)
    assert len(ch) == 4 * loc.linear_conv_dim
    # Device 3 reads GDN key head 1: its q then k channels, then its own value head 3.
    Dk, Dv, Hk = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads
    dev3 = ch[3 * loc.linear_conv_dim:]
    assert dev3[:Dk].tolist() == list(range(Dk, 2 * Dk))
    assert dev3[Dk:2 * Dk].tolist() == list(range(Hk * Dk + Dk, Hk * Dk + 2 * Dk))
    assert dev3[2 * Dk:].tolist() == list(range(2 * Hk * Dk + 3 * Dv, 2 * Hk * Dk + 4 * Dv))


@pytest.mark.parametrize("width", WIDTHS)
def test_greedy_tokens_equal_single_device(results, width):
    n = int(results["num_requests"])
    assert n == 7
    for i in range(n):
        tp, ref = results[f"tp{width}_tokens_{i}"], results[f"ref_tokens_{i}"]
        assert len(tp) >= 4 and tp.tolist() == ref.tolist(), (width, i, tp, ref)


@pytest.mark.parametrize("width", WIDTHS)
def test_logits_within_tolerance(results, width):
    for i in range(int(results["num_requests"])):
        tp, ref = results[f"tp{width}_logits_{i}"], results[f"ref_logits_{i}"]
        assert tp.shape == ref.shape
        np.testing.assert_allclose(tp, ref, atol=1e-4, rtol=0, err_msg=f"tp{width} req {i}")


def test_runs_covered_replication_and_mixed_steps(results):
    # The tiny model has 2 kv heads: TP2 splits them (each stored once), TP4 replicates them
    # (each stored on 2 devices, the ones whose q heads read it).
    kv_heads = load_model_config(ASSET_DIR).num_key_value_heads
    stored = {w: w * int(results[f"tp{w}_local_kv_heads"]) for w in WIDTHS}
    assert stored == {2: kv_heads, 4: 2 * kv_heads}
    assert [heads_of_device(kv_heads, 4, d) for d in range(4)] == [[0], [0], [1], [1]]
    for width in WIDTHS:
        modes = results[f"tp{width}_modes"].tolist()
        assert modes.count(modes[-1]) < len(modes)  # prefill/mixed steps as well as decode
