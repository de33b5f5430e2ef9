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

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.kernels.tpu_compile import CompileReport, abstract, compile_for_tpu
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.model_executor import verify
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
        if spec.mode.is_verify():
            return verify.forward_verify(params, cache, batch, cfg, impl)
        return qwen3_5_moe.forward(params, cache, batch, cfg, impl)

    return compile_for_tpu(step, (params, cache, batch), mesh, donate_argnums=(1,))


def compile_dp_step(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *, dtype: Any = jnp.bfloat16,
                    fp8_experts: bool = False, kv_dtype: Any = jnp.bfloat16,
                    state_dtype: Any = jnp.float32, impl: str = "pallas",
                    num_microbatches: int = 2, compiler_options: dict | None = None,
                    redundant_experts: int = 0) -> CompileReport:
    """Compile the DP x EP step (``parallel/dp_forward.py``) over every device of ``mesh``.
    ``redundant_experts``: EPLB's extra physical expert slots per MoE layer (and their maps).

    ``spec`` is per DP rank (bucket, pages and slots of one rank); the global arrays are the
    ranks' concatenation, placed as DPForward places them. Memory figures are per device. A
    TARGET_VERIFY spec compiles the verify forward (``DPForward.verify``: logits of every
    row and the GDN states after each position).
    """
    from sglang_tpu_backend.parallel.dp_forward import DPForward
    from sglang_tpu_backend.parallel.mesh import EPContext

    dp = DPForward(cfg, mesh, impl=impl, ep=EPContext(num_microbatches=num_microbatches))
    D = dp.dp_size
    slots = cfg.num_experts + redundant_experts if redundant_experts else None
    shapes = param_shapes(cfg, dtype, fp8_experts=fp8_experts, num_physical_experts=slots)
    params = abstract_params(shapes, mesh, dp.param_specs(shapes))
    cache = _abstract_dp_cache(cfg, spec, dp, kv_dtype, state_dtype)
    local = abstract_batch(spec, mesh)
    batch = jax.tree.map(lambda a, p: abstract((a.shape[0] * D, *a.shape[1:]), a.dtype, mesh, p),
                         local, dp.batch_specs(spec.mode))
    step = dp._global_verify if spec.mode.is_verify() else dp._global_step
    return compile_for_tpu(step, (params, cache, batch), mesh, donate_argnums=(1,),
                           compiler_options=compiler_options)


def compile_dp_verify_with_mtp(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *,
                               num_steps: int, dtype: Any = jnp.bfloat16,
                               fp8_experts: bool = False, kv_dtype: Any = jnp.bfloat16,
                               state_dtype: Any = jnp.float32, impl: str = "pallas"
                               ) -> CompileReport:
    """Compile a whole NEXTN verify step of the DP x EP model as one program: the TARGET_VERIFY
    forward with hidden states, the commit of the accepted positions, and the MTP pass with its
    chain of ``num_steps`` drafts (``nextn_step.mtp_drafts``) on the MTP params and MTP KV
    pages (the model dtype, with ``S`` scratch pages per request row as the engine allocates).
    The engine runs these as separate programs with the verify sampler between; here greedy
    argmax tokens and every draft accepted stand in for it, so the program holds everything
    a verify step keeps resident at once. ``spec`` is per DP rank, T = R * (num_steps + 1)."""
    from sglang_tpu_backend.mem_cache.page_pool import pages_for
    from sglang_tpu_backend.model_executor.nextn_step import MtpInputs
    from sglang_tpu_backend.models.mtp import init_mtp_cache
    from sglang_tpu_backend.models.param_shapes import mtp_param_shapes
    from sglang_tpu_backend.parallel.dp_forward import DPForward
    from sglang_tpu_backend.parallel.mesh import EPContext, rank_spec

    dp = DPForward(cfg, mesh, impl=impl, ep=EPContext())
    D, R, T, n = dp.dp_size, spec.num_seqs, spec.num_tokens, num_steps + 1
    shapes = param_shapes(cfg, dtype, fp8_experts=fp8_experts)
    params = abstract_params(shapes, mesh, dp.param_specs(shapes))
    mtp_shapes = mtp_param_shapes(cfg, dtype, fp8_experts=fp8_experts)
    mtp_params = abstract_params(mtp_shapes, mesh, dp.mtp_param_specs(mtp_shapes))
    cache = _abstract_dp_cache(cfg, spec, dp, kv_dtype, state_dtype)
    scratch = pages_for(num_steps, spec.page_size) + 1
    mtp_cache = jax.eval_shape(lambda: init_mtp_cache(
        cfg, num_pages=D * (spec.num_pages + R * scratch), page_size=spec.page_size,
        kv_dtype=dtype))
    by_rank = rank_spec(dp.ep, 0)
    mtp_cache = abstract(mtp_cache.shape, mtp_cache.dtype, mesh, rank_spec(dp.ep, 1))
    local = abstract_batch(spec, mesh)
    batch = jax.tree.map(lambda a, p: abstract((a.shape[0] * D, *a.shape[1:]), a.dtype, mesh, p),
                         local, dp.batch_specs(spec.mode))
    i32 = lambda *shape: abstract((D * shape[0], *shape[1:]), jnp.int32, mesh, by_rank)  # noqa: E731
    inp = MtpInputs(next_ids=i32(T), from_sampled=i32(T), draft_rows=i32(R),
                    page_table=i32(R, spec.pages_per_seq + scratch))

    def step(params, mtp_params, cache, mtp_cache, batch, inp):
        logits, cache, states, hidden = dp._global_verify(params, cache, batch, with_hidden=True)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(D * R, n)
        accepted_len = jnp.full((D * R,), n, jnp.int32)
        cache = dp._global_commit(params, cache, states, batch.state_slots, accepted_len)
        drafts, mtp_cache = dp._global_mtp(params, mtp_params, mtp_cache, batch, hidden, inp,
                                           tokens, accepted_len, num_steps)
        return drafts, cache, mtp_cache

    return compile_for_tpu(step, (params, mtp_params, cache, mtp_cache, batch, inp), mesh,
                           donate_argnums=(2, 3))


