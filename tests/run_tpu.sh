#!/usr/bin/env bash
# The TPU leg: the kernel tests, the model on the kernels and the engine, on a TPU chip, in one
# process (a chip takes one process at a time).
#   bash tests/run_tpu.sh              the whole leg
#   bash tests/run_tpu.sh -k gdn       pytest arguments are passed on
# Every kernel test case written for interpret mode runs compiled by Mosaic and executed on the
# chip (STB_INTERPRET_ON_CHIP=1, kernels/dispatch.py); f32 comparisons run at the "highest"
# matmul precision (tests/conftest.py); tests about the CPU (marker cpu_only) skip, tests that
# need a chip (marker chip, tests/chip/) run. Without a TPU the chip tests skip: this leg is not
# part of CI (tests/run.sh), which has no chip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export JAX_PLATFORMS=tpu,cpu STB_INTERPRET_ON_CHIP=1
exec "$PY" -m pytest -q -ra --durations=15 tests/kernels tests/model/test_model_on_kernels.py \
  tests/chip "$@"
