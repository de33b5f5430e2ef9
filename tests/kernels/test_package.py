"""Our kernels import as ``sglang_tpu_backend.kernels`` from this repository's kernels/ folder,
and the top-level name ``kernels`` is left to the unrelated PyPI package (Hugging Face's kernel
hub, which sglang and transformers import): transformers sees it only where it is installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import jax
import pytest

import sglang_tpu_backend.kernels
from sglang_tpu_backend.kernels import dispatch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.jax_versions  # cheap: all of them on the jax 0.12 leg too


def test_kernels_are_this_repository():
    assert [Path(p).resolve() for p in sglang_tpu_backend.kernels.__path__] == [REPO / "kernels"]
    assert Path(dispatch.__file__).resolve() == REPO / "kernels" / "dispatch.py"
    # No __init__.py: from the checkout's root kernels/ must not shadow PyPI's `kernels`.
    assert not (REPO / "kernels" / "__init__.py").exists()


def _hub_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_top_level_kernels_is_never_ours():
    """kernels/ (on sys.path through pytest's pythonpath) is at most a namespace portion: an
    installed hub ``kernels`` wins; without one, transformers does not mistake it for one."""
    spec = importlib.util.find_spec("kernels")
    if _hub_kernels_installed():
        assert spec.origin and Path(spec.origin).resolve().parent != REPO / "kernels"
        return
    assert spec is None or spec.origin in (None, "namespace")
    transformers_utils = pytest.importorskip("transformers.utils")
    assert not transformers_utils.is_kernels_available()


def test_dispatch_resolves_and_rejects():
    assert dispatch.resolve("reference") == "reference"
    on_chip = dispatch.INTERPRET_ON_CHIP and jax.default_backend() == "tpu"  # the TPU leg
    assert dispatch.resolve("interpret") == ("pallas" if on_chip else "interpret")
    assert dispatch.resolve("auto") in ("pallas", "reference")
    assert dispatch.interpret_params("reference") is False
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.resolve("cuda")