def _abstract_dp_cache(cfg: ModelConfig, spec: StepSpec, dp: Any, kv_dtype: Any,
                       state_dtype: Any) -> qwen3_5_moe.ModelCache:
    """The DP ranks' caches (``spec``'s pools per rank) as abstract arrays placed like DPForward's."""
    D = dp.dp_size
    cache = jax.eval_shape(lambda: qwen3_5_moe.init_cache(
        cfg, num_pages=spec.num_pages * D, page_size=spec.page_size,
        num_state_slots=spec.num_state_slots * D, kv_dtype=kv_dtype, state_dtype=state_dtype))
    return jax.tree.map(lambda s, p: abstract(s.shape, s.dtype, dp.mesh, p), cache,
                        dp.cache_specs(kv_scales=cache.kv_scales is not None))


def compile_dp_handover(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *, install: bool,
                        kv_dtype: Any = jnp.bfloat16, state_dtype: Any = jnp.float32
                        ) -> CompileReport:
    """Compile the handover's install (``install``) or export program
    (``model_executor/state_transfer.py``) for one request of ``spec.pages_per_seq`` pages
    over the DP x EP caches of ``mesh`` (``spec``'s pools per rank)."""
    from sglang_tpu_backend.model_executor.state_transfer import StateTransfer, page_bucket
    from sglang_tpu_backend.parallel.dp_forward import DPForward
    from sglang_tpu_backend.parallel.mesh import rank_spec

    dp = DPForward(cfg, mesh)
    transfer = StateTransfer(spec.num_pages, spec.num_state_slots, dp)
    cache = _abstract_dp_cache(cfg, spec, dp, kv_dtype, state_dtype)
    D, B, ranks = dp.dp_size, page_bucket(spec.pages_per_seq), rank_spec(dp.ep, 0)

    def per_rank(shape, dtype):  # one request's block on every rank: [D, *shape]
        return abstract((D, *shape), dtype, mesh, ranks)

    pages, slot = per_rank((B,), jnp.int32), per_rank((), jnp.int32)
    if not install:
        return compile_for_tpu(transfer.export_program, (cache, pages, slot), mesh)
    kv, conv, rec = cache.kv_pages, cache.conv_state, cache.rec_state
    state = (per_rank((kv.shape[0], B, *kv.shape[2:]), kv.dtype),
             per_rank((conv.shape[0], *conv.shape[2:]), conv.dtype),
             per_rank((rec.shape[0], *rec.shape[2:]), rec.dtype))
    return compile_for_tpu(transfer.install_program, (cache, *state, pages, slot), mesh,
                           donate_argnums=(0,))


