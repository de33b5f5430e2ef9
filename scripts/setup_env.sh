#!/usr/bin/env bash
# Create (or update) the project's virtual environments.
#   scripts/setup_env.sh          runtime env .venv (Python 3.11, jax 0.10.2, Ray Serve for ray_app/)
#   scripts/setup_env.sh --test   + test extras, the ray extra (Ray Serve, ray_app/), CPU torch (the transformers reference), the
#                                 sglang frontend package, libtpu (compile-only TPU7x target for
#                                 tests/tpu), the bench extra (matplotlib, aiohttp), Debian's
#                                 prometheus package (tests/monitoring), and .venv312
#                                 (Python 3.12, jax 0.12)
#   scripts/setup_env.sh --test --no-py312   all of that but .venv312
#   scripts/setup_env.sh --py312  only .venv312 (tests/run.sh builds it beside the first tests)
set -euo pipefail
cd "$(dirname "$0")/.."

setup_py312() {  # .venv312, when a Python 3.12 is found
  # Python 3.12 may only be installed under pyenv without being on the global path.
  local py312=${PYTHON312:-python3.12}
  if ! "$py312" --version >/dev/null 2>&1; then
    py312=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
  fi
  if [ -n "$py312" ] && "$py312" --version >/dev/null 2>&1; then
    [ -x .venv312/bin/python ] || "$py312" -m venv .venv312
    .venv312/bin/python -m pip install -q --upgrade pip
    .venv312/bin/pip install -q -e ".[test]"
  fi
}

# Flags in any order: --test, --no-py312 (with --test), --py312 (alone: only .venv312).
TEST=0 NO_PY312=0
for flag in "$@"; do
  case $flag in
    --py312) setup_py312; exit 0;;
    --test) TEST=1;;
    --no-py312) NO_PY312=1;;
    *) echo "setup_env.sh: unknown flag $flag (--test, --no-py312, --py312)" >&2; exit 2;;
  esac
done
PY=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "$TEST" != 1 ]; then
  .venv/bin/pip install -q -e ".[ray]"
  exit 0
fi
# torch 2.13.0 is the CPU build that installs offline on Python 3.11.
.venv/bin/pip install -q -e ".[test,tpu,bench,ray]" "torch==2.13.0"
# A real Prometheus and promtool for tests/monitoring (Debian's package), only if missing.
if ! [ -x /usr/bin/prometheus ] || ! [ -x /usr/bin/promtool ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null
fi
# The SGLang frontend (sgl.RuntimeEndpoint) for the compatibility tests. Its server-side
# dependency pins (a CUDA torch among them) are not wanted, so: --no-deps plus what
# `import sglang` needs.
.venv/bin/pip install -q --no-deps "sglang==0.5.23"
.venv/bin/pip install -q orjson psutil pybase64 triton pillow msgspec pyzmq ipython aiohttp 2>&1 \
  | grep -v "requires" || true
[ "$NO_PY312" = 1 ] || setup_py312
