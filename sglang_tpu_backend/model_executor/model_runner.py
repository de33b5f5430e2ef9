"""ModelRunner: owns params, the KV/state cache, the sampler state and a step backend; turns a
ScheduledBatch into bucketed rank batches and hands back per-chunk results.

A step (``launch`` then ``complete``): snapshot loads, the forward of ``num_ranks`` rank-local
ForwardBatches in one common bucket (``step_buckets``: T, R, L per rank) and mode (DECODE
only when every chunk is a decode, else MIXED: EXTEND steps run as MIXED; ranks without work
get an all-padding batch), snapshot saves, then the sampler on the logits [D*L, V] (rank r's
rows at r*L .. r*L+L-1) with the ranks' sampling inputs concatenated ([D*R] rows) and its
penalty state indexed by the global slot ``rank * num_state_slots + slot``
(``sampler_state``). D is 1 unless the backend is data-parallel.

Where the step runs (one device, DP ranks, TP heads, DP over several processes) is the step
backend's business (``backends.py``), picked once at construction.

Speculative decoding (``num_drafts`` k > 0; one device, DP ranks or TP): a TARGET_VERIFY step
(every chunk a verify chunk) runs the verify forward, the verify sampler (greedy rows by exact
match, drawn rows by rejection sampling, both through penalties, bias and per-position masks)
and the commit of the accepted positions into the GDN slots (rank-local with DP), all
dispatched without a wait (``verify_step.py``). Verify steps return no router
stats (the MoE health gauges and EPLB's expert loads then come from prefill steps). A
request's pages cover up to k positions past the context length, hence ``pages_per_seq`` of
``context_length + k`` tokens.

NEXTN (``mtp_params`` given; one device, DP ranks or TP): every step also returns the target's
hidden states and dispatches the MTP pass and chain of drafts (``nextn_step.py``) after its
sampler; each sampling chunk's k drafts come back with its tokens (``ChunkResult.drafts``).

Prefix cache (``num_gdn_snapshots > 0``): the runner owns the GDN state snapshots
(``state_snapshots.py``), copied in (``state_loads``) before a step, out (saves) after.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.managers.schedule_batch import ChunkResult, ScheduledBatch, ScheduledChunk
from sglang_tpu_backend.mem_cache.page_pool import pages_for
from sglang_tpu_backend.model_executor import host_inputs, multistep, state_transfer, warmup
from sglang_tpu_backend.model_executor.backends import SingleDeviceBackend, make_backend
from sglang_tpu_backend.model_executor.batch_builder import (SeqChunk, build_forward_batch,
                                                            in_flight_rows, num_logits_rows)
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang_tpu_backend.model_executor.nextn_step import MtpInputs, NextnDrafts
from sglang_tpu_backend.model_executor.routed_experts import routed_store
from sglang_tpu_backend.model_executor.sampler_state import (SamplerState, needs_top_k,
                                                             sampler_variant, unpack_batch_jit,
                                                             sampling_inputs, uses_penalties)
from sglang_tpu_backend.model_executor.step_buckets import StepBuckets
from sglang_tpu_backend.model_executor.verify_step import (
    VerifyInputs, concat_verify_inputs, sampling_view, verify_chunk_result, verify_inputs)
from sglang_tpu_backend.model_executor.weight_update import param_spec
from sglang_tpu_backend.sampling import sampler
from sglang_tpu_backend.speculative.nextn import chain_wanted
from sglang_tpu_backend.model_loader.sharded_loader import LoadReport, WeightSource


@dataclasses.dataclass
class StepInputs:
    """A step's host-built inputs (``ModelRunner.prepare``).

    fbs: one numpy ForwardBatch per rank (common bucket). from_slot: i32[T] or None, decode
    rows whose input is in flight (one rank only). inp: SamplingInputs of [D*R] rows.
    rows: each chunk's logits rows (global). sample_idx: each chunk's sampling row.
    K: top logprobs to compute (0 or ``max_top_logprobs_num``). spec: a verify step's draft
    inputs (None otherwise; its ``inp`` then holds each request's sampling values, read from
    its row 0, and the per-position bitmask i32[D*R, k+1, W]). mtp: the MTP pass's inputs
    per rank (NEXTN only).
    """

    fbs: list[ForwardBatch]
    from_slot: np.ndarray | None
    inp: sampler.SamplingInputs
    rows: list[np.ndarray]
    sample_idx: list[int]
    K: int
    spec: VerifyInputs | None = None
    mtp: list[MtpInputs] | None = None
    token_rows: list[int] | None = None  # each chunk's first token row (global, [D*T])


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched to the device (``ModelRunner.launch``), its outputs not yet fetched."""

    batch: ScheduledBatch
    out: dict  # the sampler's device arrays
    rows: list  # each chunk's logits rows
    sample_idx: Any  # each chunk's sampling row
    stats: Any  # router stats (device or host array) or None
    token_rows: list[int] | None = None  # each chunk's first token row (global)


