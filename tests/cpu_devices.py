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
