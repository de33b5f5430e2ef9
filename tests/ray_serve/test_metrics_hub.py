"""``ray_app/metrics_hub.with_label``: a replica label on every sample of an exposition, which
Prometheus' own parser reads back (the Ray app's ``/metrics`` test covers the hub itself)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ray_app.metrics_hub import with_label  # noqa: E402


def test_every_sample_gets_the_replica_label():
    reg = CollectorRegistry()
    Counter("sglang:num_requests", "requests", ["role"], registry=reg).labels("decode").inc(3)
    Gauge("plain_gauge", "no labels", registry=reg).set(7)
    Histogram("sglang:ttft_seconds", "ttft", buckets=(0.1, 1.0), registry=reg).observe(0.5)
    text = with_label(generate_latest(reg), "replica", "r-1")
    samples = [s for fam in text_string_to_metric_families(text.decode()) for s in fam.samples]
    before = [s for fam in text_string_to_metric_families(generate_latest(reg).decode())
              for s in fam.samples]
    assert len(samples) == len(before)
    for s, b in zip(samples, before):
        assert s.labels == {**b.labels, "replica": "r-1"} and s.value == b.value
