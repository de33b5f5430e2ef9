"""The project's import names: what a wheel installs, and how the kernels import.

The wheel's top-level import names are exactly ``sglang_tpu_backend`` and ``ray_app``. The
repository's top-level kernels/ folder imports as ``sglang_tpu_backend.kernels`` and never as a
top-level ``kernels``, the PyPI package of Hugging Face's kernel hub that transformers and
sglang import (issue 39: from the checkout's root our kernels/__init__.py shadowed it and
``python -m sglang.bench_serving`` failed). A stand-in ``kernels`` package must win over the
folder from the checkout's root while our kernels import, in the three ways the project runs: an
editable install, a wheel, and a bare checkout on PYTHONPATH (the TPU test machine's way).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = {"sglang_tpu_backend", "ray_app"}
KERNELS = "sglang_tpu_backend.kernels"
SOURCES = ("pyproject.toml", "README.md", "sglang_tpu_backend", "kernels", "ray_app")


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_packages() -> set[str]:
    """Import names of the folders holding Python files under each package's source folder."""
    config = _setuptools_config()
    roots = {"sglang_tpu_backend": ROOT / "sglang_tpu_backend", "ray_app": ROOT / "ray_app"}
    roots.update({name: ROOT / folder for name, folder in config["package-dir"].items()})
    found = set()
    for name, folder in roots.items():
        for path in folder.rglob("*.py"):
            rel = path.parent.relative_to(folder)
            if "assets" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]))
    return found


def test_pyproject_lists_exactly_the_source_packages():
    config = _setuptools_config()
    packages = config["packages"]
    assert {p.split(".")[0] for p in packages} == TOP_LEVEL
    assert config["package-dir"] == {KERNELS: "kernels"}
    # A new subpackage must be added to pyproject's list, or the wheel would miss it.
    assert set(packages) == _source_packages()
    assert len(packages) == len(set(packages))
    assert not (ROOT / "kernels" / "__init__.py").exists()  # it would shadow PyPI's kernels
    assert not (ROOT / "sglang_tpu_backend" / "kernels").exists()  # the wheel's place for it


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of its sources (the checkout stays clean)."""
    try:
        import setuptools
    except ImportError:
        pytest.skip("no setuptools to build the wheel")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject's build requirement)")
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "dist"
    out.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / proc.stdout.strip().splitlines()[-1]


def test_wheel_installs_only_our_top_level_names(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top == TOP_LEVEL
    top_level_txt = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level_txt:
        listed = zipfile.ZipFile(wheel).read(top_level_txt[0]).decode().split()
        assert set(listed) == TOP_LEVEL
    kernel_files = {n.removeprefix("sglang_tpu_backend/kernels/") for n in names
                    if n.startswith("sglang_tpu_backend/kernels/")}
    assert kernel_files == {str(p.relative_to(ROOT / "kernels")) for p in (ROOT / "kernels").rglob("*.py")
                            } | {"block_tables.json"}  # the block-size table (kernels/block_tables.py)
    assert "sglang_tpu_backend/assets/tiny-qwen3.5-moe/tokenizer.json" in names


# Run in the subprocess: the stand-in `kernels` and our kernels, side by side.
PROBE = """
import json, kernels
import sglang_tpu_backend.kernels.ragged_paged_attention as rpa
from sglang_tpu_backend.kernels import dispatch
print(json.dumps({"marker": getattr(kernels, "MARKER", None), "kernels": kernels.__file__,
                  "dispatch": dispatch.__file__, "rpa": rpa.__file__,
                  "resolve": dispatch.resolve("reference")}))
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    """A directory holding a regular package ``kernels`` with a marker, as PyPI's would be."""
    path = tmp_path_factory.mktemp("stand_in")
    (path / "kernels").mkdir()
    (path / "kernels" / "__init__.py").write_text('MARKER = "stand-in"\n')
    return path


def _probe(cwd: Path, pythonpath: list[Path], no_site: bool) -> dict:
    """Run PROBE with ``python -c`` (the cwd first on sys.path, as under ``python -m``).
    no_site: skip site-packages' .pth files (so no editable-install finder) and put the
    interpreter's site-packages on PYTHONPATH instead, for the dependencies."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    paths = [str(p) for p in pythonpath]
    if no_site:
        site_dirs = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
        paths += list(dict.fromkeys(site_dirs))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, *(["-S"] if no_site else []), "-c", PROBE]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(result: dict, stand_in: Path, kernels_dir: Path):
    assert result["marker"] == "stand-in"
    assert Path(result["kernels"]).resolve() == (stand_in / "kernels" / "__init__.py").resolve()
    assert Path(result["dispatch"]).resolve() == (kernels_dir / "dispatch.py").resolve()
    assert Path(result["rpa"]).resolve() == (kernels_dir / "ragged_paged_attention" / "__init__.py").resolve()
    assert result["resolve"] == "reference"


def test_bare_checkout_from_its_root_with_a_kernels_package(stand_in):
    """No install at all: only the checkout on PYTHONPATH, run from its root."""
    _check(_probe(ROOT, [stand_in, ROOT], no_site=True), stand_in, ROOT / "kernels")


def test_this_environment_from_the_root_with_a_kernels_package(stand_in):
    """As the tests run: the editable install of scripts/setup_env.sh, where there is one."""
    _check(_probe(ROOT, [stand_in], no_site=False), stand_in, ROOT / "kernels")


def test_wheel_with_a_kernels_package(wheel, stand_in, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # what `pip install` of a pure wheel lays down
    _check(_probe(tmp_path, [stand_in, site], no_site=True), stand_in,
           site / "sglang_tpu_backend" / "kernels")
