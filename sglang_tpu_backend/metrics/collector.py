"""EngineMetrics: request, token, latency, scheduler, cache and MoE-health metrics.

Names and labels follow SGLang's exporter (``sglang:`` prefix, ``model_name`` label); every
series also carries ``role`` (``colocated`` for the standalone server; ``prefill`` / ``decode``
for disaggregated replicas) and, where a number belongs to one data-parallel rank, ``dp_rank``.

Fed by the engine through five calls (all cheap, plain Python):

- ``on_step(chunks, touched, now)`` after each model step: queue time at first admission,
  time to first token, inter-token latency, generation tokens;
- ``on_finish(req)`` once per finished / aborted request: request and prompt-token counters,
  end-to-end latency;
- ``on_step_error(phase)`` when a phase of the scheduler loop raised;
- ``on_router_stats(stats)`` with the step's per-layer expert-load summary (``router_stats.py``);
- ``on_verify(chunks, results)`` after a speculative verify step: accept length and rate;
- ``render(pool_stats)`` at scrape time: gauges and cumulative scheduler counters read from
  the engine's ``pool_stats()`` snapshot, then the text exposition.

Handover metrics (prefill -> decode KV + GDN state transfer) are defined here with the role
label and stay at zero on a colocated server; the disaggregated Ray mode feeds them through
``observe_handover``.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ROLES = ("colocated", "prefill", "decode")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets in seconds (SGLang's spread: sub-10 ms decode steps up to multi-minute requests).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 15.0, 20.0, 25.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
HANDOVER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
THROUGHPUT_WINDOW_S = 1.0  # gen_throughput is recomputed at most once per window


class _PoolCollector:
    """Scrape-time gauges and counters from the engine's ``pool_stats()`` snapshot."""

    def __init__(self, owner: "EngineMetrics"):
        self.owner = owner

    def collect(self):
        o = self.owner
        stats = o._pool_stats
        base = [o.model_name, o.role]
        names = ["model_name", "role"]
        rank_names = names + ["dp_rank"]

        def family(cls, name, doc, labels):
            return cls(name, doc, labels=labels)

        running = family(GaugeMetricFamily, "sglang:num_running_reqs", "Running requests", rank_names)
        usage = family(GaugeMetricFamily, "sglang:token_usage", "KV page usage (used / total pages)",
                       rank_names)
        pages_used = family(GaugeMetricFamily, "sglang:kv_pages_used", "KV pages held", rank_names)
        pages_total = family(GaugeMetricFamily, "sglang:kv_pages_total", "KV pages in the pool", rank_names)
        slots_used = family(GaugeMetricFamily, "sglang:gdn_state_slots_used",
                            "GDN state slots held", rank_names)
        slots_total = family(GaugeMetricFamily, "sglang:gdn_state_slots_total",
                             "GDN state slots in the pool", rank_names)
        slot_usage = family(GaugeMetricFamily, "sglang:gdn_state_usage",
                            "GDN state-slot usage (used / total slots)", rank_names)
        for k, r in enumerate(stats.get("dp_ranks", [])):
            lv = base + [str(k)]
            running.add_metric(lv, r["num_running"])
            usage.add_metric(lv, r["kv_pages_used"] / max(r["kv_pages_total"], 1))
            pages_used.add_metric(lv, r["kv_pages_used"])
            pages_total.add_metric(lv, r["kv_pages_total"])
            slots_used.add_metric(lv, r["state_slots_used"])
            slots_total.add_metric(lv, r["state_slots_total"])
            slot_usage.add_metric(lv, r["state_slots_used"] / max(r["state_slots_total"], 1))
        yield from (running, usage, pages_used, pages_total, slots_used, slots_total, slot_usage)
        queue = family(GaugeMetricFamily, "sglang:num_queue_reqs", "Requests waiting for admission", names)
        queue.add_metric(base, stats.get("num_queued", 0))
        yield queue
        retracted = family(CounterMetricFamily, "sglang:num_retracted_reqs",
                           "Requests retracted (KV pages ran out; re-prefilled later)", names)
        retracted.add_metric(base, stats.get("num_retracted_total", 0))
        yield retracted
        aborted = family(CounterMetricFamily, "sglang:num_aborted_requests",
                         "Requests aborted (client, server or error)", names)
        aborted.add_metric(base, stats.get("num_aborted_total", 0))
        yield aborted


