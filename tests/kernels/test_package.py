"""Our top-level ``kernels`` package is the one imported, and transformers does not mistake it
for the unrelated PyPI ``kernels`` (hub kernels) package."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

import kernels
from kernels import dispatch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.jax_versions  # cheap: all of them on the jax 0.12 leg too


def test_kernels_is_this_repository():
    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"


def test_transformers_does_not_see_a_hub_kernels_package():
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
