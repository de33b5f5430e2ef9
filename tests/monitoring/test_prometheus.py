"""A real Prometheus (Debian's ``prometheus`` package) scrapes a live server under load, and
every PromQL expression of the Grafana dashboard and of the alert rules returns data.

- The server is the standalone one (``tests/server/conftest.py``); Prometheus runs on
  127.0.0.1 with a 1 s scrape interval and is stopped by process id afterwards.
- Ray Serve's ``ray_serve_*`` families do not exist without a Ray cluster: here a synthetic
  exporter (a few samples with Ray Serve's names and labels) stands in as the ``ray`` job (the
  list of such expressions is asserted, so a new Ray-only query cannot slip in unnoticed).
  Against a live Ray Serve app, its replicas and Ray's own metrics agent, the same
  expressions are checked by ``tests/ray_serve/test_serve_app.py`` with :func:`prometheus`.
- Handover series (``sglang:kv_transfer_*``) exist but stay at zero on a colocated server; the
  handover latency quantiles evaluate to NaN samples (data, but no observations).
- Alert rules whose expression is a condition are checked on the expression left of the
  comparison (the condition itself is false under this load).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from tests.server.conftest import start_server

REPO = Path(__file__).resolve().parents[2]
MON = REPO / "monitoring"
PROMETHEUS, PROMTOOL = shutil.which("prometheus") or "/usr/bin/prometheus", \
    shutil.which("promtool") or "/usr/bin/promtool"
RAY_ONLY = {  # expressions that need Ray Serve (checked against the synthetic exporter)
    "sum by (application, deployment) (ray_serve_deployment_replica_healthy)",
    "sum by (application, deployment) (ray_serve_autoscaling_target_replicas)",
    "sum by (application, deployment) (ray_serve_autoscaling_desired_replicas)",
    "sum by (application, deployment) (ray_serve_num_ongoing_requests_at_replicas)",
    "sum by (application, deployment) (rate(ray_serve_deployment_request_counter_total[30s]))",
}
SYNTHETIC_RAY = "\n".join([
    '# TYPE ray_serve_deployment_replica_healthy gauge',
    'ray_serve_deployment_replica_healthy{application="app",deployment="Decode",replica="r0"} 1',
    '# TYPE ray_serve_autoscaling_target_replicas gauge',
    'ray_serve_autoscaling_target_replicas{application="app",deployment="Decode"} 2',
    '# TYPE ray_serve_autoscaling_desired_replicas gauge',
    'ray_serve_autoscaling_desired_replicas{application="app",deployment="Decode"} 2',
    '# TYPE ray_serve_num_ongoing_requests_at_replicas gauge',
    'ray_serve_num_ongoing_requests_at_replicas{application="app",deployment="Decode"} 3',
    '# TYPE ray_serve_deployment_request_counter_total counter',
    'ray_serve_deployment_request_counter_total{application="app",deployment="Decode",replica="r0"} {n}',
]) + "\n"

pytestmark = pytest.mark.skipif(not os.path.exists(PROMETHEUS),
                                reason="Debian's prometheus package is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_exprs() -> list[str]:
    d = json.loads((MON / "grafana" / "dashboard.json").read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((MON / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def underlying(expr: str) -> str:
    """The expression of a condition ``X > 5`` (X), unchanged if it is no condition."""
    m = re.fullmatch(r"(.*?)\s*(>=|<=|==|!=|>|<)\s*[-\d.e]+\s*", expr, flags=re.S)
    return m.group(1) if m else expr


def concrete(expr: str) -> str:
    """Grafana variables replaced as Grafana would: all models, a 30 s rate window."""
    return expr.replace("$__rate_interval", "30s").replace('=~"$model"', '=~".*"')


class _RayExporter(http.server.BaseHTTPRequestHandler):
    n = 0

    def do_GET(self):  # noqa: N802
        _RayExporter.n += 5
        body = SYNTHETIC_RAY.replace("{n}", str(_RayExporter.n)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def prometheus(jobs: dict[str, dict]):
    """A real Prometheus on 127.0.0.1 (1 s scrapes and rule evaluations, monitoring/alerts.yml
    loaded) scraping ``jobs`` (job name -> ``{"target": "host:port", "metrics_path": ...}``),
    the scrape settings otherwise as monitoring/prometheus.yml. Yields its URL; stopped by
    process id."""
    tmp = Path(tempfile.mkdtemp(prefix="stb-prom-"))
    port = _free_port()
    cfg = yaml.safe_load((MON / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(MON / "alerts.yml")]
    cfg["scrape_configs"] = [
        {"job_name": name, "metrics_path": job.get("metrics_path", "/metrics"),
         "static_configs": [{"targets": [job["target"]]}]} for name, job in jobs.items()]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log = open(tmp / "prometheus.log", "w")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline and prom.poll() is None, (tmp / "prometheus.log").read_text()
            time.sleep(0.5)
        yield url
    finally:
        os.kill(prom.pid, signal.SIGTERM)
        prom.wait(timeout=30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def stack():
    server = start_server([])
    ray = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RayExporter)
    threading.Thread(target=ray.serve_forever, daemon=True).start()
    jobs = {"sglang-tpu-backend": {"target": f"127.0.0.1:{server.port}"},
            "ray": {"target": f"127.0.0.1:{ray.server_address[1]}"}}
    try:
        with prometheus(jobs) as url:
            _load(server.url)
            time.sleep(4)  # a few scrapes after the load: rate() windows hold >= 2 points
            yield url, server
    finally:
        ray.shutdown()
        server.stop()


def _load(url: str) -> None:
    """Two waves of concurrent requests (with a streaming one) spread over several scrapes."""
    def one(i):
        body = {"text": f"Request number {i} about the sea and the sky.", "stream": i % 4 == 0,
                "sampling_params": {"max_new_tokens": 8 + i % 5, "temperature": 0, "ignore_eos": True}}
        r = requests.post(url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for wave in range(2):
            list(pool.map(one, range(6 * wave, 6 * wave + 6)))
            time.sleep(2)


def query(url: str, expr: str) -> list:
    r = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=30).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def test_promtool_checks_the_alert_rules():
    out = subprocess.run([PROMTOOL, "check", "rules", str(MON / "alerts.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_exprs())} rules found" in out.stdout


def test_dashboard_is_in_grafana_import_format():
    d = json.loads((MON / "grafana" / "dashboard.json").read_text())
    assert d["__inputs"][0]["name"] == "DS_PROMETHEUS" and d["__inputs"][0]["type"] == "datasource"
    assert d["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["model"]["type"] == "query"
    assert "label_values(" in variables["model"]["definition"]
    assert "id" not in d or d["id"] is None  # import assigns the id
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in d["panels"] if p["type"] == "row").lower()
    for section in ("latency", "throughput", "scheduler", "cache", "handover", "expert", "serve"):
        assert section in titles, section
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
            assert all("expr" in t and "refId" in t for t in p["targets"])


def test_every_dashboard_and_alert_expression_returns_data(stack):
    url, server = stack
    exprs = [concrete(e) for e in dashboard_exprs()] + [underlying(e) for e in alert_exprs()]
    ray_only = {e for e in exprs if "ray_serve_" in e}
    assert ray_only == RAY_ONLY | {"sum by (deployment, application) (ray_serve_deployment_replica_healthy)"}
    empty = [e for e in exprs if not query(url, e)]
    assert not empty, f"expressions without data: {empty}"
    # The load is visible: 12 requests, every one counted once.
    total = query(url, 'sum(sglang:num_requests_total{job="sglang-tpu-backend"})')
    assert float(total[0]["value"][1]) == 12
    ttft = query(url, "sum(sglang:time_to_first_token_seconds_count)")
    assert float(ttft[0]["value"][1]) == 12


def test_prometheus_loaded_every_alert_rule(stack):
    url, _ = stack
    groups = requests.get(url + "/api/v1/rules", timeout=30).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(alert_exprs()) == 8
    time.sleep(1.5)  # one evaluation after load
    rules = [r for g in requests.get(url + "/api/v1/rules", timeout=30).json()["data"]["groups"]
             for r in g["rules"]]
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
