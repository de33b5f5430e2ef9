"""Test-wide settings, applied before jax starts a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# See sglang_tpu_backend/__init__.py: XLA:CPU's multi-threaded Eigen pool can hang.
if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    ).strip()
