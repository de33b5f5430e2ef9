"""Live-server fixtures: ``python -m sglang_tpu_backend.launch_server`` in a subprocess on a free
127.0.0.1 port, waited for via /health, stopped by pid at the end.

``live_server`` (session scope) is the default server every module shares; ``start_server``
starts extra ones (e.g. with ``--api-key``). ``STB_SERVER_TEST_ENGINE=fake`` swaps in the
test-double launcher ``tests.server.fake_server`` (for developing the tests without a model).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
# Small sizes: few step shapes to compile (compiled lazily: --skip-warmup), and a context short
# enough to overflow cheaply.
DEFAULT_FLAGS = ["--context-length", "2048", "--max-running-requests", "8", "--page-size", "16",
                 "--chunked-prefill-size", "64", "--max-request-body-bytes", "65536", "--skip-warmup",
                 "--random-seed", "1234", "--log-level", "warning"]
STARTUP_TIMEOUT_S = float(os.environ.get("STB_SERVER_TEST_STARTUP_S", "600"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, flags: list[str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        module = ("tests.server.fake_server" if os.environ.get("STB_SERVER_TEST_ENGINE") == "fake"
                  else "sglang_tpu_backend.launch_server")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="stb-server-", suffix=".log", delete=False)
        env = dict(os.environ)
        env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port), *flags],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()
        if not os.environ.get("STB_SERVER_TEST_KEEP_LOGS"):
            with contextlib.suppress(OSError):
                os.unlink(self.log.name)

    # Helpers the tests share ---------------------------------------------------------------
    def headers(self) -> dict:
        return {}

    def pool_stats(self) -> dict:
        return requests.get(self.url + "/get_server_info", headers=self.headers(), timeout=30).json()["pool_stats"]

    def wait_pools_empty(self, timeout: float = 30.0) -> dict:
        """Poll until no pages, slots or requests are held; returns the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.pool_stats()
            if (stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0
                    and stats["num_running"] == 0 and stats["num_queued"] == 0):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.1)


def start_server(flags: list[str]) -> LiveServer:
    server = LiveServer(DEFAULT_FLAGS + flags)
    server.wait_ready()
    return server


@pytest.fixture(scope="session")
def live_server():
    server = start_server([])
    yield server
    server.stop()
