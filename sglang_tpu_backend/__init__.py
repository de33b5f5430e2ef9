"""SGLang-compatible JAX/Pallas serving backend for Qwen3.5-class hybrid MoE models.

``from sglang_tpu_backend import Engine`` gives the offline engine (as ``sglang.Engine``);
it is imported on first use, so importing the package stays light.
"""

__version__ = "0.1.0"
__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from sglang_tpu_backend.entrypoints.offline import OfflineEngine

        return OfflineEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
