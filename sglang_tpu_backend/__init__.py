"""SGLang-compatible JAX/Pallas serving backend for Qwen3.5-class hybrid MoE models."""

__version__ = "0.1.0"
