"""Test-wide settings, applied before jax starts a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sglang_tpu_backend  # noqa: E402,F401  (configures XLA:CPU; see its __init__)
