"""Our kernels import as ``sglang_tpu_backend.kernels`` from this repository's kernels/ folder,
and the top-level name ``kernels`` is left to the unrelated PyPI package (Hugging Face's kernel
hub, which sglang and transformers import): transformers sees it only where it is installed."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

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


def test_transformers_does_not_mistake_our_folder_for_hub_kernels():
    transformers_utils = pytest.importorskip("transformers.utils")
    if _hub_kernels_installed():
        pytest.skip("Hugging Face's kernels package is installed (tests/structure covers it)")
    assert not transformers_utils.is_kernels_available()


def test_dispatch_resolves_and_rejects():
    assert dispatch.resolve("reference") == "reference"
    assert dispatch.resolve("interpret") == "interpret"
    assert dispatch.resolve("auto") in ("pallas", "reference")
    assert dispatch.interpret_params("reference") is False
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.resolve("cuda")
