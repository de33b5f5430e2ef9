#!/usr/bin/env bash
# Set up the test environments and run the whole suite (what CI runs).
#   bash tests/run.sh                 every test directory, each in its own pytest process
#   bash tests/run.sh tests/engine -k x   only what is named, in one process
# One process per directory: a single process accumulating every compiled program of the suite
# crashed inside an XLA:CPU compile late in the run (see max_map_count below); separate
# processes keep each one's state bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh --test
export JAX_PLATFORMS=cpu
# XLA:CPU maps every compiled program's code into its own memory mappings: one engine test
# process compiles thousands of programs and passes 20,000 mappings within minutes, on the way to
# Linux's default limit of 65,530 (a whole-suite process crossed it and an XLA:CPU compile
# segfaulted). Raise it where allowed (root).
if [ -w /proc/sys/vm/max_map_count ] && [ "$(cat /proc/sys/vm/max_map_count)" -lt 1048576 ]; then
  echo 1048576 > /proc/sys/vm/max_map_count || true
fi

run_dirs() {  # python, then test directories: one pytest process each; fails if any fails
  local py=$1 status=0
  shift
  for d in "$@"; do
    compgen -G "$d/test_*.py" >/dev/null || continue  # e.g. __pycache__/
    echo "== $d ($py)"
    "$py" -m pytest -q -ra "$d" || status=1
  done
  return $status
}

if [ $# -gt 0 ]; then
  .venv/bin/python -m pytest -q -ra "$@"
  exit
fi
status=0
run_dirs .venv/bin/python tests/*/ || status=1
# The kernels and the model on jax 0.12 / Python 3.12 as well (no torch: the transformers-parity
# tests skip themselves). tests/parallel runs on the main leg only (its jax 0.12 run cost
# 1.8 minutes of a CI budget of 40 on 2 cores).
if [ -x .venv312/bin/python ]; then
  run_dirs .venv312/bin/python tests/kernels tests/model || status=1
fi
exit $status
