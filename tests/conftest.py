"""Test-wide settings, applied before jax starts a backend, and the suite's markers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "jax_versions: also run on the second jax version's leg (tests/run.sh: Python 3.12, "
        "jax 0.12). Marks what can differ between jax versions, the Pallas kernels in interpret "
        "mode (at least one test per kernel), the multi-device collectives and the model "
        "forward; the other shapes and cases of the same code run on the main leg only.")
