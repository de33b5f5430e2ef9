"""SGLang-compatible JAX/Pallas serving backend for Qwen3.5-class hybrid MoE models."""

import os

__version__ = "0.1.0"

# XLA:CPU's multi-threaded Eigen pool can wedge (every thread parked, the result never
# ready) on this model's graphs under jax 0.10; single-threaded Eigen avoids it. The flag only
# affects the CPU backend and is read when the backend starts, so setting it on import of the
# package (before any computation) is enough. Set XLA_FLAGS yourself to override.
if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    ).strip()
