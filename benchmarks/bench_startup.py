"""Start-up time of the server on the embedded default: launch to ``/health`` answering,
warm-up (every step program compiled) included; first with an empty compilation cache, then
again with the cache the first start filled.

    JAX_PLATFORMS=cpu python benchmarks/bench_startup.py
    JAX_PLATFORMS=cpu python benchmarks/bench_startup.py --ray   # `serve run ray_app:app`

With ``--ray`` the command is the Ray Serve application (a local Ray cluster, the ingress and
one engine replica) and the time runs to its first answered ``/generate``.

``--runs N`` repeats the pair with a fresh cache each time and prints every run and the
medians, with their ratios to the targets: cold 45 s for the standalone server and 60 s
through Ray on a 2-core CPU; warm 30 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def _answers(port: int, ray: bool) -> bool:
    if not ray:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    body = json.dumps({"text": "Hello", "sampling_params": {"max_new_tokens": 4}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status == 200


def time_to_health(cache_dir: str, extra: list[str], timeout: float, ray: bool = False) -> float:
    """Seconds from spawning the server to it answering (``GET /health`` 200, or with ``ray``
    a ``/generate`` answered through the Serve ingress)."""
    port = 8000 if ray else _free_port()  # `serve run` serves on 8000 (it must be free)
    env = dict(os.environ)
    if ray:
        cmd = [os.path.join(os.path.dirname(sys.executable), "serve"), "run", "ray_app:app",
               f"compilation_cache_dir={cache_dir}", "log_level=warning", *extra]
    else:
        cmd = [sys.executable, "-m", "sglang_tpu_backend.launch_server", "--port", str(port),
               "--compilation-cache-dir", cache_dir, "--log-level", "warning", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if _answers(port, ray):
                    return time.perf_counter() - t0
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"no answer within {timeout} s")
    finally:
        os.killpg(proc.pid, signal.SIGINT if ray else signal.SIGTERM)  # serve run shuts Ray down on ^C
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--ray", action="store_true", help="time `serve run ray_app:app` instead")
    ap.add_argument("--runs", type=int, default=1, help="cold + warm pairs (median reported)")
    ap.add_argument("server_args", nargs="*", help="extra launch_server flags (after --)")
    args = ap.parse_args()
    colds, warms = [], []
    for k in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="stb-jax-cache-") as cache:
            colds.append(time_to_health(cache, args.server_args, args.timeout, args.ray))
            warms.append(time_to_health(cache, args.server_args, args.timeout, args.ray))
        print(f"run {k + 1}: first start {colds[-1]:6.1f} s, second start {warms[-1]:6.1f} s", flush=True)
    cold, warm = statistics.median(colds), statistics.median(warms)
    target = 60 if args.ray else 45
    print(f"first start (empty compilation cache), median of {args.runs}: {cold:6.1f} s   "
          f"target {target} s: {cold / target:.2f}x")
    print(f"second start (cache filled), median of {args.runs}:           {warm:6.1f} s   "
          f"target 30 s: {warm / 30:.2f}x")
    print(f"second / first: {warm / cold:.2f}")


if __name__ == "__main__":
    main()
