"""Every engine replica's ``sglang:*`` metrics at the ingress's ``/metrics``.

A Serve handle reaches one replica per call, so the ingress cannot ask every replica for its
metrics. Instead each engine replica pushes its exposition, labelled ``replica="<id>"``, to
one small named actor per application (:class:`MetricsHub`) every ``PUSH_INTERVAL_S``; the
ingress's ``/metrics`` merges what the hub holds. An entry not refreshed within
``TTL_S`` (a replica that died or was scaled down) is dropped, so a scrape shows the live
replicas, at most ``PUSH_INTERVAL_S`` old. The hub is detached (it survives any one
replica) and costs no CPU reservation.

Ray's own metrics (``ray_serve_*``: replicas, autoscaling, request counters) come from each
node's metrics agent, scraped separately (``monitoring/prometheus.yml``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

log = logging.getLogger(__name__)
PUSH_INTERVAL_S = 2.0
TTL_S = 5 * PUSH_INTERVAL_S


@ray.remote(num_cpus=0)
class MetricsHub:
    """Replica id -> (expiry time, exposition text)."""

    def __init__(self):
        self._texts: dict[str, tuple[float, bytes]] = {}

    def push(self, replica: str, text: bytes, ttl_s: float = TTL_S) -> None:
        self._texts[replica] = (time.monotonic() + ttl_s, text)

    def drop(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def collect(self) -> list[bytes]:
        now = time.monotonic()
        self._texts = {r: v for r, v in self._texts.items() if v[0] > now}
        return [text for _, (_, text) in sorted(self._texts.items())]


def get_hub(app_name: str):
    """The application's hub, created on first use."""
    return MetricsHub.options(name=f"sglang-metrics-hub:{app_name}", namespace="serve",
                              get_if_exists=True, lifetime="detached").remote()


def with_label(text: bytes, key: str, value: str) -> bytes:
    """A Prometheus text exposition with ``key="value"`` added to every sample."""
    out = []
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, brace, rest = line.partition("{")
            if brace:
                line = f'{name}{{{key}="{value}",{rest}'
            else:
                name, _, sample = line.partition(" ")
                line = f'{name}{{{key}="{value}"}} {sample}'
        out.append(line)
    return ("\n".join(out) + "\n").encode()


class MetricsPusher:
    """A daemon thread pushing ``render()`` (labelled with ``replica``) to the hub of
    ``app_name`` every ``interval_s`` until :meth:`stop`."""

    def __init__(self, app_name: str, replica: str, render: Callable[[], bytes],
                 interval_s: float = PUSH_INTERVAL_S):
        self.app_name, self.replica, self.render, self.interval_s = app_name, replica, render, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        hub = None
        while not self._stop.is_set():
            try:
                hub = hub or get_hub(self.app_name)
                ray.get(hub.push.remote(self.replica, with_label(self.render(), "replica", self.replica)))
            except Exception as e:  # the hub died or is restarting: look it up again next time
                log.warning("metrics push failed: %s", e)
                hub = None
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        try:
            get_hub(self.app_name).drop.remote(self.replica)
        except Exception:
            pass
