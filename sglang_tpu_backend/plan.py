"""The command-line entry point ``python -m sglang_tpu_backend.plan``: the per-device memory
planner, whose code lives in :mod:`sglang_tpu_backend.planning.plan` (import from there)."""

import sys

from sglang_tpu_backend.planning.plan import main

if __name__ == "__main__":
    sys.exit(main())