def compile_dp_mtp_handover(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *, install: bool,
                            kv_dtype: Any = jnp.bfloat16) -> CompileReport:
    """Compile the NEXTN handover's MTP KV install (``install``) or export program
    (``StateTransfer.mtp_install_program`` / ``mtp_export_program``) for one request of
    ``spec.pages_per_seq`` pages over the DP ranks' MTP pools of ``mesh`` (``spec.num_pages``
    per rank, split on the page axis as ``DPForward.init_mtp_cache`` places them)."""
    from sglang_tpu_backend.model_executor.state_transfer import StateTransfer, page_bucket
    from sglang_tpu_backend.models.mtp import init_mtp_cache
    from sglang_tpu_backend.parallel.dp_forward import DPForward
    from sglang_tpu_backend.parallel.mesh import rank_spec

    dp = DPForward(cfg, mesh)
    transfer = StateTransfer(spec.num_pages, spec.num_state_slots, dp)
    D, B, ranks = dp.dp_size, page_bucket(spec.pages_per_seq), rank_spec(dp.ep, 0)
    shape = jax.eval_shape(lambda: init_mtp_cache(cfg, num_pages=D * spec.num_pages,
                                                  page_size=spec.page_size, kv_dtype=kv_dtype))
    pool = abstract(shape.shape, shape.dtype, mesh, rank_spec(dp.ep, 1))
    pages = abstract((D, B), jnp.int32, mesh, ranks)
    if not install:
        return compile_for_tpu(transfer.mtp_export_program, (pool, pages), mesh)
    kv = abstract((D, shape.shape[0], B, *shape.shape[2:]), shape.dtype, mesh, ranks)
    return compile_for_tpu(transfer.mtp_install_program, (pool, kv, pages), mesh,
                           donate_argnums=(0,))


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
                         tp.cache_specs(kv_scales=cache.kv_scales is not None))
    return compile_for_tpu(tp._global_step, (params, cache, abstract_batch(spec, mesh)), mesh,
                           donate_argnums=(1,))


def compile_tp_verify_with_mtp(cfg: ModelConfig, spec: StepSpec, mesh: Mesh, *,
                               num_steps: int, dtype: Any = jnp.bfloat16,
                               fp8_experts: bool = False, kv_dtype: Any = jnp.bfloat16,
                               state_dtype: Any = jnp.float32, impl: str = "pallas"
                               ) -> CompileReport:
    """``compile_dp_verify_with_mtp`` for the tensor-parallel-attention step: the TARGET_VERIFY
    forward with hidden states, the commit and the MTP pass with its chain of ``num_steps``
    drafts (``TPForward``'s programs, the MTP layer's params and KV pages split by heads) as
    one program. ``spec`` is the whole batch and pool, T = R * (num_steps + 1)."""
    from sglang_tpu_backend.mem_cache.page_pool import pages_for
    from sglang_tpu_backend.model_executor.nextn_step import MtpInputs
    from sglang_tpu_backend.models.param_shapes import mtp_param_shapes
    from sglang_tpu_backend.parallel.tp_forward import TPForward

    tp = TPForward(cfg, mesh, impl=impl)
    R, T, n = spec.num_seqs, spec.num_tokens, num_steps + 1
    shapes = jax.eval_shape(tp.tp_params, param_shapes(cfg, dtype, fp8_experts=fp8_experts))
    params = abstract_params(shapes, mesh, tp.param_specs(shapes))
    mtp_shapes = jax.eval_shape(tp.tp_params, mtp_param_shapes(cfg, dtype, fp8_experts=fp8_experts))
    mtp_params = abstract_params(mtp_shapes, mesh, tp.param_specs(mtp_shapes, expert_axis=0))
    cache = jax.eval_shape(lambda: tp.init_cache(
        num_pages=spec.num_pages, page_size=spec.page_size, num_state_slots=spec.num_state_slots,
        kv_dtype=kv_dtype, state_dtype=state_dtype))
    cache = jax.tree.map(lambda s, p: abstract(s.shape, s.dtype, mesh, p), cache,
                         tp.cache_specs(kv_scales=cache.kv_scales is not None))
    scratch = pages_for(num_steps, spec.page_size) + 1
    mtp_cache = jax.eval_shape(lambda: tp.init_mtp_cache(
        num_pages=spec.num_pages + R * scratch, page_size=spec.page_size, kv_dtype=dtype))
    mtp_cache = abstract(mtp_cache.shape, mtp_cache.dtype, mesh, tp.mtp_cache_spec())
    batch = abstract_batch(spec, mesh)
    i32 = lambda *shape: abstract(shape, jnp.int32, mesh)  # noqa: E731
    inp = MtpInputs(next_ids=i32(T), from_sampled=i32(T), draft_rows=i32(R),
                    page_table=i32(R, spec.pages_per_seq + scratch))

    def step(params, mtp_params, cache, mtp_cache, batch, inp):
        logits, cache, states, hidden = tp._global_verify(params, cache, batch, with_hidden=True)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(R, n)
        accepted_len = jnp.full((R,), n, jnp.int32)
        cache = tp._global_commit(params, cache, states, batch.state_slots, accepted_len)
        drafts, mtp_cache = tp._global_mtp(params, mtp_params, mtp_cache, batch, hidden, inp,
                                           tokens, accepted_len, num_steps)
        return drafts, cache, mtp_cache

    return compile_for_tpu(step, (params, mtp_params, cache, mtp_cache, batch, inp), mesh,
                           donate_argnums=(2, 3))
