"""Load a script of the repo (a benchmark, an example) as a module, for the tests that call
its functions: ``load_script("benchmarks/bench_load.py")``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> ModuleType:
    """The script at ``REPO / relpath`` executed as the module named by its stem, registered in
    ``sys.modules`` (its dataclasses look their module up there)."""
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