class EngineMetrics:
    """All metrics of one engine, in a private registry.

    Args:
      model_name: the served model name (label ``model_name``).
      role: ``colocated`` | ``prefill`` | ``decode`` (label ``role``).
      dp_size: data-parallel ranks (label values ``dp_rank`` = 0..dp_size-1).
      num_moe_layers: MoE layers whose router health is exported (label ``layer``).
      step_phases: the scheduler loop's phases (label ``phase`` of the step-error counter,
        exported at 0 from the start).
    """

    def __init__(self, model_name: str, *, role: str = "colocated", dp_size: int = 1,
                 num_moe_layers: int = 0, step_phases: tuple[str, ...] = ()):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.model_name, self.role, self.dp_size = model_name, role, dp_size
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["model_name", "role"]
        self._lv = (model_name, role)

        def counter(name, doc):
            return Counter(name, doc, lab, registry=r).labels(*self._lv)

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(*self._lv)

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, lab + list(extra), registry=r)

        # Requests and tokens.
        self.num_requests = counter("sglang:num_requests", "Requests finished (any reason)")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated (sampled) tokens")
        self.finish_reason = Counter("sglang:num_requests_by_finish_reason",
                                     "Finished requests by finish reason (stop / length / abort)",
                                     lab + ["reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.finish_reason.labels(*self._lv, reason)
        self.step_errors = Counter("sglang:num_step_errors",
                                   "Engine phases that raised (each failed only the requests it "
                                   "involved), by phase", lab + ["phase"], registry=r)
        for phase in step_phases:
            self.step_errors.labels(*self._lv, phase)
        # Latencies (seconds).
        self.ttft = hist("sglang:time_to_first_token_seconds", "Time to first token (s)", TTFT_BUCKETS)
        self.itl = hist("sglang:inter_token_latency_seconds", "Time between output tokens (s)", ITL_BUCKETS)
        self.e2e = hist("sglang:e2e_request_latency_seconds", "Arrival to finish (s)", E2E_BUCKETS)
        self.queue_time = hist("sglang:queue_time_seconds", "Arrival to first admission (s)", TTFT_BUCKETS)
        self.gen_throughput = gauge("sglang:gen_throughput", "Generated tokens per second").labels(*self._lv)
        self.cache_hit_rate = gauge("sglang:cache_hit_rate",
                                    "Prefix-cache hit rate: prompt tokens reused / (reused + prefilled)").labels(*self._lv)
        # Prefill -> decode handover (fed by the disaggregated mode; zero when colocated).
        self.handover_latency = hist("sglang:kv_transfer_latency_seconds",
                                     "Prefill-to-decode handover (KV pages + GDN state) latency (s)",
                                     HANDOVER_BUCKETS)
        self.handover_bytes = counter("sglang:kv_transfer_bytes", "Bytes handed over prefill -> decode")
        self.handover_failures = counter("sglang:kv_transfer_failures", "Failed handovers")
        self.handover_latency_ms = gauge("sglang:kv_transfer_latency_ms",
                                         "Latency of the last handover (ms)").labels(*self._lv)
        self.handover_speed = gauge("sglang:kv_transfer_speed_gb_s",
                                    "Throughput of the last handover (GB/s)").labels(*self._lv)
        # MoE numerical health, per MoE layer and DP rank (last step).
        health = ("layer", "dp_rank")
        self.expert_load_ratio = gauge("sglang:expert_load_max_mean_ratio",
                                       "Tokens on the busiest expert / mean tokens per expert "
                                       "(1 = balanced), last step", health)
        self.router_entropy = gauge("sglang:router_entropy",
                                    "Mean router softmax entropy over the step's tokens (nats)", health)
        self.router_top1 = gauge("sglang:router_top1_prob",
                                 "Mean top-1 router probability over the step's tokens", health)
        for layer in range(num_moe_layers):
            for k in range(dp_size):
                for g in (self.expert_load_ratio, self.router_entropy, self.router_top1):
                    g.labels(*self._lv, str(layer), str(k))
        # Speculative decoding (cumulative since start-up; 0 without it).
        self.spec_accept_length = gauge(
            "sglang:spec_accept_length",
            "Mean tokens a request gains per speculative verify step (1 + accepted drafts)"
        ).labels(*self._lv)
        self.spec_accept_rate = gauge(
            "sglang:spec_accept_rate",
            "Accepted / proposed speculative drafts (rows that may accept drafts)"
        ).labels(*self._lv)
        self._spec = [0, 0, 0, 0]  # verify rows, tokens gained, drafts accepted, drafts proposed
        self._pool_stats: dict[str, Any] = {}
        self._router_stats: np.ndarray | None = None
        self.registry.register(_PoolCollector(self))
        self._tp_tokens, self._tp_since = 0, time.monotonic()

    # Engine hooks ------------------------------------------------------------------------
    def on_step(self, chunks: Iterable[Any], touched: Iterable[Any], now: float | None = None) -> None:
        """After a step: queue time of newly admitted requests, TTFT / ITL of new tokens."""
        now = time.monotonic() if now is None else now
        for c in chunks:
            req = c.req
            if req.admit_time is not None and not req.metrics_queue_observed:
                req.metrics_queue_observed = True
                self.queue_time.observe(max(0.0, req.admit_time - req.arrival_time))
        n_new = 0
        for req in touched:
            n_out = len(req.output_ids)
            seen = req.metrics_num_tokens
            if n_out <= seen or req.first_token_time is None:
                continue
            if seen == 0:
                self.ttft.observe(req.first_token_time - req.arrival_time)
            else:
                self.itl.observe(max(0.0, req.last_token_time - req.metrics_last_token_time))
            req.metrics_num_tokens, req.metrics_last_token_time = n_out, req.last_token_time
            n_new += n_out - seen
        if n_new:
            self.generation_tokens.inc(n_new)
        self._tp_tokens += n_new
        if now - self._tp_since >= THROUGHPUT_WINDOW_S:
            self.gen_throughput.set(self._tp_tokens / (now - self._tp_since))
            self._tp_tokens, self._tp_since = 0, now

    def on_finish(self, req: Any, now: float | None = None) -> None:
        """Once per request that finished for any reason (idempotent)."""
        if req.metrics_finish_observed or not req.finished:
            return
        req.metrics_finish_observed = True
        now = time.monotonic() if now is None else now
        self.num_requests.inc()
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.finish_reason.labels(*self._lv, req.finish_reason["type"]).inc()
        self.e2e.observe(max(0.0, now - req.arrival_time))

    def on_verify(self, chunks: Iterable[Any], results: Iterable[Any]) -> None:
        """After a verify step: each chunk's accepted drafts (``ChunkResult.num_accepted``)."""
        s = self._spec
        for c, res in zip(chunks, results):
            s[0] += 1
            s[1] += 1 + res.num_accepted
            s[2] += res.num_accepted
            s[3] += len(c.drafts) if c.accept_drafts else 0
        self.spec_accept_length.set(s[1] / s[0] if s[0] else 0.0)
        self.spec_accept_rate.set(s[2] / s[3] if s[3] else 0.0)

    def on_router_stats(self, stats: np.ndarray) -> None:
        """Keep the step's stats f32[D, L, 3] (max/mean expert load, mean entropy, mean top-1
        probability per rank and layer, ``router_stats.py``); the gauges take them at scrape
        time, so a step costs one reference assignment."""
        self._router_stats = stats

    def _apply_router_stats(self) -> None:
        """NaN rows (a rank with no tokens, a dense layer) leave the gauges as they were."""
        stats, self._router_stats = self._router_stats, None
        if stats is None:
            return
        for k, per_rank in enumerate(stats):
            for layer, (ratio, entropy, top1) in enumerate(per_rank):
                if not np.isfinite(ratio):
                    continue
                lv = (*self._lv, str(layer), str(k))
                self.expert_load_ratio.labels(*lv).set(float(ratio))
                self.router_entropy.labels(*lv).set(float(entropy))
                self.router_top1.labels(*lv).set(float(top1))

    def on_step_error(self, phase: str) -> None:
        """A phase of the scheduler loop raised (``managers/scheduler_loop.py``)."""
        self.step_errors.labels(*self._lv, phase).inc()

    def observe_handover(self, seconds: float, num_bytes: int, ok: bool = True) -> None:
        """One prefill -> decode handover of ``num_bytes`` (KV pages + GDN state)."""
        if not ok:
            self.handover_failures.inc()
            return
        self.handover_latency.observe(seconds)
        self.handover_bytes.inc(num_bytes)
        self.handover_latency_ms.set(seconds * 1e3)
        self.handover_speed.set(num_bytes / max(seconds, 1e-9) / 1e9)

    # Exposition --------------------------------------------------------------------------
    def render(self, pool_stats: dict | None = None) -> bytes:
        """The text exposition format; ``pool_stats`` is the engine's ``pool_stats()`` now."""
        if pool_stats is not None:
            self._pool_stats = pool_stats
            cached = pool_stats.get("num_cached_tokens_total", 0)
            computed = cached + pool_stats.get("num_prefill_tokens_total", 0)
            self.cache_hit_rate.set(cached / computed if computed else 0.0)
        self._apply_router_stats()
        return generate_latest(self.registry)
