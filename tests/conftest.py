"""Test-wide settings, applied before jax starts a backend, and the suite's markers.

Two legs run this suite. CI and development machines run it on the CPU (``tests/run.sh``:
``JAX_PLATFORMS=cpu``, kernels in Pallas interpret mode). The TPU leg (``tests/run_tpu.sh``)
runs it on a chip, in one process: ``JAX_PLATFORMS=tpu,cpu`` and ``STB_INTERPRET_ON_CHIP=1``,
so every kernel test case written for interpret mode runs compiled by Mosaic on the chip.

On the chip, f32 matmuls at JAX's default precision run as one bf16 pass (about three
significant digits). A test that compares f32 results with a tolerance derived for f32
arithmetic asks for f32 matmuls itself (``jax.default_matmul_precision("highest")`` around
the whole model, as test_model_on_kernels and the chip parity tests do; the kernels and
references pass ``precision=HIGHEST`` on their f32 dots). The leg does not set it process-wide:
measured on a v5e, a process-wide "highest" made the bf16 cases of the grouped matmul and
attention kernels fail and the bf16 engine fail to start (bf16 dots inside Mosaic kernels
given HIGHEST). Markers:

  jax_versions  also run on the second jax version's leg (Python 3.12, jax 0.12).
  cpu_only      about the CPU (simulated devices, XLA:CPU paths, the interpreter): skipped on
                the TPU leg.
  chip          needs a TPU chip: skipped on every other machine (CI has none).
"""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ON_TPU_LEG = "tpu" in os.environ["JAX_PLATFORMS"].split(",")


def on_chip() -> bool:
    """Whether this process's default backend is a TPU (the TPU leg)."""
    if not ON_TPU_LEG:
        return False
    import jax

    return jax.default_backend() == "tpu"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "jax_versions: also run on the second jax version's leg (tests/run.sh: Python 3.12, "
        "jax 0.12). Marks what can differ between jax versions, the Pallas kernels in interpret "
        "mode (at least one test per kernel), the multi-device collectives and the model "
        "forward; the other shapes and cases of the same code run on the main leg only.")
    config.addinivalue_line(
        "markers", "cpu_only(reason): a fact of the CPU leg; skipped on the TPU leg.")
    config.addinivalue_line(
        "markers", "chip: needs a TPU chip (tests/run_tpu.sh); skipped without one.")


def pytest_collection_modifyitems(config, items):
    chip = on_chip()
    for item in items:
        if chip and (m := item.get_closest_marker("cpu_only")) is not None:
            why = m.kwargs.get("reason") or (m.args[0] if m.args else "a CPU fact")
            item.add_marker(pytest.mark.skip(reason=f"CPU leg only: {why}"))
        if not chip and item.get_closest_marker("chip") is not None:
            item.add_marker(pytest.mark.skip(reason="needs a TPU chip (tests/run_tpu.sh)"))
