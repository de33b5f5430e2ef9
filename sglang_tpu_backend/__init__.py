"""SGLang-compatible JAX/Pallas serving backend for Qwen3.5-class hybrid MoE models.

``from sglang_tpu_backend import Engine`` gives the offline engine (as ``sglang.Engine``);
it is imported on first use, so importing the package stays light.
"""

__version__ = "0.1.0"
__all__ = ["Engine"]


def _map_checkout_kernels() -> None:
    """Make the checkout's top-level ``kernels/`` folder ``sglang_tpu_backend.kernels``.

    A wheel carries the kernels as the real folder ``sglang_tpu_backend/kernels/`` (pyproject's
    package-dir). In a checkout (an editable install, or no install with the root on PYTHONPATH)
    they stay in ``<root>/kernels/``, which has no ``__init__.py`` so that it never shadows the
    PyPI ``kernels`` package that sglang and transformers import; register it here as a
    namespace package under our name.
    """
    import os
    import sys
    from importlib.machinery import ModuleSpec
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.abspath(__file__))
    checkout_kernels = os.path.join(os.path.dirname(here), "kernels")
    if os.path.isdir(os.path.join(here, "kernels")) or not os.path.isdir(checkout_kernels):
        return  # installed from a wheel: the import system finds sglang_tpu_backend/kernels/
    name = f"{__name__}.kernels"
    if name not in sys.modules:
        spec = ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [checkout_kernels]
        sys.modules[name] = module_from_spec(spec)
    globals()["kernels"] = sys.modules[name]


_map_checkout_kernels()


def __getattr__(name: str):
    if name == "Engine":
        from sglang_tpu_backend.entrypoints.offline import OfflineEngine

        return OfflineEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
