"""KV pool size from ``--mem-fraction-static``: what the weights and static buffers leave.

Per device (one DP rank, or one of the tensor-parallel devices), in bytes, with ``r`` running
requests (= GDN state slots) and ``s`` GDN snapshots per rank, V the vocabulary:

    budget      = floor(F * device_memory)
    weights     = plan.weight_bytes (replicated + this device's share of the sharded ones;
                  with NEXTN the MTP layers' too, and a page then holds their KV as well)
    state       = (r + s) * plan.gdn_slot_bytes          (conv state in --dtype, recurrence f32;
                                                          conv f32 too with an FP8 KV cache)
    penalty     = r * (4V + V + 4)                       (token counts i32, prompt mask, last token)
    activations = plan.step_activation_bytes(max_tokens_per_step) + 4 * r * V   (f32 logits)
                  speculative decoding (n = k+1 rows per request): activations of
                  max(max_tokens_per_step, r * n) tokens + 4 * r * n * V, plus the verify
                  step's per-position GDN states (about n * r * gdn_slot_bytes)
    pages       = (budget - weights - state - penalty - activations) // plan.kv_page_bytes

On a CPU a 16-bit ``--dtype`` keeps the KV pages and conv states in f32
(``config.cache_storage_dtype``); their bytes are counted so. ``--kv-cache-dtype fp8_e4m3``
counts 1 byte per KV element plus a 4-byte scale per K/V row.

The byte formulas are the TPU memory planner's (``plan.py``), so the two agree. Every running
request must be able to hold one page: while ``pages < r``, ``r`` drops by one (logged); when
even ``r = 1`` leaves no page, ValueError names the flag. ``--max-total-tokens`` caps the pool.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.config import cache_storage_dtype
from sglang_tpu_backend.kernels.ragged_paged_attention import is_quantized
from sglang_tpu_backend.planning.plan import (
    gdn_slot_bytes, kv_page_bytes, step_activation_bytes, weight_bytes)
from sglang_tpu_backend.server_args import ServerArgs

logger = logging.getLogger(__name__)
STATE_DTYPE_BYTES = 4  # the GDN recurrent state is f32 (ModelRunner's state_dtype)


@dataclasses.dataclass(frozen=True)
class PoolBudget:
    """Bytes per device and the pool sizes they give (per DP rank)."""

    device_memory: int
    mem_fraction_static: float
    budget: int
    weights: int
    state: int
    penalty: int
    activations: int
    page_bytes: int
    num_pages_per_rank: int  # before any --max-total-tokens cap
    max_running_requests_per_rank: int

    @property
    def kv_pool(self) -> int:
        return self.num_pages_per_rank * self.page_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "kv_pool": self.kv_pool}


def device_memory_bytes(args: ServerArgs) -> int:
    """``--device-memory-bytes``, else device 0's ``bytes_limit``; ValueError when neither."""
    if args.device_memory_bytes is not None:
        return args.device_memory_bytes
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(f"--mem-fraction-static: the {jax.default_backend()} device reports no "
                         "memory size; state it with --device-memory-bytes")
    return int(stats["bytes_limit"])


