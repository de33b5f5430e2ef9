#!/usr/bin/env bash
# Set up the test environments and run the whole suite (what CI runs).
#   bash tests/run.sh                 every test directory, each in its own pytest process
#   bash tests/run.sh tests/engine -k x   only what is named, in one process
# One process per directory: a single process accumulating every compiled program of the suite
# crashed inside an XLA:CPU compile late in the run (see max_map_count below); separate
# processes keep each one's state bounded.
#
# Two lanes of directories run side by side. Most of the suite's time is XLA compiles, and an
# XLA compile (XLA:CPU's and libtpu's) runs on one thread, so one pytest process at a time
# leaves the second core of a two-core CI machine mostly idle. Each lane runs its directories
# one after another; the lanes are balanced by the directories' measured times (the slowest
# first, so the tail is the small ones). Every directory's output goes to its own log, printed
# whole at the end in lane order; a one-line status per directory is printed as it finishes.
# Ray: tests/ray_serve and tests/monitoring each start a local Ray cluster (and Prometheus);
# they share lane B so that two clusters never run at once. Everything else binds free ports.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh --test --no-py312  # .venv312: below, beside the first tests
export JAX_PLATFORMS=cpu
# XLA:CPU maps every compiled program's code into its own memory mappings: one engine test
# process compiles thousands of programs and passes 20,000 mappings within minutes, on the way to
# Linux's default limit of 65,530 (a whole-suite process crossed it and an XLA:CPU compile
# segfaulted). Raise it where allowed (root).
if [ -w /proc/sys/vm/max_map_count ] && [ "$(cat /proc/sys/vm/max_map_count)" -lt 1048576 ]; then
  echo 1048576 > /proc/sys/vm/max_map_count || true
fi

if [ $# -gt 0 ]; then
  .venv/bin/python -m pytest -q -ra "$@"
  exit
fi

LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
# .venv312 builds while the lanes start (it is first needed late in lane A).
(scripts/setup_env.sh --py312 >"$LOGS/setup312.log" 2>&1; echo $? >"$LOGS/setup312.rc") &

# The Python 3.12 / jax 0.12 leg runs only what can differ between jax versions, the tests
# marked `jax_versions` in tests/kernels and tests/model: for every Pallas kernel (attention and
# its K/V write, GDN decode and chunked, grouped matmul plain / SwiGLU / FP8 / quantised lhs,
# gather_rows, gather_reduce) at least one interpret-mode case and its XLA path, the
# multi-device collectives worker, the whole model forward on the reference and Pallas paths
# (test_model_on_kernels), and jax's layout API (test_weight_layout). The rest (the same kernels
# at more shapes, dtypes and block sizes; checkpoint loading, configs, engine-level model tests)
# repeats jax operations the marked tests already run on 0.12, so it runs on the main leg only,
# as does tests/parallel. No torch on this leg (the transformers-parity tests would skip).
LEG312=(312:tests/kernels 312:tests/model)  # skipped where no Python 3.12 is found

# Lane A: the TPU compile leg, the engine, the jax 0.12 leg and tests/parallel; lane B: the
# kernels, the model, the server and the Ray-based directories. A directory neither lane names
# (a new one) runs in lane B. Balanced by a CI run on this 2-core machine (minutes): tpu 14.6,
# engine 9.4, 3.12 leg 4.0, parallel 3.5 against kernels 12.0, model 4.1, server 1.1,
# ray_serve 15.4; with engine and model + server the other way round lane B took 38 and
# lane A 28, and the whole run 40.2. Those times are with a filled JAX compilation cache
# (<STB_CACHE_DIR>/jax-compilation-cache, which the engines of the tests write): from an
# empty one (2026-12-07, fresh clone) tests/engine and tests/ray_serve, side by side, took
# 30.0 and 30.4 minutes (about 8 and 16 filled), tests/model 8.6 (3.4), tests/tpu 24.5
# (20.1), and the whole run 62.7. Running tests/engine first instead (2026-12-07, empty cache)
# did not shorten it: tests/engine alone took 28.5 minutes, and tests/ray_serve, then beside
# tests/tpu's compiles, had a request time out after 300 s (a NEXTN prefill/decode case), so
# the order stays. From an empty cache the suite is bound by its compile work, not the order.
LANE_A=(tests/tpu tests/engine tests/metrics tests/mem_cache "${LEG312[@]}" tests/parallel)
LANE_B=(tests/kernels tests/model tests/server tests/ray_serve tests/monitoring)
for d in tests/*/; do
  d=${d%/}
  [[ " ${LANE_A[*]} ${LANE_B[*]} " == *" $d "* ]] || LANE_B+=("$d")
done

run_dir() {  # [312:]directory: one pytest process; its output in $LOGS/<name>.log
  local py=.venv/bin/python d=$1 flags=() name start rc=0
  if [[ $d == 312:* ]]; then
    py=.venv312/bin/python d=${d#312:} flags=(-m jax_versions)
    while [ ! -f "$LOGS/setup312.rc" ]; do sleep 2; done
    if [ "$(cat "$LOGS/setup312.rc")" != 0 ]; then
      echo "$(date -u +%T) $1: FAILED: setting up .venv312 failed:"; cat "$LOGS/setup312.log"
      return 1
    fi
    if [ ! -x "$py" ]; then
      echo "$(date -u +%T) $1: skipped (no Python 3.12)"
      return 0
    fi
  fi
  compgen -G "$d/test_*.py" >/dev/null || return 0  # e.g. __pycache__/
  name=$(echo "$1" | tr ':/' '__')
  start=$SECONDS
  "$py" -m pytest -q -ra --durations=12 "${flags[@]}" "$d" >"$LOGS/$name.log" 2>&1 || rc=$?
  echo "$(date -u +%T) $1 ($py): $([ $rc -eq 0 ] && echo passed || echo "FAILED ($rc)") in $((SECONDS - start)) s"
  return $rc
}

run_lane() {  # directories, one after another; fails if any fails
  local status=0
  for d in "$@"; do
    run_dir "$d" || status=1
  done
  return $status
}

status=0
run_lane "${LANE_A[@]}" & lane_a=$!
run_lane "${LANE_B[@]}" & lane_b=$!
wait $lane_a || status=1
wait $lane_b || status=1
for d in "${LANE_A[@]}" "${LANE_B[@]}"; do
  name=$(echo "$d" | tr ':/' '__')
  [ -f "$LOGS/$name.log" ] || continue
  echo "== $d"
  cat "$LOGS/$name.log"
done
exit $status
