"""Test-wide settings, applied before jax starts a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