def size_pools(cfg: ModelConfig, args: ServerArgs, device_memory: int) -> PoolBudget:
    """The pool sizes ``args.mem_fraction_static`` of ``device_memory`` gives (``args.dtype``
    already resolved, not "auto"). Raises ValueError naming the flag when nothing fits."""
    F = args.mem_fraction_static
    b = jnp.dtype(args.dtype).itemsize
    tp, V = args.tp_size, cfg.vocab_size
    budget = int(F * device_memory)
    mtp = args.speculative_algorithm in ("NEXTN", "EAGLE")  # MTP weights and KV pages too
    replicated, sharded = weight_bytes(cfg, ep=args.ep_size, tp=tp, expert_dtype="dense",
                                       dtype=jnp.dtype(args.dtype), mtp=mtp)
    weights = replicated + sharded
    backend = jax.default_backend()
    kv_dtype = args.kv_storage_dtype(backend)
    fp8_kv = is_quantized(kv_dtype)  # scales beside the pages; conv state in the state dtype
    conv_b = STATE_DTYPE_BYTES if fp8_kv else jnp.dtype(
        cache_storage_dtype(args.dtype, backend)).itemsize
    page = kv_page_bytes(cfg, tp=tp, page_size=args.kv_page_size(backend),
                         kv_bytes=jnp.dtype(kv_dtype).itemsize, kv_scales=fp8_kv, mtp=mtp)
    slot = gdn_slot_bytes(cfg, tp=tp, conv_bytes=conv_b, state_bytes=STATE_DTYPE_BYTES)
    n = args.speculative_num_drafts + 1  # logits rows per request and step
    tokens = args.max_tokens_per_step if n == 1 else max(
        args.max_tokens_per_step, n * args.max_running_requests_per_rank)
    act_fixed = step_activation_bytes(cfg, ep=args.ep_size, tp=tp, tokens=tokens, dtype_bytes=b)

    def sized(r: int) -> PoolBudget:
        a = dataclasses.replace(args, max_running_requests=r * args.dp_size)
        state = (r + a.num_gdn_snapshots_per_rank) * slot
        penalty = r * (5 * V + 4)
        activations = act_fixed + 4 * r * n * V + (r * n * slot if n > 1 else 0)
        free = budget - weights - state - penalty - activations
        return PoolBudget(device_memory, F, budget, weights, state, penalty, activations, page,
                          max(0, free // page), r)

    r0 = args.max_running_requests_per_rank
    r = r0
    got = sized(r)
    while got.num_pages_per_rank < r and r > 1:
        r -= 1
        got = sized(r)
    if got.num_pages_per_rank < r:
        raise ValueError(
            f"--mem-fraction-static {F} of {device_memory} B device memory leaves no room for "
            f"one request: budget {budget} B, weights {weights} B, one GDN state slot + "
            f"snapshots {got.state} B, penalty state {got.penalty} B, activations "
            f"{got.activations} B, one KV page {page} B; raise --mem-fraction-static")
    if r < r0:
        logger.warning("--mem-fraction-static %s: the KV pool holds %d pages per rank, fewer than "
                       "--max-running-requests needs; running requests per rank reduced %d -> %d",
                       F, got.num_pages_per_rank, r0, r)
    return got


CPU_CONTEXT_CAP = 4096  # default context length on CPU (the reference attention reads P pages)
TPU_CONTEXT_CAP = 32768


def size_serving_args(args: ServerArgs, cfg: ModelConfig, backend: str
                      ) -> tuple[ServerArgs, PoolBudget | None]:
    """``args`` with every size resolved for ``cfg`` on ``backend``: ``page_size``
    (``ServerArgs.kv_page_size``), ``context_length`` (the
    model's, capped per backend), the pools from ``--mem-fraction-static`` when given
    (``max_total_tokens`` and ``max_running_requests`` lowered to what fits), else
    ``max_total_tokens`` = ``max_running_requests * min(context_length, 1024)``; and the
    budget (None without ``--mem-fraction-static``)."""
    args = dataclasses.replace(args, page_size=args.kv_page_size(backend))
    cap = TPU_CONTEXT_CAP if backend == "tpu" else CPU_CONTEXT_CAP
    context_length = args.context_length or min(cfg.max_position_embeddings, cap)
    budget = None
    if args.mem_fraction_static is not None:
        budget = size_pools(cfg, args, device_memory_bytes(args))
        fit = budget.num_pages_per_rank * args.page_size * args.dp_size
        args = dataclasses.replace(
            args, max_total_tokens=min(fit, args.max_total_tokens or fit),
            max_running_requests=budget.max_running_requests_per_rank * args.dp_size)
    max_total = args.max_total_tokens or args.max_running_requests * min(context_length, 1024)
    return dataclasses.replace(
        args, context_length=context_length, max_total_tokens=max_total,
        served_model_name=args.served_model_name or args.model_path), budget
