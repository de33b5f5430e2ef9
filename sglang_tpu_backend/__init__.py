"""SGLang-compatible JAX/Pallas serving backend for Qwen3.5-class hybrid MoE models."""

import os

__version__ = "0.1.0"


def _configure_xla_cpu() -> None:
    """Work around XLA:CPU hangs seen with jax 0.10 on small (2-core) hosts.

    Symptom: a step's result never becomes ready and every runtime thread is parked (one
    worker of the async-dispatch pool waits forever on an input's readiness). Single-threaded
    Eigen and synchronous CPU dispatch avoid both variants we saw. Both settings only affect
    the CPU backend and must be in place before it starts, which importing this package
    (before any computation) guarantees. Set XLA_FLAGS / JAX_CPU_ENABLE_ASYNC_DISPATCH
    yourself to override.
    """
    if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        ).strip()
    if "JAX_CPU_ENABLE_ASYNC_DISPATCH" not in os.environ:
        os.environ["JAX_CPU_ENABLE_ASYNC_DISPATCH"] = "false"
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)


_configure_xla_cpu()
