"""Prometheus metrics with SGLang's names (``sglang:*``), one registry per engine.

``EngineMetrics`` (``collector.py``) owns a private ``CollectorRegistry`` so several engines in
one process (tests, Ray replicas) never collide; ``render()`` gives the text exposition format
that ``GET /metrics`` serves. ``router_stats.py`` holds the in-step expert-load reductions.
"""

from sglang_tpu_backend.metrics.collector import ROLES, EngineMetrics

__all__ = ["ROLES", "EngineMetrics"]