class ModelRunner:
    """Device side of the engine. Not thread-safe: the scheduler thread alone calls it.

    ``num_pages``, ``num_state_slots``, ``max_running_requests`` and ``max_tokens_per_step``
    are per DP rank (the whole cache with ``dp_size == 1``).
    """

    last_hidden: Any = None  # NEXTN: the last forward's hidden states [T, H] (device)

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
        expert_location: Any = None,
        eplb_rebalance_num_iterations: int | None = None,
        num_drafts: int = 0,
        mtp_params: Any = None,
        num_scheduler_steps: int = 1,
        before_load: Callable[["ModelRunner"], None] | None = None,
    ):
        """``params``: host params, or a ``sharded_loader.WeightSource`` the backend loads
        straight into its shardings (``load_report`` says what this process read).
        ``router_stats``: each step also reduces the MoE routers' health (expert load,
        entropy, top-1 probability per layer; ``metrics/router_stats.py``) into
        ``last_router_stats`` f32[dp_size, layers, 3] and records the expert loads
        (``balancer``); ``ROUTED``: also the routed expert ids per token
        (``routed_experts.py``). ``deterministic``: see ``step_buckets``. ``expert_location``
        (``parallel.eplb.ExpertLocation``, EPLB): routed experts stored per physical slot of
        it; ``eplb_rebalance_num_iterations``: steps between rebalances (None: never)
        (``expert_balancer.py``). ``num_drafts``: k drafts per verify step (0: off;
        ``num_grammar_cut_drafts`` counts those a request's grammar cut). ``mtp_params`` (NEXTN, ``models/mtp.py``): the
        steps also draft the next verify step's k drafts with the MTP layers.
        ``num_scheduler_steps``: decode steps per multi-step launch (1 where not supported).
        ``before_load``: see ``_load``."""
        self.cfg = cfg
        self.last_router_stats = self._stats = None
        self.page_size, self.vocab_size = page_size, cfg.vocab_size
        self.max_top_logprobs_num = min(max_top_logprobs_num, cfg.vocab_size)
        self.num_drafts, self.num_grammar_cut_drafts = num_drafts, 0
        self.pages_per_seq = pages_for(context_length + num_drafts, page_size)
        self.buckets = StepBuckets(max_running_requests, max_tokens_per_step, deterministic,
                                   verify_tokens=num_drafts + 1 if num_drafts else None)
        self.req_buckets, self.token_buckets = self.buckets.req_buckets, self.buckets.token_buckets
        self.num_state_slots = num_state_slots  # per rank
        self.backend = make_backend(cfg, dp_size=dp_size, tp_size=tp_size, impl=impl,
                                    with_stats=router_stats, batch_invariant=deterministic)
        self.routed = routed_store(router_stats, num_drafts, cfg, dp_size, num_pages, page_size)
        if num_drafts and not self.backend.verify_steps:
            raise ValueError(f"speculative decoding is not supported with "
                             f"{type(self.backend).__name__}")
        # Each param's shape / dtype as loaded: what a weight update must match.
        source = params if isinstance(params, WeightSource) else None
        self.param_spec = source.shapes() if source else param_spec(params)
        self.load_report: LoadReport | None = None
        self.balancer = None  # expert loads and placement (``expert_balancer.py``)
        if expert_location is not None or router_stats:
            params, source = self._init_balancer(params, source, expert_location, router_stats,
                                                 eplb_rebalance_num_iterations)
        # The cache before the params: a multi-host leader's start-up collectives (sizes, then
        # the param check) come in the order its followers make them (``run_follower``).
        self.cache = self.backend.init_cache(
            num_pages=num_pages, page_size=page_size, num_state_slots=num_state_slots,
            kv_dtype=kv_dtype, state_dtype=state_dtype)
        self.sampler = SamplerState(cfg.vocab_size, self.dp_size * num_state_slots,
                                    self.backend.place_sampler_state)
        self.nextn, self.num_scheduler_steps = None, 1  # (both set below)
        self.params = self._load(params, source, None if mtp_params else before_load)
        self.transfer = self.backend.make_transfer(num_pages, num_state_slots)
        self.snapshots = self.backend.make_snapshots(self.cache, num_gdn_snapshots,
                                                     max_running_requests)
        self.nextn = None if mtp_params is None else self._init_nextn(
            mtp_params, num_pages, context_length, kv_dtype)
        self.num_scheduler_steps = num_scheduler_steps if self.multistep_supported else 1

    @property
    def multistep_supported(self) -> bool:
        """Multi-step launches run here (``multistep.py`` says where they do not)."""
        rebalances = self.balancer is not None and self.balancer.rebalance_every is not None
        return multistep.supported(isinstance(self.backend, SingleDeviceBackend), self.num_drafts,
                                   self.nextn, self.routed, rebalances, self.backend.batch_invariant)

    def _init_nextn(self, mtp_params: Any, num_pages: int, context_length: int,
                    kv_dtype: Any) -> NextnDrafts:
        if not self.num_drafts or not self.backend.hidden_states:
            raise ValueError(f"NEXTN drafting needs num_drafts > 0 and a backend with hidden "
                             f"states, not {type(self.backend).__name__}")
        if jnp.dtype(kv_dtype).itemsize == 1:  # the MTP pages are never FP8
            kv_dtype = jnp.bfloat16
        self.mtp_param_spec = param_spec(mtp_params)  # what a weight update's mtp.* must match
        return NextnDrafts(self.backend, mtp_params, num_steps=self.num_drafts,
                           num_pages=num_pages, page_size=self.page_size,
                           context_length=context_length, kv_dtype=kv_dtype,
                           max_reqs=max(R for _, _, R, _ in self.all_shapes()))

    def _load(self, params: Any, source: WeightSource | None,
              before_load: Callable[["ModelRunner"], None] | None) -> Any:
        """The params placed: ``source`` loaded, else host ``params`` placed. Without MTP,
        ``before_load(self)`` runs first where the backend places ``source`` leaf by leaf,
        with ``self.params`` its placed shapes: what it lowers on them (a staged warm-up's
        first programs, ``background_warmup.FirstStage``) compiles while the weights load."""
        if source is None:
            return self.backend.place_params(params)
        self.params = self.backend.placed_param_shapes(source) if before_load else None
        if self.params is not None:
            before_load(self)
        params, self.load_report = self.backend.load_params(source)
        return params

    def _init_balancer(self, params: Any, source: Any, expert_location: Any, router_stats: bool,
                       rebalance_every: int | None) -> tuple[Any, Any]:
        """The expert balancer, and the params (host params or the weight source) it leaves to
        place: expert slots laid out from the whole tree load it on the host first."""
        from sglang_tpu_backend.model_executor.expert_balancer import make_balancer

        if not router_stats and rebalance_every is not None:
            raise ValueError("--enable-eplb records expert loads from the router stats")
        self.balancer = make_balancer(self.cfg, expert_location, self.backend.num_ranks,
                                      rebalance_every)
        if self.balancer.stores_physical and source is not None:
            (params, self.load_report), source = source.host(), None
        return (params if source is not None else self.balancer.physical(params)), source

    @property
    def dp_size(self) -> int:
        return self.backend.num_ranks

    # Params ---------------------------------------------------------------------------
    def place_params(self, params: Any) -> Any:
        """Loaded params placed as this runner's own are (one device, DP or TP shardings, TPU
        weight layouts): the arrays a weight update swaps in (``replace_params``)."""
        if not self.backend.weight_updates:
            from sglang_tpu_backend.model_executor.weight_update import WeightUpdateError

            raise WeightUpdateError("weight updates are not supported with --nnodes > 1")
        if self.balancer is not None:
            params = self.balancer.physical(params)
        return self.backend.place_params(params)

    def place_mtp_params(self, mtp_params: Any) -> Any:
        """Loaded MTP params (NEXTN) placed as this runner's own are (``replace_params``)."""
        return self.backend.place_mtp_params(mtp_params)

    def replace_params(self, params: Any, mtp_params: Any = None) -> None:
        """Serve ``params`` (from ``place_params``) and, under NEXTN, ``mtp_params`` (from
        ``place_mtp_params``; None keeps the MTP params) from the next step on; the caller
        makes sure no step is in flight. Blocks until they are on the devices."""
        if mtp_params is not None:
            self.nextn.params = jax.block_until_ready(mtp_params)
        self.params = jax.block_until_ready(params)
        if self.balancer is not None:  # placed for the location of their time (EPLB)
            self.balancer.adopt(self.params)

    # Shapes ---------------------------------------------------------------------------
    def shapes_for(self, kind: ForwardMode, num_tokens: int, num_reqs: int, num_rows: int
                   ) -> tuple[ForwardMode, int, int, int]:
        """Bucketed (mode, T, R, L) of a step (``StepBuckets.shape_for``)."""
        return self.buckets.shape_for(kind, num_tokens, num_reqs, num_rows)

    def all_shapes(self) -> list[tuple[ForwardMode, int, int, int]]:
        """Every (mode, T, R, L) serving can produce (what warm-up compiles); with DP ranks
        (T, R, L) are per rank."""
        return self.buckets.all_shapes()

    def sampler_variants(self) -> tuple[sampler.SamplerVariant, ...]:
        """Every sampler variant a step can pick (what warm-up compiles)."""
        return sampler.VARIANTS

    # Step inputs ----------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, variant: sampler.SamplerVariant | None = None
                ) -> StepInputs:
        """The step's rank batches and sampling inputs (see ``StepInputs``). ``variant``
        (default: the chunks' ``sampler_variant``) says whether to build a bitmask and bias."""
        variant = variant or sampler_variant(batch.chunks)
        per_rank: list[list[ScheduledChunk]] = [[] for _ in range(self.dp_size)]
        where, offsets = [], []  # (rank, index within the rank), token offset of each chunk
        rank_tokens = [0] * self.dp_size
        for c in batch.chunks:
            where.append((c.dp_rank, len(per_rank[c.dp_rank])))
            offsets.append(rank_tokens[c.dp_rank])
            rank_tokens[c.dp_rank] += c.num_tokens
            per_rank[c.dp_rank].append(c)
        mode, T, R, L = self.shapes_for(
            batch.kind, max(sum(c.num_tokens for c in cs) for cs in per_rank),
            max(len(cs) for cs in per_rank), max(num_logits_rows(cs) for cs in per_rank))
        fbs, rank_rows, inps, from_slots, specs = [], [], [], [], []
        for k, chunks in enumerate(per_rank):
            fb, rows, from_slot = self._rank_batch(chunks, mode, T, R, L)
            fbs.append(fb)
            rank_rows.append(rows)
            from_slots.append(from_slot)
            sL = L  # the sampler's logits rows per rank
            mask = variant.mask
            if mode.is_verify():  # per-request values from row 0, masks per position
                specs.append(verify_inputs(chunks, R, self.num_drafts, self.vocab_size, mask))
                chunks, rows, sL, mask = [sampling_view(c) for c in chunks], [
                    np.array([j]) for j in range(len(chunks))], R, False
            inps.append(sampling_inputs(
                chunks, rows, R, sL, self.vocab_size, row_offset=k * sL,
                slot_offset=k * self.num_state_slots, mask=mask, bias=variant.bias))
        spec = concat_verify_inputs(specs) if specs else None
        inp = inps[0] if len(inps) == 1 else jax.tree.map(
            lambda *xs: np.concatenate(xs, axis=0), *inps)
        if spec is not None:
            inp = dataclasses.replace(inp, bitmask=spec.bitmask)
            self.num_grammar_cut_drafts += spec.num_cut
        return StepInputs(
            fbs=fbs, from_slot=in_flight_rows(from_slots), inp=inp, rows=[rank_rows[k][j] + k * L for k, j in where],
            sample_idx=[k * R + j for k, j in where],
            K=self.max_top_logprobs_num if needs_top_k(batch.chunks) else 0, spec=spec,
            mtp=[self.nextn.inputs(cs, T, R) for cs in per_rank] if self.nextn else None,
            token_rows=[k * T + o for (k, _), o in zip(where, offsets)] if self.routed else None)

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
            elif c.is_verify:
                ids = c.req.fill_slice(c.start, 1) + list(c.drafts)
            else:
                ids = c.req.fill_slice(c.start, c.num_tokens)
            seq_chunks.append(SeqChunk(ids, c.start, c.pages, c.state_slot, c.logits))
            offset += c.num_tokens
        fb, rows = build_forward_batch(
            seq_chunks, page_size=self.page_size, mode=mode, num_tokens=T,
            num_seqs=R, pages_per_seq=self.pages_per_seq, num_logits=L,
        )
        return fb, rows, from_slot

    # Step -----------------------------------------------------------------------------
    def forward(self, fbs: list[ForwardBatch], from_slot: np.ndarray | None = None) -> jax.Array:
        """The jitted forward on one numpy batch per rank; updates the cache in place
        (donated). f32[D*L, V] logits. ``from_slot`` i32[T] (one device only): rows >= 0 take
        their input id from the sampler's ``last_tokens``. NEXTN: keeps the hidden states."""
        fbs, from_slot = self.place_batch(fbs, from_slot)
        if self.nextn is not None:
            if from_slot is not None:  # (speculation turns overlap scheduling off)
                raise ValueError("NEXTN steps take no in-flight decode inputs")
            (logits, self.cache, self._stats), self.last_hidden = self.backend.forward_hidden(
                self.params, self.cache, fbs)
            return logits
        logits, self.cache, self._stats = self.backend.forward(
            self.params, self.cache, fbs, from_slot, self.sampler.last_tokens)
        return logits

    def verify_forward(self, fbs: list[ForwardBatch]) -> tuple[jax.Array, Any]:
        """The TARGET_VERIFY forward (cache donated): (logits, ``VerifyStates``). NEXTN:
        keeps the hidden states."""
        if self.nextn is not None:
            (logits, self.cache, states), self.last_hidden = self.backend.verify_hidden(
                self.params, self.cache, fbs)
        else:
            logits, self.cache, states = self.backend.verify(self.params, self.cache, fbs)
        return logits, states

    def draft(self, fbs: list[ForwardBatch], mtp: list[MtpInputs], sampled: jax.Array,
              accepted_len: Any, chunks: list[ScheduledChunk]) -> jax.Array:
        """NEXTN: dispatch the MTP pass over the last forward's rows and, when some request
        of ``chunks`` may draft next step, the chain of drafts (``nextn_step.py``);
        i32[D*R, k] (or i32[D*R, 0] without the chain) on the device."""
        return self.nextn.run(self.params, fbs, self.last_hidden, mtp, sampled, accepted_len,
                              chain_wanted(chunks))

    def verify(self, fbs: list[ForwardBatch], spec: VerifyInputs, inp: sampler.SamplingInputs,
               K: int, variant: sampler.SamplerVariant = sampler.FULL) -> dict[str, jax.Array]:
        """A TARGET_VERIFY forward, the verify sampler (updating the penalty counts and last
        tokens) and the commit of each request's accepted positions into its GDN slot (cache
        donated, nothing waited for). Returns ``rejection.sample_verify_step``'s outputs."""
        logits, states = self.verify_forward(fbs)
        state = self.sampler
        out, state.counts, state.last_tokens = state.verify_with(
            logits, state.counts, state.last_tokens, spec, inp, K, variant)
        slots = np.concatenate([fb.state_slots for fb in fbs])
        self.cache = self.backend.commit(self.params, self.cache, states, slots,
                                         out["accepted_len"])
        self._stats = None
        return out

    def sample(self, logits: jax.Array, inp: sampler.SamplingInputs, K: int,
               variant: sampler.SamplerVariant = sampler.FULL) -> dict[str, jax.Array]:
        """Dispatch the sampler (updating the penalty counts and last tokens); returns its
        outputs as device arrays."""
        return self.sampler.sample(logits, self.place_sampling(inp), K, variant)

    # Host inputs on the device -----------------------------------------------------------
    def place_batch(self, fbs: list[ForwardBatch], from_slot: np.ndarray | None
                    ) -> tuple[list[ForwardBatch], Any]:
        """One device: the numpy batch on the device in one copy, its in-flight input ids
        resolved there (``sampler_state.unpack_batch_jit``; then no ``from_slot`` is left;
        NEXTN has none). DP and TP backends place their inputs over the mesh: unchanged."""
        if not isinstance(self.backend, SingleDeviceBackend):
            return fbs, from_slot
        (fb,) = fbs
        if self.nextn is not None:
            return [host_inputs.to_device(fb, self.backend.device)], from_slot
        if from_slot is None:
            from_slot = np.full(fb.input_ids.shape, -1, np.int32)
        buf, layout = host_inputs.pack((fb, from_slot))
        fb = unpack_batch_jit(jax.device_put(buf, self.backend.device), self.sampler.last_tokens,
                              layout=layout)
        return [fb], None

    def place_sampling(self, inp: sampler.SamplingInputs) -> Any:
        """One device: the sampling inputs copied to the device in one buffer, which the
        sampler's program unpacks (``host_inputs.Packed``); else unchanged."""
        if not isinstance(self.backend, SingleDeviceBackend):
            return inp
        return host_inputs.packed(inp, self.backend.device)

    def run(self, batch: ScheduledBatch) -> list[ChunkResult]:
        """Run one step: forward, sample, and split the outputs per chunk."""
        return self.complete(self.launch(batch))

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Build the step's inputs and dispatch it (snapshot loads, forward, snapshot saves,
        sampler) without waiting for the device: JAX runs it asynchronously while the host
        goes on (overlap scheduling prepares the next step meanwhile)."""
        self._reset_penalties(batch)
        if self.balancer is not None and self.balancer.due:
            jax.block_until_ready(self.cache)  # the last forward done: no step reads the params
            self.params = self.balancer.rebalance(self.params)
        if batch.state_loads:
            self.cache = self.snapshots.load(
                self.cache, [(x.rank, x.snapshot, x.slot) for x in batch.state_loads])
        variant = sampler_variant(batch.chunks)
        if batch.num_steps > 1:
            return self._launch_multistep(batch, variant)
        step = self.prepare(batch, variant)
        if step.spec is not None:
            out = self.verify(step.fbs, step.spec, step.inp, step.K, variant)
            if step.mtp is not None:
                out["drafts"] = self.draft(step.fbs, step.mtp, out["tokens"],
                                           out["accepted_len"], batch.chunks)
            return LaunchedStep(batch, out, step.rows, step.sample_idx, None)
        logits = self.forward(step.fbs, step.from_slot)
        if batch.state_saves:
            self.snapshots.save(self.cache, [(x.rank, x.slot, x.snapshot) for x in batch.state_saves])
        out = self.sample(logits, step.inp, step.K, variant)
        if step.mtp is not None:
            out["drafts"] = self.draft(step.fbs, step.mtp, out["tokens"],
                                       np.ones(len(out["tokens"]), np.int32), batch.chunks)
        for x in jax.tree.leaves((out, self._stats)):  # the copy back starts as the step ends
            if isinstance(x, jax.Array):  # (a multi-host step's stats are host arrays)
                x.copy_to_host_async()
        return LaunchedStep(batch, out, step.rows, step.sample_idx, self._stats, step.token_rows)

    def _launch_multistep(self, batch: ScheduledBatch, variant: sampler.SamplerVariant
                          ) -> LaunchedStep:
        """Dispatch ``batch.num_steps`` decode steps of a DECODE batch as one program
        (``multistep.py``; its sampler runs ``variant``'s branch), no snapshot copies, no stats."""
        if not self.multistep_supported or batch.kind != ForwardMode.DECODE:
            raise ValueError(f"a {batch.num_steps}-step launch needs a DECODE batch on one "
                             f"device without speculative decoding")
        step = self.prepare(batch, sampler.MULTISTEP_INPUTS)
        multistep.widen_page_table(step.fbs[0], batch.chunks)
        (fb,), _ = self.place_batch(step.fbs, step.from_slot)
        out = multistep.dispatch(self, fb, multistep.pack_inputs(self, step.inp, variant),
                                 batch.num_steps, step.K)
        for x in jax.tree.leaves(out):
            x.copy_to_host_async()
        self._stats = None
        return LaunchedStep(batch, out, step.rows, step.sample_idx, None)

    def complete(self, step: LaunchedStep) -> list[ChunkResult]:
        """Wait for a launched step's outputs (one device-to-host transfer) and split them
        per chunk."""
        if step.batch.num_steps > 1:
            out = jax.device_get(step.out)
            return [multistep.chunk_result(out, i, c)
                    for i, c in zip(step.sample_idx, step.batch.chunks)]
        out, stats = jax.device_get((step.out, step.stats))
        if stats is not None:  # f32[D*layers, 3] and f32[layers, P]: a few KiB
            health, slot_counts, *routed = stats  # (+ routed ids i32[D*T, M, K])
            self.last_router_stats = np.asarray(health).reshape(self.dp_size, -1, 3)
            if self.balancer is not None:
                self.balancer.record(slot_counts)
        results = [verify_chunk_result(out, i, c) if c.is_verify else _chunk_result(out, i, c, r)
                   for i, c, r in zip(step.sample_idx, step.batch.chunks, step.rows)]
        if self.routed is not None and stats is not None:
            self.routed.record(np.asarray(routed[0]), step.batch.chunks, step.token_rows)
            for c, res in zip(step.batch.chunks, results):
                if c.req.return_routed_experts and not c.is_verify:
                    res.routed_start, res.routed_experts = self.routed.chunk_rows(c)
        if "drafts" in out:
            for i, c, res in zip(step.sample_idx, step.batch.chunks, results):
                res.drafts = out["drafts"][i].tolist() if c.sample else None
        return results

    def warmup(self, progress: bool = True, compile_threads: int = 1) -> float:
        """Compile every program serving can use (``warmup.warm_up``, on ``compile_threads``;
        with EPLB rebalancing also the expert moves); returns seconds."""
        seconds = warmup.warm_up(self, progress, compile_threads)
        if self.balancer is not None and self.balancer.rebalance_every is not None:
            self.params = jax.block_until_ready(
                self.balancer.mover.move(self.params, self.balancer.location))
        return seconds

    def close(self) -> None:
        """Release the backend (multi-host: stop the followers; once, the caller makes sure
        no step runs any more)."""
        self.backend.close()

    # Penalty state and request state --------------------------------------------------
    def _reset_penalties(self, batch: ScheduledBatch) -> None:
        for c in batch.chunks:
            if c.start != c.req.cached_tokens or not uses_penalties(c.req.sampling):  # first chunk
                continue
            self.reset_penalty_row(c.dp_rank * self.num_state_slots + c.state_slot, c.req)

    def reset_penalty_row(self, slot: int, req: Any) -> None:
        """Penalty state of global slot ``slot`` := the counts of ``req``'s prompt and outputs."""
        self.sampler.reset_penalty_row(slot, req)

    def export_request_state(self, pages: list[int], slot: int, rank: int = 0):
        """Host copies (kv, conv, rec) of a request's pages and state slot on DP rank ``rank``
        (``state_transfer`` layouts)."""
        return self._transfer("export").gather(self.cache, pages, slot, rank)

    def install_request_state(self, kv, conv, rec, pages: list[int], slot: int, req: Any,
                              rank: int = 0) -> None:
        """Write handed-over state into ``pages`` / ``slot`` of DP rank ``rank`` and set the
        slot's penalty row."""
        self.cache = self._transfer("install").scatter(self.cache, kv, conv, rec, pages, slot, rank)
        if uses_penalties(req.sampling):
            self.reset_penalty_row(rank * self.num_state_slots + slot, req)
        jax.block_until_ready(self.cache.rec_state)

    def export_mtp_kv(self, pages: list[int], rank: int = 0) -> np.ndarray:
        """NEXTN: host copy [Lm, n, 2G, page, D] of the MTP KV at a request's ``pages`` on DP
        rank ``rank``."""
        self._check_mtp_transfer()
        return self._transfer("export").gather_mtp(self.nextn.cache, pages, rank)

    def install_mtp_kv(self, mtp_kv: np.ndarray, pages: list[int], rank: int = 0) -> None:
        """NEXTN: write handed-over MTP KV [Lm, n, 2G, page, D] at ``pages`` of DP rank ``rank``."""
        self._check_mtp_transfer()
        self.nextn.cache = self._transfer("install").scatter_mtp(self.nextn.cache, mtp_kv,
                                                                 pages, rank)
        jax.block_until_ready(self.nextn.cache)

    def _check_mtp_transfer(self) -> None:
        if self.nextn is None:
            raise ValueError("this runner has no MTP cache (not --speculative-algorithm NEXTN)")

    def warm_up_state_transfer(self, *, gather: bool, scatter: bool) -> None:
        """Compile the handover's export (``gather``) and/or install (``scatter``) programs of
        every page count a request can hold (under NEXTN the MTP KV's too)."""
        self.cache = self._transfer("warm-up").warm_up(self.cache, self.pages_per_seq,
                                                        gather=gather, scatter=scatter)
        if self.nextn is not None and self.transfer.moves_mtp_kv:
            self.nextn.cache = self.transfer.warm_up_mtp(
                self.nextn.cache, self.pages_per_seq, gather=gather, scatter=scatter)

    def _transfer(self, what: str) -> state_transfer.StateTransfer:
        if not self.backend.state_transfer:
            raise NotImplementedError(f"handover state {what} is not supported with this "
                                      f"layout ({type(self.backend).__name__})")
        return self.transfer


def _chunk_result(out: dict, i: int, c: ScheduledChunk, r: np.ndarray) -> ChunkResult:
    """One chunk's results from the sampler's host outputs: ``i`` its sampling row, ``r`` its
    logits rows."""
    req, res = c.req, ChunkResult()
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
        if out.get("top_ids") is not None and n_top:
            res.top_logprobs = list(zip(out["top_logprobs"][i, :n_top].tolist(),
                                        out["top_ids"][i, :n_top].tolist()))
    return res
