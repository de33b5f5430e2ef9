"""Start-up time of the server on the embedded default: launch to ``/health`` answering,
warm-up (every step program compiled) included; first with an empty compilation cache, then
again with the cache the first start filled.

    JAX_PLATFORMS=cpu python benchmarks/bench_startup.py

Prints both times and their ratios to the targets (60 s cold, 30 s warm on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_health(cache_dir: str, extra: list[str], timeout: float) -> float:
    """Seconds from spawning ``launch_server`` to ``GET /health`` returning 200."""
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang_tpu_backend.launch_server", "--port", str(port),
           "--compilation-cache-dir", cache_dir, "--log-level", "warning", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"no /health within {timeout} s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("server_args", nargs="*", help="extra launch_server flags (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="stb-jax-cache-") as cache:
        cold = time_to_health(cache, args.server_args, args.timeout)
        warm = time_to_health(cache, args.server_args, args.timeout)
    print(f"first start (empty compilation cache): {cold:6.1f} s   target 60 s: {cold / 60:.2f}x")
    print(f"second start (cache filled):           {warm:6.1f} s   target 30 s: {warm / 30:.2f}x")
    print(f"second / first: {warm / cold:.2f}")


if __name__ == "__main__":
    main()
