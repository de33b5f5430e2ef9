#!/usr/bin/env bash
# The TPU leg: the kernel tests, the model on the kernels and the engine, on a TPU chip, in one
# process per part (a chip takes one process at a time).
#   bash tests/run_tpu.sh                  every part, one after another
#   bash tests/run_tpu.sh attention        one part: kernels (GDN, GDN verify, grouped matmul,
#                                          routing, collectives, package: 206 s on a v5e),
#                                          attention (ragged paged attention: 257 s), engine (the
#                                          model on the kernels, the engine's start and
#                                          generation, refit, release and resume on the
#                                          chip), parity (greedy f32 tokens
#                                          against the CPU's, two architectures); engine and
#                                          parity together took about 570 s, hence two parts
#   bash tests/run_tpu.sh kernels -k gdn   pytest arguments after the part are passed on
# Passed tests' output is shown (-rP): the parity figures and the RL release bytes land in the log.
# Every kernel test case written for interpret mode runs compiled by Mosaic and executed on the
# chip (STB_INTERPRET_ON_CHIP=1, kernels/dispatch.py); tests about the CPU (marker cpu_only)
# skip, tests that need a chip (marker chip, tests/chip/) run; tests that compare f32 results
# set the matmul precision they mean (tests/conftest.py). Without a TPU the chip tests skip:
# this leg is not part of CI (tests/run.sh), which has no chip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export JAX_PLATFORMS=${JAX_PLATFORMS-tpu,cpu} STB_INTERPRET_ON_CHIP=1
KERNELS=(tests/kernels/test_gdn.py tests/kernels/test_gdn_verify.py tests/kernels/test_gmm.py
         tests/kernels/test_routing.py tests/kernels/test_collectives.py tests/kernels/test_package.py)
ATTENTION=(tests/kernels/test_ragged_paged_attention.py)
ENGINE=(tests/model/test_model_on_kernels.py tests/chip -k "not test_greedy_f32_tokens_equal_the_cpus")
PARITY=(tests/chip/test_engine_on_chip.py -k test_greedy_f32_tokens_equal_the_cpus)
part=all
case "${1:-}" in kernels|attention|engine|parity|all) part=$1; shift;; esac
run() { "$PY" -m pytest -q -raP -p no:cacheprovider --durations=10 "$@"; }
case $part in
  kernels) run "${KERNELS[@]}" "$@";;
  attention) run "${ATTENTION[@]}" "$@";;
  engine) run "${ENGINE[@]}" "$@";;
  parity) run "${PARITY[@]}" "$@";;
  all) status=0
       for p in kernels attention engine parity; do bash "$0" "$p" "$@" || status=1; done
       exit $status;;
esac
