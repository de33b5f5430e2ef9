"""Writes dashboard.json (Grafana import format) from the panel list below.

    python monitoring/grafana/build_dashboard.py

Every query selects ``model_name=~"$model"`` (the ``model`` variable) and reads from the
``${DS_PROMETHEUS}`` datasource chosen at import time.
"""

from __future__ import annotations

import json
from pathlib import Path

M = 'model_name=~"$model"'
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def q(name: str, buckets: str) -> list[tuple[str, str]]:
    """p50 / p90 / p99 of a histogram, by role."""
    return [(f'histogram_quantile({p}, sum by (le, role) (rate({buckets}_bucket{{{M}}}[$__rate_interval])))',
             f"p{int(p * 100)} {{{{role}}}}") for p in (0.5, 0.9, 0.99)]


ROWS = [
    ("Latency", [
        ("Time to first token (s)", "s", q("ttft", "sglang:time_to_first_token_seconds")),
        ("Inter-token latency (s)", "s", q("itl", "sglang:inter_token_latency_seconds")),
        ("End-to-end request latency (s)", "s", q("e2e", "sglang:e2e_request_latency_seconds")),
        ("Queue time (s)", "s", q("queue", "sglang:queue_time_seconds")),
    ]),
    ("Throughput", [
        ("Tokens / s", "short", [
            (f'sum by (role) (rate(sglang:prompt_tokens_total{{{M}}}[$__rate_interval]))', "prompt {{role}}"),
            (f'sum by (role) (rate(sglang:generation_tokens_total{{{M}}}[$__rate_interval]))', "generation {{role}}"),
            (f'sum by (role) (sglang:gen_throughput{{{M}}})', "gen_throughput gauge {{role}}"),
        ]),
        ("Requests / s", "reqps", [
            (f'sum by (reason) (rate(sglang:num_requests_by_finish_reason_total{{{M}}}[$__rate_interval]))', "{{reason}}"),
        ]),
    ]),
    ("Scheduler", [
        ("Running and queued requests", "short", [
            (f'sum by (role, dp_rank) (sglang:num_running_reqs{{{M}}})', "running {{role}} rank {{dp_rank}}"),
            (f'sum by (role) (sglang:num_queue_reqs{{{M}}})', "queued {{role}}"),
        ]),
        ("Retractions and aborts / s", "short", [
            (f'sum by (role) (rate(sglang:num_retracted_reqs_total{{{M}}}[$__rate_interval]))', "retracted {{role}}"),
            (f'sum by (role) (rate(sglang:num_aborted_requests_total{{{M}}}[$__rate_interval]))', "aborted {{role}}"),
        ]),
    ]),
    ("Cache", [
        ("KV page usage", "percentunit", [
            (f'max by (role, dp_rank) (sglang:token_usage{{{M}}})', "{{role}} rank {{dp_rank}}"),
        ]),
        ("GDN state-slot usage", "percentunit", [
            (f'max by (role, dp_rank) (sglang:gdn_state_usage{{{M}}})', "{{role}} rank {{dp_rank}}"),
        ]),
        ("Prefix cache hit rate", "percentunit", [
            (f'max by (role) (sglang:cache_hit_rate{{{M}}})', "{{role}}"),
        ]),
    ]),
    ("Speculative decoding", [
        ("Accept length (tokens per verify step)", "short", [
            (f'max by (role) (sglang:spec_accept_length{{{M}}})', "{{role}}"),
        ]),
        ("Draft accept rate", "percentunit", [
            (f'max by (role) (sglang:spec_accept_rate{{{M}}})', "{{role}}"),
        ]),
    ]),
    ("Prefill-to-decode handover", [
        ("Handover latency (s)", "s", q("handover", "sglang:kv_transfer_latency_seconds")),
        ("Handover bytes / s and failures / s", "short", [
            (f'sum by (role) (rate(sglang:kv_transfer_bytes_total{{{M}}}[$__rate_interval]))', "bytes/s {{role}}"),
            (f'sum by (role) (rate(sglang:kv_transfer_failures_total{{{M}}}[$__rate_interval]))', "failures/s {{role}}"),
        ]),
    ]),
    ("Expert balance (numerical health)", [
        ("Expert load max / mean, worst layer", "short", [
            (f'max by (dp_rank) (sglang:expert_load_max_mean_ratio{{{M}}})', "rank {{dp_rank}}"),
        ]),
        ("Expert load max / mean per layer", "short", [
            (f'max by (layer) (sglang:expert_load_max_mean_ratio{{{M}}})', "layer {{layer}}"),
        ]),
        ("Router entropy (nats) and top-1 probability", "short", [
            (f'avg by (layer) (sglang:router_entropy{{{M}}})', "entropy layer {{layer}}"),
            (f'avg by (layer) (sglang:router_top1_prob{{{M}}})', "top-1 layer {{layer}}"),
        ]),
    ]),
    ("Ray Serve replicas and autoscaling", [
        ("Healthy replicas", "short", [
            ('sum by (application, deployment) (ray_serve_deployment_replica_healthy)', "{{application}}/{{deployment}}"),
        ]),
        ("Autoscaling: target and desired replicas", "short", [
            ('sum by (application, deployment) (ray_serve_autoscaling_target_replicas)', "target {{deployment}}"),
            ('sum by (application, deployment) (ray_serve_autoscaling_desired_replicas)', "desired {{deployment}}"),
        ]),
        ("Ongoing requests at replicas", "short", [
            ('sum by (application, deployment) (ray_serve_num_ongoing_requests_at_replicas)', "{{deployment}}"),
        ]),
        ("Serve requests / s", "reqps", [
            ('sum by (application, deployment) (rate(ray_serve_deployment_request_counter_total[$__rate_interval]))', "{{deployment}}"),
        ]),
        ("Scrape targets up", "short", [
            ('up{job=~"sglang-tpu-backend|sglang-ray-serve|ray"}', "{{job}} {{instance}}"),
        ]),
    ]),
]


def build() -> dict:
    panels, y, pid = [], 0, 1
    for title, row in ROWS:
        panels.append({"type": "row", "title": title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (ptitle, unit, targets) in enumerate(row):
            panels.append({
                "type": "timeseries", "title": ptitle, "id": pid, "datasource": DS,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [{"datasource": DS, "expr": e, "legendFormat": leg, "refId": chr(65 + j)}
                            for j, (e, leg) in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "__requires": [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
                       {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
                       {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""}],
        "title": "sglang-tpu-backend", "uid": "sglang-tpu-backend", "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "tags": ["sglang", "tpu", "ray-serve"],
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Datasource", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0},
            {"name": "model", "label": "Model", "type": "query", "datasource": DS,
             "query": {"query": "label_values(sglang:num_requests_total, model_name)", "refId": "model"},
             "definition": "label_values(sglang:num_requests_total, model_name)",
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
             "current": {}, "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("dashboard.json")
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {out}")
