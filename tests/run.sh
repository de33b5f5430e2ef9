#!/usr/bin/env bash
# Set up the test environments and run the whole suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh --test
export JAX_PLATFORMS=cpu
.venv/bin/python -m pytest -q -ra tests "$@"
# The kernels, the model and the multi-device step on jax 0.12 / Python 3.12 as well (no torch: the
# transformers-parity tests skip themselves).
if [ -x .venv312/bin/python ]; then
  .venv312/bin/python -m pytest -q -ra tests/kernels tests/model tests/parallel "$@"
fi
