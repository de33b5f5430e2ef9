"""router_stats on hand-checked inputs, and per-engine registries that do not collide."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from prometheus_client import REGISTRY

from sglang_tpu_backend.metrics import EngineMetrics
from sglang_tpu_backend.metrics.router_stats import router_stats


def test_uniform_router_and_skewed_load():
    T, E = 4, 8
    logits = jnp.zeros((T, E))  # uniform softmax: entropy ln E, top-1 prob 1/E
    top_i = jnp.array([[0, 1]] * 3 + [[7, 6]], jnp.int32)  # last row is padding
    ratio, ent, top1 = np.asarray(router_stats(logits, top_i, jnp.int32(3)))
    # 3 real tokens * 2 = 6 assignments, mean 6/8 per expert, experts 0 and 1 hold 3 each.
    assert ratio == pytest.approx(3 / (6 / 8))
    assert ent == pytest.approx(math.log(E), rel=1e-6)
    assert top1 == pytest.approx(1 / E)


def test_peaked_router_and_empty_step():
    logits = jnp.array([[10.0, 0.0], [0.0, 10.0]])
    top_i = jnp.array([[0], [1]], jnp.int32)
    ratio, ent, top1 = np.asarray(router_stats(logits, top_i, jnp.int32(2)))
    p = 1 / (1 + math.exp(-10))
    assert ratio == pytest.approx(1.0)  # one token per expert: balanced
    assert top1 == pytest.approx(p, rel=1e-6)
    assert ent == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-4)
    assert np.isnan(np.asarray(router_stats(logits, top_i, jnp.int32(0)))[0])


def test_engines_have_private_registries():
    a = EngineMetrics("m", role="prefill", dp_size=2, num_moe_layers=1)
    b = EngineMetrics("m", role="decode")  # same names in one process: no collision
    a.num_requests.inc(3)
    assert b"role=\"prefill\"" in a.render() and b"role=\"decode\"" in b.render()
    assert REGISTRY.get_sample_value("sglang:num_requests_total",
                                     {"model_name": "m", "role": "prefill"}) is None
    with pytest.raises(ValueError):
        EngineMetrics("m", role="router")


def test_handover_metrics():
    m = EngineMetrics("m", role="decode")
    m.observe_handover(0.5, 2_000_000_000)
    m.observe_handover(0.0, 0, ok=False)
    text = m.render().decode()
    assert 'sglang:kv_transfer_bytes_total{model_name="m",role="decode"} 2e+09' in text
    assert 'sglang:kv_transfer_failures_total{model_name="m",role="decode"} 1.0' in text
    assert 'sglang:kv_transfer_speed_gb_s{model_name="m",role="decode"} 4.0' in text
