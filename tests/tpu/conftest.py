"""TPU7x compile tests: every Pallas kernel and the model step compiled by libtpu for Ironwood.

They need ``libtpu`` (the ``tpu`` extra, installed by ``scripts/setup_env.sh --test``); without
it they skip, except under CI, where a missing compiler is an error.
"""

import os

import pytest

from sglang_tpu_backend.kernels.tpu_compile import core_mesh, libtpu_available


def pytest_collection_modifyitems(config, items):
    if libtpu_available():
        return
    if os.environ.get("CI"):
        raise pytest.UsageError("libtpu is not installed: the TPU compile leg cannot run")
    skip = pytest.mark.skip(reason="libtpu not installed (pip install -e '.[tpu]')")
    for item in items:
        if "tests/tpu" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mesh():
    """One TPU7x TensorCore."""
    return core_mesh()


_REPORTS: list[tuple[str, object]] = []


@pytest.fixture
def record():
    """``record(name, report)``: keep a CompileReport for the end-of-session table.

    Also asserts what every compile test must hold: at least one Mosaic kernel in the HLO
    (so a silent fallback to the jnp reference cannot pass) and VMEM within a TensorCore's.
    """
    from sglang_tpu_backend.kernels.tpu_compile import TPU7X_VMEM_BYTES

    def _record(name, report, *, min_kernels=1):
        _REPORTS.append((name, report))
        assert len(report.kernels) >= min_kernels, (
            f"{name}: expected >= {min_kernels} Mosaic kernels in the compiled HLO, "
            f"found {len(report.kernels)}")
        for k in report.kernels:
            assert k.vmem_used_bytes <= TPU7X_VMEM_BYTES, (name, k)
            assert k.vmem_limit_bytes <= TPU7X_VMEM_BYTES, (name, k)
        return report

    return _record


def pytest_terminal_summary(terminalreporter):
    if not _REPORTS:
        return
    terminalreporter.section("TPU7x compile reports (per device)")
    for name, report in _REPORTS:
        terminalreporter.write_line(f"{name}: {report.summary()}")
