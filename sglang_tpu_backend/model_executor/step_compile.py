"""Compile one model step for a TPU target from a config alone (no weights, no TPU).

The forward the runner jits (``models.qwen3_5_moe.forward``), given abstract params, cache and
batch for one bucket, lowered and compiled by libtpu for a named topology (see
``kernels/tpu_compile.py``). Used by the TPU compile tests and by memory planning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels.tpu_compile import CompileReport, abstract, compile_for_tpu
from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.model_executor.weight_layout import weight_formats
from sglang_tpu_backend.models.param_shapes import param_shapes


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One bucket of the runner and the pools it steps over.

    mode, num_tokens (T), num_seqs (R), num_logits (L): the bucket.
    pages_per_seq: page-table width (context length / page size).
    num_pages, page_size, num_state_slots: the KV page pool and GDN state-slot pool.
    """

    mode: ForwardMode
    num_tokens: int
    num_seqs: int
    num_logits: int
    pages_per_seq: int
    num_pages: int
    page_size: int
    num_state_slots: int


def abstract_batch(spec: StepSpec, mesh: Mesh) -> ForwardBatch:
    """A ForwardBatch of abstract i32 arrays with the bucket's shapes."""
    i32 = lambda *shape: abstract(shape, jnp.int32, mesh)  # noqa: E731
    T, R = spec.num_tokens, spec.num_seqs
    return ForwardBatch(
        input_ids=i32(T), positions=i32(T), cu_q_lens=i32(R + 1), kv_lens=i32(R),
        page_table=i32(R, spec.pages_per_seq), state_slots=i32(R), num_seqs=i32(1),
        logits_indices=i32(spec.num_logits), mode=spec.mode,
    )


def abstract_params(shapes: Any, mesh: Mesh, specs: Any = None) -> Any:
    """Abstract params placed as the runner places real ones: ``specs`` (default: replicated)
    and the dense weights in their TPU-native tiling (``weight_layout.py``)."""
    specs = jax.tree.map(lambda _: PartitionSpec(), shapes) if specs is None else specs
    shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), specs)
    return jax.tree.map(lambda s, f: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=f),
                        shapes, weight_formats(shapes, shardings))


def abstract_cache(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *, kv_dtype: Any = jnp.bfloat16,
                   state_dtype: Any = jnp.float32) -> qwen3_5_moe.ModelCache:
    shapes = jax.eval_shape(lambda: qwen3_5_moe.init_cache(
        cfg, num_pages=spec.num_pages, page_size=spec.page_size,
        num_state_slots=spec.num_state_slots, kv_dtype=kv_dtype, state_dtype=state_dtype))
    return jax.tree.map(lambda s: abstract(s.shape, s.dtype, mesh), shapes)


def compile_step(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *, dtype: Any = jnp.bfloat16,
                 fp8_experts: bool = False, kv_dtype: Any = jnp.bfloat16,
                 state_dtype: Any = jnp.float32, impl: str = "pallas") -> CompileReport:
    """Compile ``forward(params, cache, batch)`` for one bucket on ``mesh`` (cache donated)."""
    params = abstract_params(param_shapes(cfg, dtype, fp8_experts=fp8_experts), mesh)
    cache = abstract_cache(cfg, spec, mesh, kv_dtype=kv_dtype, state_dtype=state_dtype)
    batch = abstract_batch(spec, mesh)

    def step(params, cache, batch):
        return qwen3_5_moe.forward(params, cache, batch, cfg, impl)

    return compile_for_tpu(step, (params, cache, batch), mesh, donate_argnums=(1,))


def compile_dp_step(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *, dtype: Any = jnp.bfloat16,
                    fp8_experts: bool = False, kv_dtype: Any = jnp.bfloat16,
                    state_dtype: Any = jnp.float32, impl: str = "pallas",
                    num_microbatches: int = 2, compiler_options: dict | None = None
                    ) -> CompileReport:
    """Compile the DP x EP step (``parallel/dp_forward.py``) over every device of ``mesh``.

    ``spec`` is per DP rank (bucket, pages and slots of one rank); the global arrays are the
    ranks' concatenation, placed as DPForward places them. Memory figures are per device.
    """
    from sglang_tpu_backend.parallel.dp_forward import DPForward
    from sglang_tpu_backend.parallel.mesh import EPContext

    dp = DPForward(cfg, mesh, impl=impl, ep=EPContext(num_microbatches=num_microbatches))
    D = dp.dp_size
    shapes = param_shapes(cfg, dtype, fp8_experts=fp8_experts)
    params = abstract_params(shapes, mesh, dp.param_specs(shapes))
    glob = dataclasses.replace(spec, num_pages=spec.num_pages * D,
                               num_state_slots=spec.num_state_slots * D)
    cache = jax.eval_shape(lambda: qwen3_5_moe.init_cache(
        cfg, num_pages=glob.num_pages, page_size=spec.page_size,
        num_state_slots=glob.num_state_slots, kv_dtype=kv_dtype, state_dtype=state_dtype))
    cache = jax.tree.map(lambda s, p: abstract(s.shape, s.dtype, mesh, p), cache,
                         dp.cache_specs())
    local = abstract_batch(spec, mesh)
    batch = jax.tree.map(lambda a, p: abstract((a.shape[0] * D, *a.shape[1:]), a.dtype, mesh, p),
                         local, dp.batch_specs(spec.mode))
    return compile_for_tpu(dp._global_step, (params, cache, batch), mesh, donate_argnums=(1,),
                           compiler_options=compiler_options)


def compile_tp_step(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *, dtype: Any = jnp.bfloat16,
                    fp8_experts: bool = False, kv_dtype: Any = jnp.bfloat16,
                    state_dtype: Any = jnp.float32, impl: str = "pallas") -> CompileReport:
    """Compile the tensor-parallel-attention step (``parallel/tp_forward.py``) over every
    device of ``mesh``. ``spec`` is the whole batch and pool (every device runs every request);
    memory figures are per device."""
    from sglang_tpu_backend.parallel.tp_forward import TPForward

    tp = TPForward(cfg, mesh, impl=impl)
    shapes = jax.eval_shape(tp.tp_params, param_shapes(cfg, dtype, fp8_experts=fp8_experts))
    params = abstract_params(shapes, mesh, tp.param_specs(shapes))
    cache = jax.eval_shape(lambda: tp.init_cache(
        num_pages=spec.num_pages, page_size=spec.page_size, num_state_slots=spec.num_state_slots,
        kv_dtype=kv_dtype, state_dtype=state_dtype))
    cache = jax.tree.map(lambda s, p: abstract(s.shape, s.dtype, mesh, p), cache,
                         tp.cache_specs())
    return compile_for_tpu(tp._global_step, (params, cache, abstract_batch(spec, mesh)), mesh,
                           donate_argnums=(1,))
