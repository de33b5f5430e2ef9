"""The command-line entry points the README shows keep working after modules move.

``python -m sglang_tpu_backend.plan`` is the planner's public command (its code lives in
``planning/plan.py``; ``sglang_tpu_backend/plan.py`` only calls its main), and every other
``python -m sglang_tpu_backend.X`` the README or the package's docstrings name must be a module
that exists.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_entry_point_prints_usage():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "sglang_tpu_backend.plan", "--help"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m sglang_tpu_backend.plan")
    assert "--topology" in out.stdout and "--compile" in out.stdout


def test_documented_module_commands_exist():
    pattern = re.compile(r"-m (sglang_tpu_backend(?:\.\w+)+)")
    sources = [ROOT / "README.md", *sorted((ROOT / "sglang_tpu_backend").rglob("*.py")),
               *sorted((ROOT / "benchmarks").rglob("*.py"))]
    named = {m for p in sources for m in pattern.findall(p.read_text())}
    assert "sglang_tpu_backend.plan" in named
    missing = sorted(m for m in named if importlib.util.find_spec(m) is None)
    assert not missing, f"documented `python -m` modules that do not exist: {missing}"
