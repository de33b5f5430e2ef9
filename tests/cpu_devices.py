"""Run a test script in a fresh process that sees N simulated CPU devices.

The device count must be fixed before jax starts a backend, which in the pytest process has
already happened, so multi-device checks run as scripts in a subprocess and hand results back
through a file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_devices_env(num_devices: int) -> dict[str, str]:
    """This process's environment for a child that sees ``num_devices`` CPU devices and imports
    this checkout (any device-count flag of our own environment replaced)."""
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count", "")
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={num_devices}".strip())


def run_on_cpu_devices(script: Path, *args: str, num_devices: int = 8, timeout: int = 900) -> None:
    """``python script *args`` with ``num_devices`` CPU devices; fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, str(script), *args], env=cpu_devices_env(num_devices),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a coordinator the children bind)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_peers(script: Path, runs: dict, log_dir: Path, deadline_s: float) -> None:
    """Run ``python script *argv`` for every ``key: (argv, num_devices)`` of ``runs`` at once
    (peers of one multi-process mesh, and whatever runs beside them), each logging to
    ``log_dir/<key>.log``. Stops early when one exits non-zero (a dead peer would leave the
    others blocked in a collective); kills what is left by pid; fails the test, with each
    log's tail, unless all exited 0 within ``deadline_s``."""
    import pytest

    codes = run_peers_for_codes(script, runs, log_dir, deadline_s)
    if codes != {k: 0 for k in runs}:
        pytest.fail(f"subprocesses failed or timed out after {deadline_s}s: {codes}\n"
                    f"{log_tails(runs, log_dir, codes)}")


def log_tails(runs: dict, log_dir: Path, codes: dict) -> str:
    """The last lines of every run's log, headed by its key and exit code."""
    return "\n".join(f"--- {k} (exit {codes[k]}):\n" + (log_dir / f"{k}.log").read_text()[-3000:]
                     for k in runs)


def run_peers_for_codes(script: Path, runs: dict, log_dir: Path, deadline_s: float,
                        stop_on_failure: bool = True) -> dict:
    """Run the peers as ``run_peers`` does; return each one's exit code, None for one still
    running at the deadline (or, with ``stop_on_failure``, when another failed): killed."""
    import time

    procs, logs = {}, {}
    try:
        for key, (argv, num_devices) in runs.items():
            logs[key] = open(log_dir / f"{key}.log", "w")
            procs[key] = subprocess.Popen([sys.executable, str(script), *map(str, argv)],
                                          env=cpu_devices_env(num_devices), stdout=logs[key],
                                          stderr=subprocess.STDOUT)
        deadline = time.monotonic() + deadline_s
        while any(p.poll() is None for p in procs.values()):
            failed = any(p.poll() not in (None, 0) for p in procs.values())
            if (stop_on_failure and failed) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        codes = {k: p.poll() for k, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for f in logs.values():
            f.close()
    return codes
