"""Engine: validation, the scheduler loop thread, detokenised SGLang-format outputs.

``generate`` validates a request (InvalidRequestError before anything is allocated), queues
it, and yields output dicts that the scheduler thread pushes into a per-request
``asyncio.Queue`` through ``loop.call_soon_threadsafe``. Leaving the iterator early aborts
the request and frees its KV pages and state slot at once.

With ``--dp-size D`` the engine serves D data-parallel attention ranks: per-rank pools and
limits (``ServerArgs`` says how the host totals split), the scheduler places each request on
one rank, and the runner steps all ranks at once (``parallel/dp_forward.py``). With
``--nnodes N`` the D ranks span N processes: this engine is node 0's (it joins the process
group first), the other nodes run ``parallel.multihost.run_follower``; ``shutdown`` stops them.

Prefix cache (unless ``--disable-radix-cache``): one radix tree per DP rank
(``mem_cache/radix_cache.py``, used by the scheduler through ``managers/prefix_cache.py``)
shares the KV pages of cached prompt prefixes and restores the GDN state from snapshots;
``meta_info.cached_tokens`` reports the prompt tokens a request reused. Pool stats count the
tree's unlocked (evictable) pages as free, as SGLang's token usage does.

Disaggregated prefill / decode (one device per engine): ``prefill_for_handover`` runs a
request up to its first token and returns its KV pages + GDN states as a
``managers/handover.RequestHandover`` (copied out in the loop thread right after that step,
then the pages and slot are freed; with a prefix cache the prompt stays cached there);
``generate_from_handover`` installs one into this engine's pools (new pages + a slot, owned
by the request alone: never shared with the prefix cache) and decodes it to the end.

Failure handling: a step runs in four phases (``PHASES``: schedule, model, process_result,
deliver). An exception in one fails only that step's requests (a schedule() fault: every
request the scheduler holds, see ``Scheduler.fail_all``) with finish_reason
``{"type": "abort", "message": "internal error: <Type>: <msg>"}``, frees their pages and slots,
delivers their final outputs, counts ``stats["num_errors"]`` and keeps serving. A loop thread
that dies anyway (a BaseException) fails every request it held; from then on, and while the
loop has had work without finishing a step for longer than ``--watchdog-timeout``,
``health_error()`` says why and ``/health`` answers 503. ``--max-queued-requests`` bounds the
waiting queue (a new request beyond it: ``ServiceUnavailableError``, HTTP 503).

Weight updates (``update_weights_from_disk``): the new checkpoint is loaded on the host,
checked against the serving params and placed like them while the old weights keep serving;
then new requests are held, the requests already in the engine finish on the old weights (or
are aborted: ``abort_all_requests``), and the loop swaps the params between steps, with no
step in flight and the pools idle, flushes the prefix cache and releases the held requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

import jax

from sglang_tpu_backend.config import DTYPES, cache_storage_dtype
from sglang_tpu_backend.constrained.grammar import GrammarBackend
from sglang_tpu_backend.entrypoints.offline import OfflineAPI
from sglang_tpu_backend.managers.handover import RequestHandover
from sglang_tpu_backend.managers.io_struct import (
    GenerateReqInput, InvalidRequestError, ServiceUnavailableError)
from sglang_tpu_backend.managers.prefix_cache import PrefixCache
from sglang_tpu_backend.managers.schedule_batch import Req
from sglang_tpu_backend.managers.scheduler import Scheduler
from sglang_tpu_backend.mem_cache.page_pool import pages_for
from sglang_tpu_backend.metrics import EngineMetrics
from sglang_tpu_backend.mem_cache.radix_cache import RadixCache, SnapshotPool
from sglang_tpu_backend.mem_cache.rank_pools import RankPools
from sglang_tpu_backend.model_executor import weight_update
from sglang_tpu_backend.model_executor.model_runner import (
    ModelRunner, deterministic_prefill_reqs, deterministic_prefill_rows)
from sglang_tpu_backend.profiler import StepProfiler
from sglang_tpu_backend.sampling.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from sglang_tpu_backend.server_args import DETERMINISTIC_MIN_CHUNK, ServerArgs

logger = logging.getLogger(__name__)
CPU_CONTEXT_CAP = 4096  # default context length on CPU (the reference attention reads P pages)
TPU_CONTEXT_CAP = 32768
PHASES = ("schedule", "model", "process_result", "deliver")  # a step's phases (fault_injector)
# _make_req runs on a worker thread above this prompt size (characters of text / token ids)
# or with a grammar to compile; below it, inline: tokenising a short prompt takes ~25 us, the
# thread hop ~85 us (measured on the tiny tokenizer).
OFFLOAD_PROMPT_LEN = 2048


def deterministic_limits(args: ServerArgs) -> dict:
    """Scheduler arguments of ``--enable-deterministic-inference``: prefill chunks aligned to
    the GDN chunk size, as many chunks and logits rows per step as the runner's fixed prefill
    shape has (``model_runner.deterministic_shapes``)."""
    running = args.max_running_requests_per_rank
    return dict(prefill_align=DETERMINISTIC_MIN_CHUNK,
                max_prefill_chunks=deterministic_prefill_reqs(running),
                max_logits_rows=deterministic_prefill_rows(running, args.max_tokens_per_step))


class Engine(OfflineAPI):
    """One model, one scheduler loop thread; usable offline like ``sglang.Engine``.

    ``Engine(model_path=..., dtype=..., ...)`` (keyword arguments are ``ServerArgs`` fields),
    ``Engine(server_args)`` or ``Engine(server_args=...)``. The offline API (``generate``,
    ``async_generate``, context manager: ``entrypoints/offline.py``) and the HTTP routes
    serve the same object. The request-level API the routes (and the Ray ingress) use:
    ``generate_request`` (async iterator of SGLang-format output dicts for ONE prompt, as
    SGLang's ``TokenizerManager.generate_request``), ``abort_request``, ``flush_cache``,
    ``get_model_info``, ``get_server_info``, ``get_load``, ``start_profile`` /
    ``stop_profile``, ``health_generate``, ``pool_stats``, ``shutdown``; the Ray app's
    replicas add ``prefill_for_handover`` / ``generate_from_handover`` and
    ``loop_stalled_for`` (health checks).

    Sizing: ``--dtype auto`` resolves from the checkpoint config (``config.resolve_dtype``);
    with ``--mem-fraction-static`` the KV pool (and, if even one page per running request
    does not fit, ``max_running_requests``) comes from ``mem_budget.size_pools``.
    """

    def __init__(self, server_args: ServerArgs | None = None, *, start_loop: bool = True,
                 role: str = "colocated", **kwargs):
        """``kwargs`` build the ServerArgs when ``server_args`` is not given.
        ``start_loop=False`` leaves stepping to the caller (``step()``; benchmarks, tests).
        ``role`` labels the metrics: colocated (standalone server), prefill or decode."""
        from sglang_tpu_backend.config import load_model_config, resolve_dtype
        from sglang_tpu_backend.loader import load_params
        from sglang_tpu_backend.tokenizer import ids_decoder, load_tokenizer

        if server_args is not None and kwargs:
            raise TypeError(f"Engine: pass server_args or ServerArgs fields, not both "
                            f"(got {sorted(kwargs)})")
        args = server_args if server_args is not None else ServerArgs(**kwargs)
        if args.nnodes > 1:  # before anything touches a JAX device
            from sglang_tpu_backend.parallel import multihost

            if args.node_rank != 0:
                raise ValueError("--node-rank > 0 follows node 0's engine: run "
                                 "launch_server (or multihost.run_follower), not Engine")
            multihost.join(args)
        if args.model_path is None:
            from sglang_tpu_backend.tiny_model import default_model_path

            args = dataclasses.replace(args, model_path=str(default_model_path()))
        if args.tokenizer_path is None:
            args = dataclasses.replace(args, tokenizer_path=args.model_path)
        self.tokenizer = load_tokenizer(args.tokenizer_path)
        self._decode_ids = ids_decoder(self.tokenizer)
        cfg = load_model_config(args.model_path)
        args.check_devices(len(jax.devices()), cfg.num_experts)  # before loading any weights
        args = dataclasses.replace(args, dtype=resolve_dtype(args.dtype, args.model_path))
        params = load_params(args.model_path, cfg, dtype=DTYPES[args.dtype])
        self.model_config = cfg
        cap = TPU_CONTEXT_CAP if jax.default_backend() == "tpu" else CPU_CONTEXT_CAP
        context_length = args.context_length or min(cfg.max_position_embeddings, cap)
        self.mem_budget = None
        if args.mem_fraction_static is not None:
            from sglang_tpu_backend.mem_budget import device_memory_bytes, size_pools

            self.mem_budget = size_pools(cfg, args, device_memory_bytes(args))
            fit = self.mem_budget.num_pages_per_rank * args.page_size * args.dp_size
            args = dataclasses.replace(
                args, max_total_tokens=min(fit, args.max_total_tokens or fit),
                max_running_requests=self.mem_budget.max_running_requests_per_rank * args.dp_size)
        max_total = args.max_total_tokens or args.max_running_requests * min(context_length, 1024)
        self.args = args = dataclasses.replace(
            args, context_length=context_length, max_total_tokens=max_total,
            served_model_name=args.served_model_name or args.model_path,
        )
        dp = args.dp_size
        self.num_pages_per_rank = max_total // (args.page_size * dp)
        self.num_pages = self.num_pages_per_rank * dp  # all ranks
        self.eos_ids = frozenset(cfg.eos_token_ids) | (
            frozenset([self.tokenizer.eos_token_id]) if self.tokenizer.eos_token_id is not None else frozenset()
        )
        running = args.max_running_requests_per_rank
        self.pools = RankPools.per_rank(dp, num_pages=self.num_pages_per_rank,
                                        page_size=args.page_size, num_slots=running)
        num_snapshots = args.num_gdn_snapshots_per_rank
        prefix = None
        if num_snapshots > 0:
            prefix = PrefixCache([RadixCache(p.page_pool, SnapshotPool(num_snapshots))
                                  for p in self.pools])
        det = args.enable_deterministic_inference  # (its num_gdn_snapshots_per_rank is 0)
        self.scheduler = Scheduler(self.pools, max_running_requests=running,
                                   max_tokens_per_step=args.max_tokens_per_step, prefix=prefix,
                                   **(deterministic_limits(args) if det else {}))
        self.runner = ModelRunner(
            cfg, params, page_size=args.page_size, num_pages=self.num_pages_per_rank,
            num_state_slots=running, max_running_requests=running,
            max_tokens_per_step=args.max_tokens_per_step, context_length=context_length,
            kv_dtype=cache_storage_dtype(DTYPES[args.dtype], jax.default_backend()),
            impl=args.kernel_impl,
            max_top_logprobs_num=args.max_top_logprobs_num, dp_size=dp, tp_size=args.tp_size,
            num_gdn_snapshots=num_snapshots, deterministic=det,
        )
        self.grammar_backend = GrammarBackend(self.tokenizer, cfg.vocab_size, sorted(self.eos_ids))
        self._rng = random.Random(args.random_seed)
        # Overlap scheduling needs decode inputs read on the device (one device, no DP / TP).
        self.overlap = not args.disable_overlap_schedule and dp == 1 and args.tp_size == 1
        if args.compilation_cache_dir != "":
            from sglang_tpu_backend.model_executor.compile_cache import enable_persistent_cache
            from sglang_tpu_backend.tiny_model import cache_root

            enable_persistent_cache(args.compilation_cache_dir
                                    or cache_root() / "jax-compilation-cache")
        self.warmup_seconds = 0.0 if args.skip_warmup else self.runner.warmup()
        self.stats = {"num_requests_total": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0,
                      "num_steps": 0, "num_errors": 0}
        self.metrics = EngineMetrics(args.served_model_name, role=role, dp_size=dp,
                                     num_moe_layers=cfg.num_hidden_layers)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._consumers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._installs: list[tuple[Req, RequestHandover]] = []  # handovers waiting for room
        self.last_step_end = time.monotonic()  # the loop's progress mark (health checks)
        self._stop = False
        self.loop_error: str | None = None  # why the loop thread died (None while it runs)
        self.weight_version = args.weight_version
        self._update_lock = threading.Lock()  # one weight update at a time
        self._weight_swap: weight_update.PendingSwap | None = None  # waiting for the loop
        self._held: list[tuple[Req, Callable[[], None]]] = []  # requests held during a swap
        # Test hook: called with each phase name (PHASES) at the start of that phase of a step.
        self.fault_injector: Callable[[str], None] | None = None
        self.profiler = StepProfiler()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        if start_loop:
            self._thread.start()

    # Validation --------------------------------------------------------------------------
    def _make_req(self, obj: GenerateReqInput) -> Req:
        V, ctx = self.model_config.vocab_size, self.args.context_length
        if (obj.text is None) == (obj.input_ids is None):
            raise InvalidRequestError("text", "exactly one of text / input_ids must be given")
        if obj.text is not None:
            if not isinstance(obj.text, str):
                raise InvalidRequestError("text", "text must be a string")
            ids = self.tokenizer.encode(obj.text)
            field = "text"
        else:
            ids = obj.input_ids
            field = "input_ids"
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError(field, "input_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise InvalidRequestError(field, f"input_ids contains token id {bad[0]} outside the vocabulary [0, {V})")
        if not ids:
            raise InvalidRequestError(field, f"{field} is empty (0 prompt tokens)")
        P = len(ids)
        if P >= ctx:
            raise InvalidRequestError(field, f"the input ({P} tokens) is longer than the context length ({ctx} tokens)")
        sp = SamplingParams.from_dict(obj.sampling_params)
        sp.validate(V)
        if sp.max_new_tokens is None:
            max_new = min(DEFAULT_MAX_NEW_TOKENS, ctx - P)
        else:
            max_new = sp.max_new_tokens
            if P + max_new > ctx:
                raise InvalidRequestError(
                    "sampling_params.max_new_tokens",
                    f"sampling_params.max_new_tokens ({max_new}) + prompt ({P} tokens) exceeds the "
                    f"context length ({ctx} tokens)",
                )
        if pages_for(P + max_new, self.args.page_size) > self.num_pages_per_rank:
            raise InvalidRequestError(
                "sampling_params.max_new_tokens",
                f"sampling_params.max_new_tokens: prompt ({P}) + max_new_tokens ({max_new}) exceeds the "
                f"KV cache capacity ({self.num_pages_per_rank * self.args.page_size} tokens"
                + (" per DP rank)" if self.args.dp_size > 1 else ")"),
            )
        start = obj.logprob_start_len
        if start is None or start == -1 or start >= P:
            start = P - 1
        if start < 0:
            raise InvalidRequestError("logprob_start_len", f"logprob_start_len must be >= -1, got {obj.logprob_start_len}")
        n_top = obj.top_logprobs_num or 0
        if not 0 <= n_top <= self.runner.max_top_logprobs_num:
            raise InvalidRequestError(
                "top_logprobs_num", f"top_logprobs_num must be in [0, {self.runner.max_top_logprobs_num}], got {n_top}"
            )
        grammar = None
        if sp.regex is not None or sp.json_schema is not None:
            grammar = self.grammar_backend.compile(regex=sp.regex, json_schema=sp.json_schema)
        rid = obj.rid or uuid.uuid4().hex
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        skip = sp.skip_special_tokens

        decode_ids = self._decode_ids

        def decode(tok_ids: list[int]) -> str:
            return decode_ids(tok_ids, skip)

        return Req(
            rid, ids, sp, max_new_tokens=max_new, seed=seed, eos_ids=self.eos_ids, context_length=ctx,
            return_logprob=bool(obj.return_logprob), logprob_start_len=start, top_logprobs_num=n_top,
            stream=bool(obj.stream), grammar=grammar, decode=decode,
        )

    # Public API ----------------------------------------------------------------------------
    async def _make_req_off_loop(self, obj: GenerateReqInput) -> Req:
        """``_make_req`` on a worker thread when it may take long (a grammar to compile, a
        prompt over ``OFFLOAD_PROMPT_LEN``), so the event loop keeps serving; inline otherwise."""
        sp = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
        prompt = obj.text if obj.text is not None else obj.input_ids
        if (sp.get("regex") is not None or sp.get("json_schema") is not None
                or (isinstance(prompt, (str, list)) and len(prompt) > OFFLOAD_PROMPT_LEN)):
            return await asyncio.to_thread(self._make_req, obj)
        return self._make_req(obj)

    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        """ONE prompt's outputs (cumulative; the last has ``finish_reason`` set). Raises
        InvalidRequestError on its first step, before anything is allocated; leaving early
        aborts the request."""
        req = await self._make_req_off_loop(obj)
        req.return_text_in_logprobs = bool(obj.return_text_in_logprobs)
        outs = self._serve(req, lambda: self.scheduler.add_request(req), queue_limit=True)
        try:
            async for out in outs:
                yield out
        finally:  # a consumer leaving early aborts at once, not when ``outs`` is collected
            await outs.aclose()

    async def _serve(self, req: Req, submit, queue_limit: bool = False) -> AsyncIterator[dict]:
        """Register ``req``'s consumer, ``submit()`` it (under the lock) and yield its outputs
        until one is final (finish_reason set, or a handover); leaving early aborts it.

        Raises ServiceUnavailableError when the loop thread is dead, or (``queue_limit``)
        when ``--max-queued-requests`` requests are already waiting."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._loop_dead():
                raise ServiceUnavailableError(f"the scheduler loop is not running ({self.loop_error})")
            limit = self.args.max_queued_requests
            waiting = self.scheduler.num_waiting + len(self._held)
            if queue_limit and limit is not None and waiting >= limit:
                raise ServiceUnavailableError(
                    f"The request queue is full ({waiting} requests waiting, "
                    f"--max-queued-requests {limit}); retry later")
            if req.rid in self._consumers:
                raise InvalidRequestError("rid", f"rid {req.rid!r} is already in use")
            self._consumers[req.rid] = (loop, queue)
            self.stats["num_requests_total"] += 1
            self.stats["prompt_tokens_total"] += len(req.prompt_ids)
            self._submit(req, submit)
            self._wake.notify()
        done = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, OutputSnapshot):
                    out = out.materialize()  # the list copies, here rather than under the lock
                done = out["meta_info"]["finish_reason"] is not None or "handover" in out
                yield out
                if done:
                    return
        finally:
            with self._lock:
                self._consumers.pop(req.rid, None)
            if not done:
                self.abort_request(req.rid)

    # Disaggregated prefill / decode ----------------------------------------------------------
    def _check_handover(self) -> None:
        if self.args.dp_size != 1 or self.args.tp_size != 1:
            raise NotImplementedError("prefill/decode handover needs --dp-size 1 --tp-size 1")

    async def prefill_for_handover(self, obj: GenerateReqInput) -> tuple[dict, RequestHandover | None]:
        """Prefill ``obj`` and sample its first token. Returns the output so far and the
        request's state to continue elsewhere, or (final output, None) when the request
        already finished here (EOS, a stop, ``max_new_tokens`` <= 1)."""
        self._check_handover()
        req = await self._make_req_off_loop(obj)
        req.return_text_in_logprobs = bool(obj.return_text_in_logprobs)
        req.export_after_prefill = True
        req.request = dataclasses.replace(obj, rid=req.rid)
        last = None
        async for out in self._serve(req, lambda: self.scheduler.add_request(req), queue_limit=True):
            last = out
        if "handover" in last:
            return last["output"], last["handover"]
        return last, None

    async def generate_from_handover(self, h: RequestHandover) -> AsyncIterator[dict]:
        """Install ``h`` (pages + a slot here, its arrays scattered into them) and decode it
        to the end, yielding outputs as ``generate`` does (the first one when the next
        token is sampled). Records the handover latency (export start -> installed) and
        bytes on this engine's metrics."""
        self._check_handover()
        if h.page_size != self.args.page_size:
            raise InvalidRequestError("page_size", f"handover pages of {h.page_size} tokens, "
                                      f"this engine's page_size is {self.args.page_size}")
        req = await self._make_req_off_loop(h.request)
        req.return_text_in_logprobs = bool(h.request.return_text_in_logprobs)
        if list(h.prompt_ids) != req.prompt_ids:
            raise InvalidRequestError("input_ids", "handover prompt differs from the request's")
        req.seed = h.seed
        req.output_ids = list(h.output_ids)
        req.num_computed = h.num_computed
        req.num_sent_tokens = len(req.output_ids)  # the prefill side delivered those
        req.input_logprobs, req.input_top_logprobs = list(h.input_logprobs), list(h.input_top_logprobs)
        req.output_logprobs, req.output_top_logprobs = list(h.output_logprobs), list(h.output_top_logprobs)
        if req.grammar is not None:
            for tok in req.output_ids:
                req.grammar.accept(tok)
        req.first_token_time = req.last_token_time = time.monotonic()
        req.update_text()
        outs = self._serve(req, lambda: self._installs.append((req, h)))
        try:
            async for out in outs:
                yield out
        finally:  # as in ``generate``
            await outs.aclose()

    def _install_pending(self) -> None:
        """Loop thread: admit waiting handovers while pages and slots allow, install them.
        One that has waited longer than ``--handover-wait-timeout`` ends with finish_reason
        abort (its state is dropped: the prefill replica already freed its copy)."""
        with self._lock:
            limit = self.args.handover_wait_timeout
            now = time.monotonic()
            for req, h in [x for x in self._installs if now - x[0].arrival_time > limit]:
                self._installs.remove((req, h))
                self.metrics.observe_handover(0.0, 0, ok=False)
                req.abort(f"no KV pages / state slot free on the decode replica within "
                          f"{limit:g} s (--handover-wait-timeout)")
                self._deliver_final(req)
            admitted = []
            while self._installs and self.scheduler.admit_installed(self._installs[0][0]):
                admitted.append(self._installs.pop(0))
        for req, h in admitted:
            try:
                self.runner.install_request_state(h.kv, h.conv, h.rec, req.pages, req.state_slot, req)
            except Exception as e:
                logger.exception("handover install failed")
                with self._lock:
                    self.metrics.observe_handover(0.0, 0, ok=False)
                    if self.scheduler.abort(req.rid, f"handover install failed: {type(e).__name__}: {e}"):
                        self._deliver([req])
                continue
            with self._lock:
                self.metrics.observe_handover(max(0.0, time.time() - h.export_time), h.nbytes)

    def _export_finished_prefills(self) -> None:
        """Loop thread, right after a step: copy out the state of requests that stopped after
        their first token and hand it to their consumers; then free their pages and slot."""
        with self._lock:
            reqs = list(self.scheduler.exported)
        for req in reqs:
            t0 = time.time()
            try:
                kv, conv, rec = self.runner.export_request_state(req.pages, req.state_slot)
                err = None
            except Exception as e:
                logger.exception("handover export failed")
                err = e
            with self._lock:
                self.scheduler.release_exported(req)
                if err is not None:
                    self.metrics.observe_handover(0.0, 0, ok=False)
                    req.abort(f"handover export failed: {type(err).__name__}: {err}")
                    self._deliver([req])
                    continue
                h = RequestHandover(
                    request=req.request, prompt_ids=list(req.prompt_ids),
                    output_ids=list(req.output_ids), seed=req.seed, num_computed=req.num_computed,
                    page_size=self.args.page_size, kv=kv, conv=conv, rec=rec,
                    input_logprobs=list(req.input_logprobs),
                    input_top_logprobs=list(req.input_top_logprobs),
                    output_logprobs=list(req.output_logprobs),
                    output_top_logprobs=list(req.output_top_logprobs), export_time=t0)
                target = self._consumers.get(req.rid)
                if target is not None:
                    loop, queue = target
                    item = {"handover": h, "output": self._output(req).materialize(),
                            "meta_info": {"finish_reason": None}}
                    try:
                        loop.call_soon_threadsafe(queue.put_nowait, item)
                    except RuntimeError:
                        pass

    def add_request(self, obj: GenerateReqInput) -> Req:
        """Validate and queue a request with no consumer (its outputs are not delivered)."""
        req = self._make_req(obj)
        with self._lock:
            self._submit(req, lambda: self.scheduler.add_request(req))
            self._wake.notify()
        return req

    def _submit(self, req: Req, submit: Callable[[], None]) -> None:
        """``submit()`` a new request now, or hold it until a pending weight swap is done
        (it then runs on the new weights). Lock held."""
        if self._weight_swap is not None:
            self._held.append((req, submit))
        else:
            submit()

    def abort_request(self, rid: str) -> bool:
        """Abort a queued or running request; its pages and slot are free on return."""
        with self._lock:
            for queue in (self._installs, self._held):
                for i, (pending, _) in enumerate(queue):
                    if pending.rid != rid:
                        continue
                    del queue[i]
                    pending.abort("Aborted by the client or the server")
                    self._deliver([pending])
                    return True
            req = self.scheduler.abort(rid, "Aborted by the client or the server")
            if req is not None:
                self._deliver([req])
            return req is not None

    def flush_cache(self) -> bool:
        """Empty the prefix cache (any time): unlocked entries are freed now, entries running
        requests use are detached and freed when those requests release them. True."""
        with self._lock:
            if self.scheduler.prefix is not None:
                self.scheduler.prefix.flush()
            return True

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> dict:
        """Serve the weights of checkpoint ``model_path`` (same architecture) from now on,
        without a restart. Blocks until done; returns SGLang's answer
        ``{"success", "message", "num_paused_requests"}``. Call it from any thread but the
        loop's (the HTTP route runs it on a worker thread).

        The checkpoint is read on the host in the engine's dtype, checked (config, every
        param's shape and dtype) and placed as the serving params are; any problem answers
        ``success: False`` naming it and changes nothing. Then requests arriving are held; the
        ones already in the engine finish on the old weights (``abort_all_requests``: they are
        aborted, finish_reason abort); with no step in flight and the pools idle the loop
        swaps the params (same shapes, shardings and layouts: nothing recompiles), flushes the
        prefix cache (its KV pages and GDN snapshots came from the old weights), sets
        ``weight_version`` (``weight_version``, else the old one incremented) and releases the
        held requests, which run on the new weights (``num_paused_requests`` counts them).
        """
        with self._update_lock:
            t0 = time.perf_counter()
            try:
                if load_format not in weight_update.LOAD_FORMATS:
                    raise weight_update.WeightUpdateError(
                        f"load_format {load_format!r} is not supported (safetensors checkpoints: "
                        "'auto' or 'safetensors')")
                if self.args.nnodes > 1:
                    raise weight_update.WeightUpdateError(
                        "weight updates are not supported with --nnodes > 1")
                host = weight_update.load_host_params(
                    model_path, self.model_config, self.runner.param_spec, dtype=DTYPES[self.args.dtype])
                placed = self.runner.place_params(host)
                del host
                weight_update.check_placed(self.runner.params, placed)
                jax.block_until_ready(placed)
            except weight_update.WeightUpdateError as e:
                return weight_update.update_result(False, str(e))
            except Exception as e:  # e.g. out of device memory while placing: nothing changed
                logger.exception("loading weights from %s failed", model_path)
                return weight_update.update_result(
                    False, f"loading weights from {model_path} failed: {type(e).__name__}: {e}")
            load_s = time.perf_counter() - t0
            swap = weight_update.PendingSwap(
                placed, weight_update.next_weight_version(self.weight_version, weight_version), model_path)
            del placed
            with self._lock:
                if self._stop or self._loop_dead():
                    return weight_update.update_result(False, "the scheduler loop is not running")
                self._weight_swap = swap
                if abort_all_requests:
                    self._abort_all("Aborted for a weight update (abort_all_requests)", held=False)
                self._wake.notify_all()
            if self._thread.ident is None and not self._swap_if_idle():  # no loop (step() callers)
                self._cancel_swap(swap, "requests are running and no scheduler loop steps them")
            while not swap.done.wait(0.1):
                if self._stop or self._loop_dead():
                    self._cancel_swap(swap, "the scheduler loop stopped before the swap")
            result = swap.result
            if result["success"]:
                result["message"] += f" (loaded in {load_s:.2f} s)"
                logger.info("weight update: %s", result["message"])
            return result

    def _swap_if_idle(self) -> bool:
        """Loop thread (or an update's caller without one): swap in the pending weights if no
        request is left on the old ones; True when it did. No step may be in flight."""
        with self._lock:
            swap = self._weight_swap
            if swap is None or not self.scheduler.is_idle() or self._installs:
                return False
        try:
            self.runner.replace_params(swap.params)
        except Exception as e:  # the old params are still the runner's
            logger.exception("swapping in the new weights failed")
            self._cancel_swap(swap, f"swapping in the new weights failed: {type(e).__name__}: {e}")
            return False
        with self._lock:
            if self.scheduler.prefix is not None:
                self.scheduler.prefix.flush()  # nothing runs: every entry is freed now
            self.weight_version = swap.version
            held, self._held, self._weight_swap = self._held, [], None
            for _, submit in held:
                submit()
            waited = time.monotonic() - swap.queued_at
            swap.finish(True, f"Succeeded to update model weights from {swap.model_path}: "
                        f"weight_version {swap.version!r}; waited {waited:.2f} s for running "
                        f"requests", num_paused_requests=len(held))
        return True

    def _cancel_swap(self, swap: weight_update.PendingSwap, message: str) -> None:
        """Give up a pending swap (old weights stay): held requests are queued now, or aborted
        when the loop is gone; the update answers failure with ``message``."""
        with self._lock:
            if self._weight_swap is not swap:
                return  # done meanwhile
            self._weight_swap = None
            held, self._held = self._held, []
            for req, submit in held:
                if self._stop or self._loop_dead():
                    req.abort(f"weight update failed: {message}")
                    self._deliver_final(req)
                else:
                    submit()
            self._wake.notify_all()
            swap.finish(False, message)

    def get_model_info(self) -> dict:
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path,
            "is_generation": True,
            "served_model_name": self.args.served_model_name,
            "model_type": self.model_config.model_type,
            "vocab_size": self.model_config.vocab_size,
            "context_length": self.args.context_length,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    def get_server_info(self) -> dict:
        info = self.args.to_dict()
        with self._lock:
            info.update(self.stats)
        stats = self.pool_stats()
        info.update(stats)
        info.update({
            "num_retracted_reqs": stats["num_retracted_total"],
            "num_pages": self.num_pages,
            "num_pages_per_rank": self.num_pages_per_rank,
            "warmup_seconds": self.warmup_seconds,
            "token_buckets": list(self.runner.token_buckets),
            "request_buckets": list(self.runner.req_buckets),
            "jax_backend": jax.default_backend(),
            "version": "0.1.0",
            "weight_version": self.weight_version,
            "mem_budget": None if self.mem_budget is None else self.mem_budget.to_dict(),
        })
        return info

    def get_load(self) -> list[dict]:
        """SGLang's ``/get_load``: one entry per DP rank. ``num_reqs``: running + waiting,
        ``num_waiting_reqs``: waiting, ``num_tokens``: KV tokens in use (pages held, less the
        prefix cache's evictable ones, times page_size) + the waiting requests' prompt tokens.
        The waiting queue is shared by the ranks (a request is placed when admitted), so it
        is counted under ``dp_rank`` 0."""
        stats = self.pool_stats()
        with self._lock:
            waiting = self.scheduler.num_waiting
            waiting_tokens = sum(len(r.prompt_ids) for r in self.scheduler.waiting)
        loads = []
        for k, r in enumerate(stats["dp_ranks"]):
            w, wt = (waiting, waiting_tokens) if k == 0 else (0, 0)
            loads.append({"dp_rank": k, "num_reqs": r["num_running"] + w, "num_waiting_reqs": w,
                          "num_tokens": r["kv_pages_used"] * self.args.page_size + wt})
        return loads

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """Start a ``jax.profiler`` trace into ``output_dir`` (default
        ``$SGLANG_TORCH_PROFILER_DIR`` or /tmp); with ``num_steps`` it stops by itself after
        that many engine steps. Returns the directory. InvalidRequestError when one runs."""
        return self.profiler.start(output_dir, num_steps, self.stats["num_steps"])

    def stop_profile(self) -> str:
        """Stop the trace and write it (``<dir>/plugins/profile/<run>/*.xplane.pb``); returns
        the directory. InvalidRequestError when none runs."""
        return self.profiler.stop()

    async def health_generate(self) -> bool:
        first = next(iter(sorted(self.eos_ids)), 0)
        tok = 1 if first != 1 else 3
        obj = GenerateReqInput(input_ids=[tok], sampling_params={"max_new_tokens": 1, "temperature": 0})
        req = self._make_req(obj)
        last = None
        outs = self._serve(req, lambda: self.scheduler.add_request(req))  # no queue limit
        try:
            async for out in outs:
                last = out
        finally:
            await outs.aclose()
        return last is not None and last["meta_info"]["finish_reason"]["type"] != "abort"

    def _loop_dead(self) -> bool:
        """The loop thread was started and has ended without ``shutdown``."""
        return self._thread.ident is not None and not self._thread.is_alive() and not self._stop

    def health_error(self) -> str | None:
        """Why the engine cannot serve (``/health`` answers 503 with it), or None: the loop
        thread died, or it has had work without finishing a step for longer than
        ``--watchdog-timeout`` seconds."""
        if self._loop_dead():
            return f"the scheduler loop died ({self.loop_error or 'no error recorded'})"
        stalled = self.loop_stalled_for()
        if stalled > self.args.watchdog_timeout:
            return (f"the scheduler loop has made no progress for {stalled:.0f} s "
                    f"(--watchdog-timeout {self.args.watchdog_timeout:g})")
        return None

    def is_healthy(self) -> bool:
        return self.health_error() is None

    def pool_stats(self) -> dict:
        """Pool usage summed over the DP ranks, and each rank's own under ``dp_ranks``."""
        with self._lock:
            sched = self.scheduler
            ranks = [dict(p.stats(), num_running=len(sched.running_on(k)),
                          num_admitted_total=sched.num_admitted_per_rank[k])
                     for k, p in enumerate(sched.pools)]
            for k, r in enumerate(ranks):
                cache = (sched.prefix.stats(k) if sched.prefix is not None else
                         dict(kv_pages_cached=0, kv_pages_evictable=0, kv_pages_evicted_total=0,
                              gdn_snapshots_used=0, gdn_snapshots_total=0))
                r.update(cache)
                r["kv_pages_used"] -= cache["kv_pages_evictable"]  # SGLang: evictable is free
            totals = {key: sum(r[key] for r in ranks) for key in
                      ("kv_pages_used", "kv_pages_total", "state_slots_used", "state_slots_total",
                       "kv_pages_cached", "kv_pages_evictable", "kv_pages_evicted_total",
                       "gdn_snapshots_used",
                       "gdn_snapshots_total")}
            return {
                **totals,
                "num_running": sched.num_running,
                "num_queued": sched.num_waiting + len(self._held),
                "num_retracted_total": sched.num_retracted_total,
                "num_aborted_total": sched.num_aborted_total,
                "num_finished_total": sched.num_finished_total,
                "num_prefill_tokens_total": sched.num_prefill_tokens_total,
                "num_cached_tokens_total": sched.num_cached_tokens_total,
                "token_usage": totals["kv_pages_used"] / totals["kv_pages_total"],
                "dp_ranks": ranks,
            }

    def metrics_text(self) -> bytes:
        """Prometheus text exposition of this engine's metrics (``GET /metrics``)."""
        return self.metrics.render(self.pool_stats())

    def shutdown(self) -> None:
        """Abort every request, stop the loop thread (and the offline API's event loop, a
        running profile trace)."""
        self.profiler.stop_if_running()
        with self._lock:
            self._stop = True
            self._abort_all("server shutting down")
            self._wake.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.runner.close()  # multi-host: stop the followers
        self._close_offline()

    def _abort_all(self, message: str, held: bool = True) -> None:
        """Abort every queued, running and installing request, and (``held``) those held
        for a weight swap, and deliver them (lock held)."""
        for req in list(self.scheduler.all_requests()):
            self.scheduler.abort(req.rid, message)
            self._deliver_final(req)
        for req, _ in self._installs + (self._held if held else []):
            req.abort(message)
            self._deliver_final(req)
        self._installs.clear()
        if held:
            self._held.clear()

    # Scheduler loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        """Launch step i+1, then complete step i (overlap: the host builds the next step and
        processes the last one's outputs while the device runs), or one step at a time."""
        launched = None  # the step on the device whose outputs are not processed yet
        try:
            while True:
                with self._lock:
                    while (not self._stop and launched is None and self.scheduler.is_idle()
                           and not self._installs and self._weight_swap is None):
                        self._wake.wait()
                        self.last_step_end = time.monotonic()  # idle is progress
                    if self._stop:
                        return
                if launched is None and self._weight_swap is not None and self._swap_if_idle():
                    continue
                nxt = self._launch()
                if launched is not None:
                    self._complete(launched)
                launched = nxt
                if launched is not None and not self.overlap:
                    self._complete(launched)
                    launched = None
                if nxt is None and launched is None:
                    self.last_step_end = time.monotonic()  # a failed or empty step: progress
                    time.sleep(0.001)
        except BaseException as e:  # the phases recover from Exceptions; anything else ends the loop
            self.loop_error = f"{type(e).__name__}: {e}"
            logger.critical("scheduler loop died", exc_info=True)
            if self._lock.acquire(timeout=10):
                try:
                    self._abort_all(f"internal error: scheduler loop died: {self.loop_error}")
                finally:
                    self._lock.release()

    def loop_stalled_for(self) -> float:
        """Seconds the loop has had work without finishing a step (0 when idle or dead-free).
        A health check compares it with its own limit; a dead loop thread reports inf."""
        if self._loop_dead():
            return float("inf")
        with self._lock:
            if self.scheduler.is_idle() and not self._installs:
                return 0.0
        return max(0.0, time.monotonic() - self.last_step_end)

    def _inject(self, phase: str) -> None:
        if self.fault_injector is not None:
            self.fault_injector(phase)

    def step(self):
        """One scheduling + model step, completed before returning (for callers that drive the
        engine themselves: ``start_loop=False``); returns the batch, or None when nothing ran.

        Each phase (``PHASES``) that raises fails only its step's requests (``_fail_step``);
        a failed step is progress too (its requests got their answer)."""
        launched = self._launch()
        if launched is not None:
            self._complete(launched)
        self.last_step_end = time.monotonic()
        return None if launched is None else launched.batch

    def _launch(self):
        """Schedule a step and dispatch it to the device (phases "schedule" and "model");
        None when nothing runs now (idle, waiting for the step in flight, or failed)."""
        if self._installs:
            self._install_pending()
        with self._lock:
            try:
                self._inject("schedule")
                batch = self.scheduler.schedule()
            except Exception as e:
                msg = self._count_error("schedule", e)
                for req in self.scheduler.fail_all(msg):
                    self._deliver_final(req)
                batch = None
        if batch is None:
            return None
        try:
            self._inject("model")
            launched = self.runner.launch(batch)
        except Exception as e:  # a failed step must not kill the server: fail its requests
            with self._lock:
                self._fail_step(batch, "model", e)
            return None
        with self._lock:
            self.scheduler.on_launch(batch)
        return launched

    def _complete(self, launched) -> None:
        """Fetch a launched step's outputs (phase "model"), advance its requests
        ("process_result") and deliver their outputs ("deliver")."""
        batch = launched.batch
        try:
            results = self.runner.complete(launched)
        except Exception as e:
            with self._lock:
                self._fail_step(batch, "model", e)
            return
        with self._lock:
            try:
                self._inject("process_result")
                touched = self.scheduler.process_result(batch, results)
                self.stats["num_steps"] += 1
                self.stats["generation_tokens_total"] += sum(1 for c in batch.chunks if c.sample)
                self.metrics.on_step(batch.chunks, touched)
                if self.runner.last_router_stats is not None:
                    self.metrics.on_router_stats(self.runner.last_router_stats)
            except Exception as e:
                self._fail_step(batch, "process_result", e)
                return
            try:
                self._inject("deliver")
                self._deliver(touched)
            except Exception as e:
                self._fail_step(batch, "deliver", e)
                return
        if self.scheduler.exported:
            self._export_finished_prefills()
        self.profiler.on_step(self.stats["num_steps"])
        self.last_step_end = time.monotonic()

    def _count_error(self, phase: str, e: Exception) -> str:
        """Log a step fault, count it; returns the abort message for its requests."""
        logger.error("step failed in phase %s", phase, exc_info=e)
        self.stats["num_errors"] += 1
        return f"internal error: {type(e).__name__}: {e}"

    def _fail_step(self, batch, phase: str, e: Exception) -> None:
        """A step's phase raised (lock held): abort its chunks' requests (pages and slots freed),
        give back the snapshots it had not committed, deliver every request's final output
        (one that finished normally before the fault keeps its own finish_reason)."""
        msg = self._count_error(phase, e)
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.discard(batch.state_saves)  # what commit left
        for c in batch.chunks:
            req = c.req
            if c.sample and phase != "process_result":  # (process_result took it back already)
                req.num_inflight = max(0, req.num_inflight - 1)
            if self.scheduler.abort(req.rid, msg) is None and not req.finished:
                continue  # not the scheduler's any more (handover export path)
            self._deliver_final(req)

    def _deliver_final(self, req: Req) -> None:
        """Deliver a finished request's final output, once; falls back to a bare output when
        building the full one fails (the consumer must not wait forever)."""
        if req.final_delivered:
            return
        try:
            self._deliver([req])
        except Exception:
            logger.exception("building the final output of %s failed", req.rid)
            target = self._consumers.get(req.rid)
            req.final_delivered = True
            if target is not None:
                out = {"text": "", "output_ids": [], "meta_info": {
                    "id": req.rid, "finish_reason": dict(req.finish_reason),
                    "prompt_tokens": len(req.prompt_ids), "completion_tokens": 0, "cached_tokens": 0}}
                try:
                    target[0].call_soon_threadsafe(target[1].put_nowait, out)
                except RuntimeError:
                    pass

    def _deliver(self, reqs: list[Req]) -> None:
        """Push outputs to consumers (caller holds the lock)."""
        interval = self.args.stream_interval
        for req in reqs:
            if req.finished:
                if req.final_delivered:
                    continue
                self.metrics.on_finish(req)
            target = self._consumers.get(req.rid)
            if target is None:
                req.final_delivered = req.finished
                continue
            if not req.finished:
                if not req.stream or len(req.output_ids) - req.num_sent_tokens < interval:
                    continue
            req.num_sent_tokens = len(req.output_ids)
            loop, queue = target
            out = self._output(req)
            req.final_delivered = req.finished
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _token_text(self, req: Req, tok: int) -> str | None:
        return self.tokenizer.decode([tok]) if getattr(req, "return_text_in_logprobs", False) else None

    def _top_entries(self, req: Req, tops: list[tuple[float, int]]) -> list[list]:
        return [[lp, tid, self._token_text(req, tid)] for lp, tid in tops]

    def _logprob_entries(self, req: Req) -> LogprobEntries:
        """``req``'s built logprob entries, extended by what it computed since the last call
        (each entry is built once: cost proportional to the new tokens, not the total)."""
        e = req.logprob_entries
        if e is None:
            e = req.logprob_entries = LogprobEntries()
        s = req.logprob_start_len
        num_in = len(req.prompt_ids) - s  # prompt positions reported: s .. P-1
        # input_token_logprobs[i] = [input_logprobs[i-1] (None for i = 0), prompt_ids[s+i], text]
        for i in range(len(e.input_tokens), min(num_in, 1 + len(req.input_logprobs))):
            t = req.prompt_ids[s + i]
            e.input_tokens.append([req.input_logprobs[i - 1] if i else None, t, self._token_text(req, t)])
        for i in range(len(e.output_tokens), min(len(req.output_logprobs), len(req.output_ids))):
            t = req.output_ids[i]
            e.output_tokens.append([req.output_logprobs[i], t, self._token_text(req, t)])
        if req.top_logprobs_num > 0:
            # input_top_logprobs = [None] + one list per reported input logprob
            for i in range(len(e.input_tops) - 1, min(num_in - 1, len(req.input_top_logprobs))):
                e.input_tops.append(self._top_entries(req, req.input_top_logprobs[i]))
            for i in range(len(e.output_tops), len(req.output_top_logprobs)):
                e.output_tops.append(self._top_entries(req, req.output_top_logprobs[i]))
        e.input_complete = len(e.input_tokens) == num_in and (
            req.top_logprobs_num == 0 or len(e.input_tops) == num_in)
        return e

    def _output(self, req: Req) -> "OutputSnapshot":
        """``req``'s SGLang output so far (cumulative text, ids and logprob lists) as an
        :class:`OutputSnapshot`: O(new tokens) under the lock (new logprob entries are built by
        ``_logprob_entries``, the lists are only measured); the consumer materialises it."""
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": dict(req.finish_reason) if req.finish_reason else None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
        }
        if req.finished:
            meta["e2e_latency"] = time.monotonic() - req.arrival_time
        lists = {"output_ids": (req.output_ids, len(req.output_ids))}
        if req.return_logprob:
            e = self._logprob_entries(req)
            lists["input_token_logprobs"] = (e.input_tokens, len(e.input_tokens))
            lists["output_token_logprobs"] = (e.output_tokens, len(e.output_tokens))
            if req.top_logprobs_num > 0:
                lists["input_top_logprobs"] = (e.input_tops, len(e.input_tops))
                lists["output_top_logprobs"] = (e.output_tops, len(e.output_tops))
        return OutputSnapshot(req.text, meta, lists)


