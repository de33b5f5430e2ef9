"""ModelRunner: owns params, the KV/state cache, the jitted forward and the jitted sampler;
turns a ScheduledBatch into bucketed device arrays and hands back per-chunk results.

Buckets (so steady-state serving never recompiles; warm-up compiles every one):
  DECODE:  T = R = L in ``req_buckets`` (powers of four from 8 up to max_running_requests).
  MIXED:   every other step (prefill chunks, with or without decodes: EXTEND steps run as
           MIXED, one program for both); T in ``token_buckets`` (powers of four from 64 up
           to max_tokens_per_step), R = L = max_running_requests (``extend_req_buckets``, one
           bucket), covering both the requests and the logits rows (the scheduler keeps
           logits rows per step <= max_running_requests, chunking prompt-logprob prefills).
The ladders are coarse on purpose: every bucket is one more program to compile before the
server answers (5-8 s each on a 2-core XLA:CPU host), and a padded row costs far less than
that (padding rows route to no expert and read no pages, GDN chunks and attention blocks
loop over the real ones only). With the default limits (64 requests, 256-token steps) that
is 3 DECODE and 2 MIXED programs. A prefill step pads its requests to the limit: on the tiny
default a 64-token prompt step took 12.9 ms at R = 64 against 12.0 ms at R = 8; a decode
step does not (4 requests: 8.3 ms at R = 64, 4.5 ms at R = 8), hence its ladder.
The page table is always ``pages_per_seq`` wide (context length / page size): the attention
kernels read only the pages a request holds (the Pallas kernel by its kv lengths, the XLA path
by a loop over page blocks up to the batch's longest request), so the width costs an upload
of the table, not work, and needs no bucket of its own.
The sampler compiles per R, per static top-logprob count (0 or max_top_logprobs_num) and per
``sampler_variants()`` entry (greedy / plain draws / full: filters, penalties or a grammar
bitmask), the variant chosen per step from what its rows ask for.

Data-parallel attention (``dp_size`` D > 1): the runner owns a ``parallel.DPForward``; params
are sharded (experts split over the ranks), the caches hold ``num_pages`` pages and
``num_state_slots`` slots per rank, and the limits above are per rank. A step builds one
rank-local ForwardBatch per rank (ranks without work get an all-padding one) in one common
bucket (T, R, L) and mode (DECODE only when every chunk is a decode, else MIXED: EXTEND
steps run as MIXED). Logits come back as [D*L, V], rank r's rows at r*L .. r*L+L-1; the
sampler runs on them with the ranks' sampling inputs concatenated ([D*R] rows), and its
penalty state is indexed by the global slot ``rank * num_state_slots + slot``.

Multi-host DP (the mesh spans several processes, ``jax.process_count() > 1``; this runner is
the leader's): every step program over the mesh is one all processes enter in the same order,
so ``forward_dp`` first broadcasts the rank batches to the followers
(``parallel/multihost.py``), and the logits (and router stats) are gathered to the host; the
sampler and its penalty state live on the leader's first device. Weight updates, state
export/install and GDN snapshots are not available there; ``close`` stops the followers.

Tensor-parallel attention (``tp_size`` > 1, for comparison with DP): the runner owns a
``parallel.TPForward``; one pool and one batch as with one device, every device runs every
request on its share of the heads and experts, logits come back replicated.

Deterministic mode (``deterministic=True``, ``--enable-deterministic-inference``): two step
shapes only (``deterministic_shapes``): DECODE with T = R = L = max_running_requests, and a
prefill-only MIXED step with T = max_tokens_per_step, R = ``deterministic_prefill_reqs``
(the scheduler sends at most that many prefill chunks, never decodes, in such a step; few
rows keep the GDN chunk slots few) and L = ``deterministic_prefill_rows`` (room for a whole
64-token chunk of prompt logprobs). On XLA:CPU an op's per-row result can depend on the
program's shapes (the GDN chunked path rounds differently at T=16 and T=64), so a fixed shape
per kind is what makes a row's result independent of the batch; padding rows cost compute,
not correctness (``benchmarks/bench_deterministic.py`` measures it).

Prefix cache: with ``num_gdn_snapshots > 0`` the runner also owns the GDN state snapshots
(``state_snapshots.GDNSnapshots``); a step first copies the batch's ``state_loads`` into their
slots and, after the forward, its ``state_saves`` out of them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.managers.schedule_batch import ChunkResult, ScheduledBatch, ScheduledChunk
from sglang_tpu_backend.mem_cache.page_pool import pages_for
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor import state_transfer
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.model_executor.weight_update import param_spec
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.sampling import sampler
from sglang_tpu_backend.server_args import DETERMINISTIC_MIN_CHUNK

logger = logging.getLogger(__name__)
MIN_BUCKET = 8


def deterministic_prefill_reqs(max_running_requests: int) -> int:
    """Prefill chunks per step in deterministic mode (the step's fixed R)."""
    return min(MIN_BUCKET, max_running_requests)


def deterministic_prefill_rows(max_running_requests: int, max_tokens_per_step: int) -> int:
    """Logits rows of the deterministic prefill step (the scheduler's ``max_logits_rows``):
    at least one aligned chunk of prompt logprobs, which cannot be cut shorter."""
    T = max(max_tokens_per_step, max_running_requests)
    return min(T, max(max_running_requests, DETERMINISTIC_MIN_CHUNK))


def deterministic_shapes(max_running_requests: int, max_tokens_per_step: int
                         ) -> list[tuple[ForwardMode, int, int, int]]:
    """The two (mode, T, R, L) of deterministic mode: DECODE and prefill-only MIXED."""
    R, T = max_running_requests, max(max_tokens_per_step, max_running_requests)
    return [(ForwardMode.DECODE, R, R, R),
            (ForwardMode.MIXED, T, deterministic_prefill_reqs(R),
             deterministic_prefill_rows(R, max_tokens_per_step))]


def bucket_ladder(limit: int, smallest: int = MIN_BUCKET, factor: int = 2) -> tuple[int, ...]:
    """Powers of ``factor`` from ``smallest`` below ``limit``, then ``limit`` itself."""
    out, b = [], min(smallest, limit)
    while b < limit:
        out.append(b)
        b *= factor
    out.append(limit)
    return tuple(out)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def step_shapes(max_running_requests: int, max_tokens_per_step: int
                ) -> list[tuple[ForwardMode, int, int, int]]:
    """Every bucketed (mode, T, R, L) a runner with these limits can step with.

    DECODE: T = R = L in ``req_buckets``. MIXED: T in ``token_buckets`` x R = L in
    ``extend_req_buckets``, only where some request count n <= T picks that R (see
    ``_ladders``).
    """
    req_buckets, extend_req_buckets, token_buckets = _ladders(max_running_requests,
                                                              max_tokens_per_step)
    out = [(ForwardMode.DECODE, r, r, r) for r in req_buckets]
    for t in token_buckets:
        prev = 0
        for r in extend_req_buckets:
            if prev < t:  # some count n in (prev, r] with n <= t picks r
                out.append((ForwardMode.MIXED, t, r, r))
            prev = r
    return out


DECODE_FACTOR = 4  # decode request buckets: 8, 32, 128, ... (capped at the limit)
PREFILL_MIN_TOKENS, PREFILL_TOKEN_FACTOR = 64, 4  # prefill token buckets: 64, 256, 1024, ...


def _ladders(max_running_requests: int, max_tokens_per_step: int):
    """(decode request buckets, prefill request buckets (the limit alone), prefill token
    buckets)."""
    return (bucket_ladder(max_running_requests, factor=DECODE_FACTOR),
            (max_running_requests,),
            bucket_ladder(max(max_tokens_per_step, max_running_requests),
                          smallest=PREFILL_MIN_TOKENS, factor=PREFILL_TOKEN_FACTOR))


def _resolve_input_ids(input_ids, from_slot, last_tokens):
    """i32[T]: ``last_tokens[from_slot[t]]`` where ``from_slot[t] >= 0`` (a decode whose input
    is the token its request's previous step sampled), else ``input_ids[t]``."""
    picked = last_tokens[jnp.clip(from_slot, 0, last_tokens.shape[0] - 1)]
    return jnp.where(from_slot >= 0, picked, input_ids)


def _record_tokens(last_tokens, slot, tokens, valid):
    """last_tokens[slot[r]] := tokens[r] for the rows that sampled (i32[S], i32[R] x2, bool[R])."""
    where = jnp.where(valid, slot, last_tokens.shape[0])
    return last_tokens.at[where].set(tokens.astype(last_tokens.dtype), mode="drop")


_resolve_input_ids_jit = jax.jit(_resolve_input_ids)
_record_tokens_jit = jax.jit(_record_tokens, donate_argnums=(0,))


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched to the device (``ModelRunner.launch``), its outputs not yet fetched."""

    batch: ScheduledBatch
    out: dict  # the sampler's device arrays
    rows: list  # each chunk's logits rows
    sample_idx: Any  # each chunk's sampling row
    stats: Any  # router stats device array or None


def _place_on_default_device(params: Any) -> Any:
    """Params on the default device; on TPU the dense weights in their native tiling."""
    from jax.sharding import SingleDeviceSharding

    from sglang_tpu_backend.model_executor.weight_layout import place_weights

    where = SingleDeviceSharding(jax.devices()[0])
    return place_weights(params, jax.tree.map(lambda _: where, params))


def _uses_penalties(sp: Any) -> bool:
    return sp.frequency_penalty != 0 or sp.presence_penalty != 0 or sp.repetition_penalty != 1


class ModelRunner:
    """Device side of the engine. Not thread-safe: the scheduler thread alone calls it.

    ``num_pages``, ``num_state_slots``, ``max_running_requests`` and ``max_tokens_per_step``
    are per DP rank (the whole cache with ``dp_size == 1``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        *,
        page_size: int,
        num_pages: int,
        num_state_slots: int,
        max_running_requests: int,
        max_tokens_per_step: int,
        context_length: int,
        kv_dtype: Any = jnp.bfloat16,
        state_dtype: Any = jnp.float32,
        impl: str = "auto",
        max_top_logprobs_num: int = 20,
        dp_size: int = 1,
        tp_size: int = 1,
        router_stats: bool = True,
        num_gdn_snapshots: int = 0,
        deterministic: bool = False,
    ):
        """``router_stats``: each step also reduces the MoE routers' health (expert load,
        entropy, top-1 probability per layer; ``metrics/router_stats.py``) into
        ``last_router_stats`` f32[dp_size, layers, 3]."""
        self.cfg = cfg
        self.router_stats = router_stats
        self.last_router_stats = None
        self.page_size = page_size
        self.impl = impl
        self.vocab_size = cfg.vocab_size
        self.num_words = (cfg.vocab_size + 31) // 32
        self.max_top_logprobs_num = min(max_top_logprobs_num, cfg.vocab_size)
        self.pages_per_seq = pages_for(context_length, page_size)
        self.req_buckets, self.extend_req_buckets, self.token_buckets = _ladders(
            max_running_requests, max_tokens_per_step)
        self.step_limits = (max_running_requests, max_tokens_per_step)
        self.deterministic = deterministic
        self.num_state_slots = num_state_slots  # per rank
        S = dp_size * num_state_slots  # penalty-state rows: one per global slot
        self.counts = jnp.zeros((S, cfg.vocab_size), jnp.int32)  # i32[S, V]
        self.prompt_mask = jnp.zeros((S, cfg.vocab_size), jnp.bool_)  # bool[S, V]
        # The token each global slot's request sampled last (overlap scheduling: a decode
        # launched before that token reaches the host reads its input here).
        self.last_tokens = jnp.zeros((S,), jnp.int32)  # i32[S]
        self.dp = self.tp = None
        self.multihost = jax.process_count() > 1  # a DP mesh over several processes
        # Shape / dtype of each param as loaded (before placement): what a weight update's
        # checkpoint must match (``weight_update.load_host_params``).
        self.param_spec = param_spec(params)
        if tp_size > 1:
            self._init_tp(params, tp_size, num_pages=num_pages, num_state_slots=num_state_slots,
                          kv_dtype=kv_dtype, state_dtype=state_dtype)
        elif dp_size == 1:
            # Everything committed to the device, as step outputs are: a jit's cache key
            # includes whether an argument is committed, so warm-up (fresh arrays) and serving
            # (step outputs) must agree or the first real steps compile again.
            device = jax.devices()[0]
            self.params = _place_on_default_device(params)
            self.cache = jax.device_put(qwen3_5_moe.init_cache(
                cfg, num_pages=num_pages, page_size=page_size, num_state_slots=num_state_slots,
                kv_dtype=kv_dtype, state_dtype=state_dtype,
            ), device)
            self.counts = jax.device_put(self.counts, device)
            self.prompt_mask = jax.device_put(self.prompt_mask, device)
            self.last_tokens = jax.device_put(self.last_tokens, device)
        else:
            self._init_dp(params, dp_size, num_pages=num_pages, num_state_slots=num_state_slots,
                          kv_dtype=kv_dtype, state_dtype=state_dtype)
        # One module-level jit (static cfg/impl, cache donated): runners of equal shapes share
        # compilations.
        self._forward = qwen3_5_moe.forward_jit
        self.snapshots = None
        if num_gdn_snapshots > 0:
            from sglang_tpu_backend.model_executor.state_snapshots import GDNSnapshots

            self.snapshots = GDNSnapshots(self.cache, num_gdn_snapshots, max_running_requests, self.dp)

    def _init_dp(self, params, dp_size: int, *, num_pages: int, num_state_slots: int,
                 kv_dtype, state_dtype) -> None:
        """DPForward over the first ``dp_size`` devices; sharded params, per-rank caches and
        the penalty state split by slot (rank r's slots on rank r's device)."""
        from jax.sharding import NamedSharding

        from sglang_tpu_backend.parallel.dp_forward import DPForward
        from sglang_tpu_backend.parallel.mesh import make_mesh, rank_spec

        if self.multihost:  # the followers build the same cache (multihost.run_follower)
            from sglang_tpu_backend.parallel import multihost

            multihost.broadcast_ints([num_pages, num_state_slots, int(self.router_stats)], 3)
        self.dp = DPForward(self.cfg, make_mesh(dp_size), impl=self.impl,
                            with_stats=self.router_stats, batch_invariant=self.deterministic)
        self.params = self.dp.shard_params(params)
        self.cache = self.dp.init_cache(num_pages=num_pages, page_size=self.page_size,
                                        num_state_slots=num_state_slots, kv_dtype=kv_dtype,
                                        state_dtype=state_dtype)
        if self.multihost:  # the sampler runs on the leader's own first device
            self._local = jax.local_devices()[0]
            self.counts, self.prompt_mask, self.last_tokens = jax.device_put(
                (self.counts, self.prompt_mask, self.last_tokens), self._local)
            return
        by_slot = NamedSharding(self.dp.mesh, rank_spec(self.dp.ep, 0))
        self.counts = jax.device_put(self.counts, by_slot)
        self.prompt_mask = jax.device_put(self.prompt_mask, by_slot)

    def _init_tp(self, params, tp_size: int, *, num_pages: int, num_state_slots: int,
                 kv_dtype, state_dtype) -> None:
        """TPForward over the first ``tp_size`` devices (one pool; heads split over devices);
        the penalty state replicated beside the replicated logits."""
        from jax.sharding import NamedSharding, PartitionSpec

        from sglang_tpu_backend.parallel.mesh import make_mesh
        from sglang_tpu_backend.parallel.tp_forward import TPForward

        self.tp = TPForward(self.cfg, make_mesh(tp_size), impl=self.impl,
                            with_stats=self.router_stats, batch_invariant=self.deterministic)
        self.params = self.tp.shard_params(params)
        self.cache = self.tp.init_cache(num_pages=num_pages, page_size=self.page_size,
                                        num_state_slots=num_state_slots, kv_dtype=kv_dtype,
                                        state_dtype=state_dtype)
        everywhere = NamedSharding(self.tp.mesh, PartitionSpec())
        self.counts = jax.device_put(self.counts, everywhere)
        self.prompt_mask = jax.device_put(self.prompt_mask, everywhere)

    def place_params(self, params: Any) -> Any:
        """Loaded params placed as this runner's own are (one device, DP or TP shardings, TPU
        weight layouts): the arrays a weight update swaps in (``replace_params``)."""
        if self.multihost:
            from sglang_tpu_backend.model_executor.weight_update import WeightUpdateError

            raise WeightUpdateError("weight updates are not supported with --nnodes > 1")
        if self.tp is not None:
            return self.tp.shard_params(params)
        if self.dp is not None:
            return self.dp.shard_params(params)
        return _place_on_default_device(params)

    def replace_params(self, params: Any) -> None:
        """Serve ``params`` (from ``place_params``) from the next step on; the caller makes
        sure no step is in flight. Blocks until they are on the devices."""
        self.params = jax.block_until_ready(params)

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else self.dp.dp_size

    # Shapes ---------------------------------------------------------------------------
    def shapes_for(self, kind: ForwardMode, num_tokens: int, num_reqs: int, num_rows: int
                   ) -> tuple[ForwardMode, int, int, int]:
        """Bucketed (mode, T, R, L) of a step: DECODE stays DECODE, anything else runs as
        MIXED. Deterministic mode: the largest bucket of each kind, whatever the counts."""
        if self.deterministic:
            return self.all_shapes()[0 if kind == ForwardMode.DECODE else 1]
        if kind == ForwardMode.DECODE:
            r = pick_bucket(self.req_buckets, num_reqs)
            return ForwardMode.DECODE, r, r, r
        t = pick_bucket(self.token_buckets, num_tokens)
        r = pick_bucket(self.extend_req_buckets, max(num_reqs, num_rows, 1))
        return ForwardMode.MIXED, t, r, r

    def all_shapes(self) -> list[tuple[ForwardMode, int, int, int]]:
        """Every (mode, T, R, L) serving can produce (what warm-up compiles); with DP ranks
        (T, R, L) are per rank."""
        if self.deterministic:
            return deterministic_shapes(*self.step_limits)
        return step_shapes(*self.step_limits)

    # Step -----------------------------------------------------------------------------
    def forward(self, fb: ForwardBatch, from_slot: np.ndarray | None = None) -> jax.Array:
        """The pure jitted forward; updates the cache in place (donated). f32[L, V] logits.
        With tensor-parallel attention the step runs over the TP mesh. ``from_slot`` i32[T]
        (one device only): rows >= 0 take their input id from ``last_tokens``."""
        if self.tp is not None:
            assert from_slot is None, "in-flight inputs need one device"
            out = self.tp(self.params, self.cache, self.tp.put_batch(fb))
        else:
            if from_slot is None:
                from_slot = np.full(fb.input_ids.shape, -1, np.int32)
            fb = dataclasses.replace(fb, input_ids=_resolve_input_ids_jit(
                fb.input_ids, from_slot, self.last_tokens))
            out = self._forward(self.params, self.cache, fb, cfg=self.cfg, impl=self.impl,
                                with_stats=self.router_stats, batch_invariant=self.deterministic)
        logits, self.cache = out[:2]
        self._stats = out[2] if self.router_stats else None
        return logits

    def forward_dp(self, fbs: list[ForwardBatch]) -> jax.Array:
        """The DP step over one batch per rank; updates the cache (donated). f32[D*L, V]."""
        if self.multihost:
            from sglang_tpu_backend.parallel import multihost

            fbs = multihost.broadcast_step(fbs, self.dp.dp_size)
            logits, self.cache, self._stats = multihost.step(self.dp, self.params, self.cache, fbs)
            return jax.device_put(logits, self._local)
        out = self.dp(self.params, self.cache, self.dp.put_batch(fbs))
        logits, self.cache = out[:2]
        self._stats = out[2] if self.router_stats else None
        return logits

    def close(self) -> None:
        """Multi-host: tell the followers to stop and leave the process group (once; the
        caller makes sure no step runs any more). Nothing to do otherwise."""
        if self.multihost and self.dp is not None:
            from sglang_tpu_backend.parallel import multihost

            num_ranks, self.dp = self.dp.dp_size, None  # no step after this
            multihost.broadcast_step(None, num_ranks)
            multihost.shutdown()

    def _rank_batch(self, chunks: list[ScheduledChunk], mode: ForwardMode, T: int, R: int, L: int
                    ) -> tuple[ForwardBatch, list[np.ndarray], np.ndarray | None]:
        """Numpy ForwardBatch of one rank's chunks in bucket (T, R, L), each chunk's logits
        rows, and ``from_slot`` i32[T] for decodes whose input is in flight (None if none)."""
        seq_chunks, from_slot, offset = [], None, 0
        for c in chunks:
            if c.input_in_flight:
                if from_slot is None:
                    from_slot = np.full(T, -1, np.int32)
                from_slot[offset] = c.state_slot
                ids = [0]
            else:
                ids = c.req.fill_slice(c.start, c.num_tokens)
            seq_chunks.append(SeqChunk(ids, c.start, c.pages, c.state_slot, c.logits))
            offset += c.num_tokens
        fb, rows = build_forward_batch(
            seq_chunks, page_size=self.page_size, mode=mode, num_tokens=T,
            num_seqs=R, pages_per_seq=self.pages_per_seq, num_logits=L,
        )
        return fb, rows, from_slot

    @staticmethod
    def _num_rows(chunks: list[ScheduledChunk]) -> int:
        return sum({"all": c.num_tokens, "last": 1, "none": 0}[c.logits] for c in chunks)

    def _top_k(self, batch: ScheduledBatch) -> int:
        want_lp = any(c.req.return_logprob for c in batch.chunks)
        return self.max_top_logprobs_num if want_lp else 0

    def sampler_variant(self, chunks: list[ScheduledChunk]) -> sampler.SamplerVariant:
        """The sampler variant of a step: the stages its sampling rows need (host-side)."""
        draw = filt = pen = mask = bias = False
        for c in chunks:
            if not c.sample:
                continue
            req, sp = c.req, c.req.sampling
            if sp.temperature > 0:
                draw = True
                filt |= sp.top_k_or_off > 0 or sp.top_p < 1 or sp.min_p > 0
            pen |= _uses_penalties(sp)
            mask |= req.grammar is not None or req.num_sampled < sp.min_new_tokens
            bias |= bool(sp.logit_bias)
        return sampler.variant_for(sampler.SamplerVariant(draw=draw, filter=filt, penalties=pen, mask=mask,
                                                          bias=bias))

    def sampler_variants(self) -> tuple[sampler.SamplerVariant, ...]:
        """Every sampler variant ``sampler_variant`` can pick (what warm-up compiles)."""
        return sampler.VARIANTS

    def prepare(self, batch: ScheduledBatch, variant: sampler.SamplerVariant | None = None
                ) -> tuple[ForwardBatch, np.ndarray | None, sampler.SamplingInputs, list[np.ndarray], int]:
        """Numpy ForwardBatch, ``from_slot`` (see ``_rank_batch``) and SamplingInputs for a
        step, the logits rows of each chunk, and K. ``variant`` (default: ``sampler_variant``
        of the chunks) says whether to build a bitmask."""
        variant = variant or self.sampler_variant(batch.chunks)
        num_rows = self._num_rows(batch.chunks)
        mode, T, R, L = self.shapes_for(batch.kind, batch.num_tokens, len(batch.chunks), num_rows)
        fb, rows, from_slot = self._rank_batch(batch.chunks, mode, T, R, L)
        inp = self._sampling_inputs(batch.chunks, rows, R, L, mask=variant.mask, bias=variant.bias)
        return fb, from_slot, inp, rows, self._top_k(batch)

    def prepare_dp(self, batch: ScheduledBatch, variant: sampler.SamplerVariant | None = None
                   ) -> tuple[list[ForwardBatch], sampler.SamplingInputs, list[np.ndarray], list[int], int]:
        """One rank-local ForwardBatch per DP rank (common bucket and mode), the concatenated
        SamplingInputs ([D*R] rows), each chunk's global logits rows and sampling row, and K."""
        variant = variant or self.sampler_variant(batch.chunks)
        D = self.dp.dp_size
        per_rank: list[list[ScheduledChunk]] = [[] for _ in range(D)]
        where = []  # (rank, index within the rank) of each chunk
        for c in batch.chunks:
            where.append((c.dp_rank, len(per_rank[c.dp_rank])))
            per_rank[c.dp_rank].append(c)
        mode, T, R, L = self.shapes_for(
            batch.kind, max(sum(c.num_tokens for c in cs) for cs in per_rank),
            max(len(cs) for cs in per_rank), max(self._num_rows(cs) for cs in per_rank))
        fbs, rank_rows, inps = [], [], []
        for k, chunks in enumerate(per_rank):
            fb, rows, from_slot = self._rank_batch(chunks, mode, T, R, L)
            assert from_slot is None, "in-flight inputs need one device"
            fbs.append(fb)
            rank_rows.append(rows)
            inps.append(self._sampling_inputs(chunks, rows, R, L, row_offset=k * L,
                                              slot_offset=k * self.num_state_slots, mask=variant.mask,
                                              bias=variant.bias))
        inp = jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *inps)
        rows = [rank_rows[k][j] + k * L for k, j in where]
        sample_idx = [k * R + j for k, j in where]
        return fbs, inp, rows, sample_idx, self._top_k(batch)

    def _sampling_inputs(self, chunks: list[ScheduledChunk], rows: list[np.ndarray], R: int, L: int,
                         row_offset: int = 0, slot_offset: int = 0, mask: bool = True,
                         bias: bool = True) -> sampler.SamplingInputs:
        """Sampling inputs of one rank's chunks; ``row_offset`` / ``slot_offset`` place the
        rank's logits rows and penalty-state rows in the global [D*L] / [D*S] layout.
        ``mask=False`` (no row has a grammar or a min_new_tokens ban) builds no bitmask,
        ``bias=False`` (no row has a logit bias) no bias entries."""
        f32 = lambda v: np.full(R, v, np.float32)  # noqa: E731
        sample_rows = np.zeros(R, np.int32)
        valid = np.zeros(R, np.bool_)
        temperature, top_p, min_p = f32(0.0), f32(1.0), f32(0.0)
        top_k = np.zeros(R, np.int32)
        freq, pres, rep = f32(0.0), f32(0.0), f32(1.0)
        seed_lo = np.zeros(R, np.uint32)
        seed_hi = np.zeros(R, np.uint32)
        step = np.zeros(R, np.int32)
        slot = np.zeros(R, np.int32)
        bitmask = np.full((R, self.num_words), -1, np.int32) if mask else None
        target_ids = np.zeros(L, np.int32)
        bias_ids, bias_values = self._no_bias(R) if bias else (None, None)
        for i, (c, r) in enumerate(zip(chunks, rows)):
            req, sp = c.req, c.req.sampling
            slot[i] = c.state_slot + slot_offset
            if c.logits == "all":
                fill = req.fill_ids
                nxt = [fill[p + 1] if p + 1 < len(fill) else 0 for p in range(c.start, c.start + c.num_tokens)]
                target_ids[r] = nxt
            if not c.sample:
                continue
            sample_rows[i] = r[-1] + row_offset
            valid[i] = True
            temperature[i] = sp.temperature
            top_p[i], top_k[i], min_p[i] = sp.top_p, sp.top_k_or_off, sp.min_p
            freq[i], pres[i], rep[i] = sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty
            seed_lo[i], seed_hi[i] = req.seed & 0xFFFFFFFF, (req.seed >> 32) & 0xFFFFFFFF
            step[i] = req.num_sampled  # this token's index (earlier ones may be in flight)
            if bias_ids is not None and (entries := sp.logit_bias_arrays()) is not None:
                bias_ids[i, :len(entries[0])], bias_values[i, :len(entries[1])] = entries
            if bitmask is None:
                continue
            if req.grammar is not None:
                req.grammar.fill_bitmask(bitmask[i])
            if req.num_sampled < sp.min_new_tokens:
                banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(req.eos_ids))
                words = bitmask.view(np.uint32)
                for t in banned:
                    if 0 <= t < self.vocab_size:
                        words[i, t // 32] &= ~np.uint32(1 << (t % 32))
        return sampler.SamplingInputs(
            sample_rows=sample_rows, valid=valid, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
            seed_lo=seed_lo, seed_hi=seed_hi, step=step, slot=slot, bitmask=bitmask, target_ids=target_ids,
            bias_ids=bias_ids, bias_values=bias_values,
        )

    def _no_bias(self, R: int) -> tuple[np.ndarray, np.ndarray]:
        """All-padding logit-bias entries of R rows: ids i32[R, B] = V (dropped), values 0."""
        B = sampler.MAX_LOGIT_BIAS
        return np.full((R, B), self.vocab_size, np.int32), np.zeros((R, B), np.float32)

    def _reset_penalties(self, batch: ScheduledBatch) -> None:
        for c in batch.chunks:
            if c.start != c.req.cached_tokens or not _uses_penalties(c.req.sampling):  # first chunk
                continue
            self.reset_penalty_row(c.dp_rank * self.num_state_slots + c.state_slot, c.req)

    def reset_penalty_row(self, slot: int, req: Any) -> None:
        """Penalty state of global slot ``slot`` := the counts of ``req``'s prompt and outputs
        (built here with numpy, set on the device by one fixed-shape program)."""
        count_row = np.bincount(np.asarray(req.output_ids, np.int64),
                                minlength=self.vocab_size)[: self.vocab_size].astype(np.int32)
        mask_row = np.zeros(self.vocab_size, np.bool_)
        mask_row[np.asarray(req.prompt_ids, np.int64)] = True
        self.counts, self.prompt_mask = sampler.set_penalty_row_jit(
            self.counts, self.prompt_mask, np.int32(slot), count_row, mask_row)

    def export_request_state(self, pages: list[int], slot: int):
        """Host copies (kv, conv, rec) of a request's pages and state slot (one device only)."""
        self._check_single_device("export")
        return state_transfer.gather_state(self.cache, pages, slot)

    def install_request_state(self, kv, conv, rec, pages: list[int], slot: int, req: Any) -> None:
        """Write handed-over state into ``pages`` / ``slot`` and set the slot's penalty row."""
        self._check_single_device("install")
        self.cache = state_transfer.scatter_state(self.cache, kv, conv, rec, pages, slot)
        if _uses_penalties(req.sampling):
            self.reset_penalty_row(slot, req)
        jax.block_until_ready(self.cache.rec_state)

    def _check_single_device(self, what: str) -> None:
        if self.dp is not None or self.tp is not None:
            raise NotImplementedError(f"state {what} for a handover needs dp_size == tp_size == 1")

    def sample(self, logits: jax.Array, inp: sampler.SamplingInputs, K: int,
               variant: sampler.SamplerVariant = sampler.FULL) -> dict[str, jax.Array]:
        """Dispatch the sampler (updating the penalty counts and ``last_tokens``); returns its
        outputs as device arrays."""
        out, self.counts, self.last_tokens = self._sample_with(
            logits, self.counts, self.last_tokens, inp, K, variant)
        return out

    def _sample_with(self, logits, counts, last_tokens, inp, K, variant):
        """The sampler on given penalty counts / last tokens (both donated): (outputs, new
        counts, new last tokens)."""
        out = sampler.sample_jit(logits, counts, self.prompt_mask, inp, num_top_logprobs=K,
                                 variant=variant)
        counts = out.pop("counts")
        return out, counts, _record_tokens_jit(last_tokens, inp.slot, out["tokens"], inp.valid)

    def run(self, batch: ScheduledBatch) -> list[ChunkResult]:
        """Run one step: forward, sample, and split the outputs per chunk."""
        return self.complete(self.launch(batch))

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Build the step's inputs and dispatch it (snapshot loads, forward, snapshot saves,
        sampler) without waiting for the device: JAX runs it asynchronously while the host
        goes on (overlap scheduling prepares the next step meanwhile)."""
        self._reset_penalties(batch)
        if batch.state_loads:
            self.cache = self.snapshots.load(
                self.cache, [(x.rank, x.snapshot, x.slot) for x in batch.state_loads])
        variant = self.sampler_variant(batch.chunks)
        if self.dp is None:
            fb, from_slot, inp, rows, K = self.prepare(batch, variant)
            sample_idx = range(len(batch.chunks))
            logits = self.forward(fb, from_slot)
        else:
            fbs, inp, rows, sample_idx, K = self.prepare_dp(batch, variant)
            logits = self.forward_dp(fbs)
        if batch.state_saves:
            self.snapshots.save(self.cache, [(x.rank, x.slot, x.snapshot) for x in batch.state_saves])
        out = self.sample(logits, inp, K, variant)
        return LaunchedStep(batch, out, rows, sample_idx, self._stats)

    def complete(self, step: LaunchedStep) -> list[ChunkResult]:
        """Wait for a launched step's outputs (one device-to-host transfer) and split them
        per chunk."""
        out, stats = jax.device_get((step.out, step.stats))
        if stats is not None:  # f32[D*layers, 3], a few hundred bytes
            self.last_router_stats = np.asarray(stats).reshape(self.dp_size, -1, 3)
        results = []
        for i, c, r in zip(step.sample_idx, step.batch.chunks, step.rows):
            req = c.req
            res = ChunkResult()
            n_top = req.top_logprobs_num
            lp_rows = req.input_logprob_rows(c.start, c.num_tokens)
            if lp_rows:
                idx = r[np.asarray(lp_rows) - c.start]
                res.input_logprobs = [float(x) for x in out["row_logprobs"][idx]]
                res.input_top_logprobs = [
                    list(zip(out["row_top_logprobs"][j, :n_top].tolist(), out["row_top_ids"][j, :n_top].tolist()))
                    for j in idx
                ]
            if c.sample:
                res.next_token = int(out["tokens"][i])
                res.logprob = float(out["logprobs"][i])
                if step.out.get("top_ids") is not None and n_top:
                    res.top_logprobs = list(zip(out["top_logprobs"][i, :n_top].tolist(),
                                                out["top_ids"][i, :n_top].tolist()))
            results.append(res)
        return results

    # Warmup ---------------------------------------------------------------------------
    def dummy_batch(self, kind: ForwardMode, T: int, R: int, L: int) -> ForwardBatch:
        """An all-padding batch (num_seqs = 0) of the given shape: writes nothing."""
        return ForwardBatch(
            input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
            cu_q_lens=np.zeros(R + 1, np.int32), kv_lens=np.zeros(R, np.int32),
            page_table=np.zeros((R, self.pages_per_seq), np.int32), state_slots=np.zeros(R, np.int32),
            num_seqs=np.zeros(1, np.int32), logits_indices=np.zeros(L, np.int32),
            mode=kind,
        )

    def dummy_sampling_inputs(self, R: int, L: int, variant: sampler.SamplerVariant = sampler.FULL
                              ) -> sampler.SamplingInputs:
        """All-padding sampling inputs of R rows / L logits rows, shaped for ``variant``."""
        z = np.zeros(R, np.int32)
        f = np.zeros(R, np.float32)
        return sampler.SamplingInputs(
            sample_rows=z, valid=np.zeros(R, np.bool_), temperature=f, top_p=f + 1, top_k=z, min_p=f,
            frequency_penalty=f, presence_penalty=f, repetition_penalty=f + 1,
            seed_lo=z.astype(np.uint32), seed_hi=z.astype(np.uint32), step=z, slot=z,
            bitmask=np.full((R, self.num_words), -1, np.int32) if variant.mask else None,
            target_ids=np.zeros(L, np.int32),
            **(dict(zip(("bias_ids", "bias_values"), self._no_bias(R))) if variant.bias else {}),
        )

    def warmup(self, progress: bool = True) -> float:
        """Compile every forward and sampler variant; returns seconds taken.

        The forward programs compile one after another on this thread (each runs on the real
        cache, which it donates); each bucket's sampler programs then compile on a second
        thread, against scratch copies of the penalty counts and last tokens, while the next
        forward compiles (on this repo's 2-core CPU the gain is within run-to-run noise; the
        bucket count is what sets start-up time). Same jitted functions, same argument shapes and
        placements: serving reuses every program compiled here."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        shapes = self.all_shapes()
        t0 = time.perf_counter()
        D = self.dp_size
        scratch = [jnp.copy(self.counts), jnp.copy(self.last_tokens)]

        def warm_sampler(logits, R: int, L: int) -> None:
            for variant in self.sampler_variants():
                inp = self.dummy_sampling_inputs(D * R, D * L, variant)
                for K in (0, self.max_top_logprobs_num):
                    _, scratch[0], scratch[1] = self._sample_with(logits, *scratch, inp, K, variant)
            jax.block_until_ready(scratch)

        with ThreadPoolExecutor(1, thread_name_prefix="warmup-sampler") as pool:
            pending = []
            for kind, T, R, L in tqdm(shapes, desc="warmup (compile)", disable=not progress):
                if self.dp is None:
                    logits = self.forward(self.dummy_batch(kind, T, R, L))
                else:
                    logits = self.forward_dp([self.dummy_batch(kind, T, R, L)] * D)
                pending.append(pool.submit(warm_sampler, logits, R, L))
            for f in pending:
                f.result()  # re-raises a failed sampler compile here
        self.counts, self.prompt_mask = sampler.set_penalty_row_jit(
            self.counts, self.prompt_mask, np.int32(0), np.zeros(self.vocab_size, np.int32),
            np.zeros(self.vocab_size, np.bool_))  # slot 0 is free at warm-up
        if self.snapshots is not None:
            self.cache = self.snapshots.warmup(self.cache)
        jax.block_until_ready(self.cache)
        dt = time.perf_counter() - t0
        logger.info("warmup compiled %d step shapes in %.1f s", len(shapes), dt)
        return dt