class OutputSnapshot:
    """One delivery of a request's output, taken under the engine lock in O(1): the text (a
    str), the scalar meta_info, and each cumulative list as (list, length at delivery). The
    lists are append-only, so ``materialize()`` (run by the consumer, off the lock) copies
    exactly what they held then: an earlier output never changes."""

    __slots__ = ("text", "meta", "lists")

    def __init__(self, text: str, meta: dict, lists: dict[str, tuple[list, int]]):
        self.text, self.meta, self.lists = text, meta, lists

    def materialize(self) -> dict:
        """The SGLang output dict: {"text", "output_ids", "meta_info"}."""
        meta = dict(self.meta)
        for key, (values, n) in self.lists.items():
            if key != "output_ids":
                meta[key] = values[:n]
        ids, n = self.lists["output_ids"]
        return {"text": self.text, "output_ids": ids[:n], "meta_info": meta}


class LogprobEntries:
    """One request's SGLang logprob entries built so far (``Engine._logprob_entries``).

    input_tokens / output_tokens: ``[logprob | None, token_id, text | None]`` per position;
    input_tops / output_tops: per position a list of such entries (input_tops starts with
    SGLang's ``None`` for the first prompt position). Append-only; input_complete says the
    input lists reached their final length.
    """

    __slots__ = ("input_tokens", "input_tops", "output_tokens", "output_tops", "input_complete")

    def __init__(self):
        self.input_tokens: list[list] = []
        self.input_tops: list[list[list] | None] = [None]
        self.output_tokens: list[list] = []
        self.output_tops: list[list[list]] = []
        self.input_complete = False
