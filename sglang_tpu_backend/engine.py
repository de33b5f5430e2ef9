"""Engine: the public API over one model's components.

Built from ``ServerArgs`` (SGLang flag names), it wires:

- ``managers/request_builder.py``: validation and tokenisation into a ``Req``;
- ``managers/scheduler.py``: what each step runs (continuous batching, chunked prefill,
  retraction, the prefix cache);
- ``managers/scheduler_loop.py``: the loop thread, each step's guarded phases, health;
- ``model_executor/model_runner.py``: the jitted step on one device, DP ranks, TP or a
  multi-host mesh;
- ``managers/delivery.py`` + ``managers/output_builder.py``: SGLang-format outputs pushed to
  each request's consumer;
- ``managers/handover_manager.py``: disaggregated prefill export / decode install;
- ``managers/weight_updater.py``: weight updates without a restart (from a checkpoint
  directory or from named tensors);
- ``managers/rl_control.py``: SGLang's RL controls (pause / continue generation, release /
  resume memory occupation).

``generate_request`` is the request-level API the HTTP routes and the Ray app use (SGLang's
``TokenizerManager.generate_request``): an async iterator of output dicts for one prompt;
leaving it early aborts the request and frees its pages and slot at once. The offline API
(``generate`` like ``sglang.Engine``) wraps an Engine: ``entrypoints/offline.py``.

With ``--nnodes N`` the DP ranks span N processes: this engine is node 0's (it joins the
process group first), the other nodes run ``parallel.node.run_follower``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from typing import AsyncIterator, Awaitable, Callable

import jax

from sglang_tpu_backend.config import DTYPES
from sglang_tpu_backend.constrained.grammar import GrammarBackend
from sglang_tpu_backend.managers.delivery import Delivery
from sglang_tpu_backend.managers.handover import RequestHandover
from sglang_tpu_backend.managers.handover_manager import HandoverManager
from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError, ServiceUnavailableError
from sglang_tpu_backend.managers.output_builder import OutputBuilder, OutputSnapshot
from sglang_tpu_backend.managers.request_builder import RequestBuilder
from sglang_tpu_backend.managers.rl_control import RLControl
from sglang_tpu_backend.managers.weight_group import WeightGroups
from sglang_tpu_backend.managers.schedule_batch import Req
from sglang_tpu_backend.managers.scheduler import Scheduler
from sglang_tpu_backend.managers.scheduler_loop import BETWEEN_STEPS, PHASES, SchedulerLoop
from sglang_tpu_backend.managers.engine_status import EngineStatus
from sglang_tpu_backend.managers.startup import BackendOpener, StartupPhases
from sglang_tpu_backend.managers.weight_updater import WeightUpdater
from sglang_tpu_backend.metrics import EngineMetrics
from sglang_tpu_backend.metrics.router_stats import ROUTED
from sglang_tpu_backend.planning.mem_budget import size_serving_args
from sglang_tpu_backend.model_executor import background_warmup
from sglang_tpu_backend.model_executor.model_runner import ModelRunner
from sglang_tpu_backend.model_executor.parallel_compile import compile_threads
from sglang_tpu_backend.model_executor.step_buckets import (
    deterministic_prefill_reqs, deterministic_prefill_rows)
from sglang_tpu_backend.server_args import DETERMINISTIC_MIN_CHUNK, ServerArgs
from sglang_tpu_backend.model_loader.tiny_model import with_default_model

logger = logging.getLogger(__name__)
ABORTED_BY_CLIENT = "Aborted by the client or the server"


def deterministic_limits(args: ServerArgs) -> dict:
    """Scheduler limits of ``--enable-deterministic-inference``: prefill chunks aligned to the
    GDN chunk size, as many chunks and logits rows per step as the runner's fixed prefill
    shape has."""
    running = args.max_running_requests_per_rank
    return dict(prefill_align=DETERMINISTIC_MIN_CHUNK,
                max_prefill_chunks=deterministic_prefill_reqs(running),
                max_logits_rows=deterministic_prefill_rows(running, args.max_tokens_per_step))


def _initial_expert_location(args: ServerArgs, cfg) -> Any:
    """The expert placement an EP / EPLB engine starts from (None: the identity, no table)."""
    if not args.uses_expert_location:
        return None
    from sglang_tpu_backend.model_executor.expert_balancer import initial_location

    return initial_location(cfg, num_redundant=args.ep_num_redundant_experts,
                            init_expert_location=args.init_expert_location,
                            num_ranks=args.ep_size)


def _overlap_schedule(args: ServerArgs, runner: ModelRunner) -> bool:
    """Whether the loop launches step i+1 before completing step i: unless turned off, when
    decode inputs can be read on the device (one device, no DP / TP) and without
    speculative decoding (a step's drafts are proposed on the host from the tokens the
    previous step accepted, so that step must be complete first)."""
    return not (args.disable_overlap_schedule or not runner.backend.in_flight_inputs
                or args.speculative_algorithm)


def _mtp_params(args: ServerArgs, cfg, role: str):
    """The checkpoint's MTP params under --speculative-algorithm NEXTN / EAGLE (else None);
    ValueError naming the flag when the checkpoint has none, or when a prefill / decode role
    runs with --tp-size > 1 (the handover moves the MTP KV of one device or of DP ranks)."""
    algo = args.speculative_algorithm
    if algo not in ("NEXTN", "EAGLE"):
        return None
    flag = f"--speculative-algorithm {algo}"
    if role in ("prefill", "decode") and args.tp_size > 1:
        raise ValueError(f"{flag}: a {role} replica hands the MTP KV cache over from one device "
                         "or DP ranks, not with --tp-size > 1; use NGRAM there")
    if not cfg.mtp_num_hidden_layers:
        raise ValueError(f"{flag} needs MTP layers: {args.model_path}'s config has "
                         "mtp_num_hidden_layers 0")
    if args.load_format == "dummy":
        raise ValueError(f"{flag} reads the checkpoint's MTP weights: not with --load-format dummy")
    from sglang_tpu_backend.model_loader.loader import load_mtp_params

    mtp = load_mtp_params(args.model_path, cfg, dtype=DTYPES[args.dtype])
    if mtp is None:
        raise ValueError(f"{flag} needs MTP weights: {args.model_path} has no mtp.* tensors")
    return mtp


def _make_runner(args: ServerArgs, cfg, params, mtp_params, num_pages: int, role: str
                 ) -> tuple[ModelRunner, background_warmup.FirstStage | None]:
    """The model runner of ``args``: ``num_pages`` KV pages and the state slots per DP rank,
    the weights (``params``) loaded and placed; and, where a staged warm-up applies, its
    first stage, whose programs compiled while the weights loaded."""
    running, det = args.max_running_requests_per_rank, args.enable_deterministic_inference
    routed = args.enable_return_routed_experts
    first: list[background_warmup.FirstStage] = []

    def before_load(runner: ModelRunner) -> None:
        if (not args.skip_warmup and args.staged_warmup(jax.default_backend())
                and background_warmup.applies(runner, role)):
            first.append(background_warmup.FirstStage(
                runner, compile_threads(args.warmup_compile_threads)))

    runner = ModelRunner(
        cfg, params, page_size=args.page_size, num_pages=num_pages,
        num_state_slots=running, max_running_requests=running,
        max_tokens_per_step=args.max_tokens_per_step, context_length=args.context_length,
        kv_dtype=args.kv_storage_dtype(jax.default_backend()), impl=args.kernel_impl,
        max_top_logprobs_num=args.max_top_logprobs_num, dp_size=args.dp_size,
        tp_size=args.tp_size, num_gdn_snapshots=args.num_gdn_snapshots_per_rank,
        deterministic=det, expert_location=_initial_expert_location(args, cfg),
        router_stats=ROUTED if routed else True,
        eplb_rebalance_num_iterations=args.eplb_rebalance_num_iterations
        if args.enable_eplb else None, num_drafts=args.speculative_num_drafts,
        mtp_params=mtp_params, num_scheduler_steps=args.scheduler_steps(jax.default_backend()),
        before_load=before_load)
    return runner, (first[0] if first else None)


async def _last(outputs: AsyncIterator[dict]) -> dict | None:
    """The last output of ``outputs``; a caller cancelled meanwhile closes (aborts) it at once."""
    last = None
    try:
        async for last in outputs:
            pass
    finally:
        await outputs.aclose()
    return last


class Engine:
    """One model, one scheduler loop thread.

    ``Engine(server_args)`` or ``Engine(**ServerArgs fields)``. ``start_loop=False`` leaves
    stepping to the caller (``step()``; benchmarks, tests). ``role`` labels the metrics:
    colocated (standalone server), prefill or decode (disaggregated replicas).
    """

    def __init__(self, server_args: ServerArgs | None = None, *, start_loop: bool = True,
                 role: str = "colocated", **kwargs):
        from sglang_tpu_backend.config import load_model_config, resolve_dtype
        from sglang_tpu_backend.model_loader.sharded_loader import WeightSource
        from sglang_tpu_backend.tokenizer import load_tokenizer

        if server_args is not None and kwargs:
            raise TypeError(f"Engine: pass server_args or ServerArgs fields, not both "
                            f"(got {sorted(kwargs)})")
        args = server_args if server_args is not None else ServerArgs(**kwargs)
        if args.nnodes > 1:  # before anything touches a JAX device
            from sglang_tpu_backend.parallel import node

            if args.node_rank != 0:
                raise ValueError("--node-rank > 0 follows node 0's engine: run "
                                 "launch_server (or node.run_follower), not Engine")
            node.join(args)
        phases, opener = StartupPhases(), BackendOpener()  # the chip opens meanwhile
        args = with_default_model(args)
        self.tokenizer = load_tokenizer(args.tokenizer_path)
        self.model_config = cfg = load_model_config(args.model_path)
        phases.end("tokenizer_and_config")
        args.check_devices(len(opener.devices()), cfg.num_experts)  # before loading any weights
        phases.end("devices")  # (waiting for the open; it took opener.seconds on its thread)
        self.backend_open_seconds = opener.seconds
        self._enable_compilation_cache(args)  # before the load: its programs are cached too
        args = dataclasses.replace(args, dtype=resolve_dtype(args.dtype, args.model_path))
        args.check_role(role)
        mtp_params = _mtp_params(args, cfg, role)
        # Read by the runner's backend straight into its shardings (or drawn: dummy).
        params = WeightSource(cfg, args.model_path, args.load_format, DTYPES[args.dtype],
                              seed=args.random_seed)
        args, self.mem_budget = size_serving_args(args, cfg, jax.default_backend())
        self.args, dp = args, args.dp_size
        self.num_pages_per_rank = args.max_total_tokens // (args.page_size * dp)
        self.num_pages = self.num_pages_per_rank * dp  # all ranks
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self.scheduler = Scheduler.from_args(args, **(
            deterministic_limits(args) if args.enable_deterministic_inference else {}))
        routed = args.enable_return_routed_experts
        phases.end("other")
        self.runner, first_stage = _make_runner(args, cfg, params, mtp_params,
                                                self.num_pages_per_rank, role)
        phases.end("runner")  # the KV cache and state slots, the weights loaded and placed
        # Multi-step decode launches where the runner supports them (else single steps).
        self.scheduler.num_scheduler_steps = self.runner.num_scheduler_steps
        self.requests = RequestBuilder(
            self.tokenizer, vocab_size=cfg.vocab_size, context_length=args.context_length,
            kv_capacity_tokens=self.num_pages_per_rank * args.page_size
            - args.speculative_num_drafts, page_size=args.page_size,  # (k pages past the end)
            max_top_logprobs_num=self.runner.max_top_logprobs_num, eos_ids=self.eos_ids,
            grammar_backend=GrammarBackend(self.tokenizer, cfg.vocab_size, sorted(self.eos_ids)),
            random_seed=args.random_seed, per_rank=dp > 1, routed_experts=routed)
        self.metrics = EngineMetrics(args.served_model_name, role=role, dp_size=dp,
                                     num_moe_layers=cfg.num_hidden_layers,
                                     step_phases=PHASES + BETWEEN_STEPS)
        self.outputs = OutputBuilder(self.requests.decode_token, weight_version=args.weight_version,
                                     speculative=args.speculative_algorithm is not None)
        overlap = _overlap_schedule(args, self.runner)
        self.loop = SchedulerLoop(
            self.scheduler, self.runner, Delivery(self.outputs, self.metrics, args.stream_interval),
            self.metrics, overlap=overlap, watchdog_timeout=args.watchdog_timeout,
            max_consecutive_errors=args.max_consecutive_step_errors,
            fatal_step_faults=args.nnodes > 1, profile_max_seconds=args.profile_max_seconds)
        self.loop.handover = self.handover = HandoverManager(
            self.loop, self.runner, page_size=args.page_size, wait_timeout=args.handover_wait_timeout)
        self.loop.weights = self.weights = WeightUpdater(self.loop, self.runner, cfg, args)
        self.status, self.rl = EngineStatus(self), RLControl(self.loop, self.runner)
        self.background_warmup: background_warmup.BackgroundWarmup | None = None
        phases.end("other")
        self.warmup_seconds = 0.0 if args.skip_warmup else self._warm_up(role, first_stage)
        phases.end("warmup")
        # Seconds per start-up phase (a staged warm-up counts its first stage only)
        self.startup_seconds = phases.seconds
        logger.info("engine ready in %.1f s: %s (the backend opened in %.1f s beside the first)",
                    sum(phases.seconds.values()), ", ".join(
                        f"{k} {v:.1f} s" for k, v in phases.seconds.items()), opener.seconds)
        if start_loop:
            self.loop.start()

    def _warm_up(self, role: str, first_stage: background_warmup.FirstStage | None) -> float:
        """Compile every step program (staged: those of one prefill bucket, compiling since
        before the weights loaded where ``first_stage``, the rest in the background,
        ``background_warmup.py``), and a disaggregated role's handover programs (export on a
        prefill engine, install on a decode engine); returns seconds taken."""
        t0 = time.perf_counter()
        threads = compile_threads(self.args.warmup_compile_threads)
        if (self.args.staged_warmup(jax.default_backend())
                and background_warmup.applies(self.runner, role)):
            _, self.background_warmup = background_warmup.start(self.runner, self.scheduler,
                                                                True, threads, first_stage)
            return time.perf_counter() - t0
        self.runner.warmup(compile_threads=threads)
        if role in ("prefill", "decode") and self.runner.backend.state_transfer:
            self.runner.warm_up_state_transfer(gather=role == "prefill", scatter=role == "decode")
        return time.perf_counter() - t0

    @staticmethod
    def _enable_compilation_cache(args: ServerArgs) -> None:
        if args.compilation_cache_dir == "":
            return
        from sglang_tpu_backend.model_executor.compile_cache import enable_persistent_cache
        from sglang_tpu_backend.model_loader.tiny_model import cache_root

        enable_persistent_cache(args.compilation_cache_dir or cache_root() / "jax-compilation-cache")

    # Loop state the tests and the Ray app read ---------------------------------------------
    @property
    def stats(self) -> dict:
        return self.loop.stats

    @property
    def overlap(self) -> bool:
        return self.loop.overlap

    @property
    def weight_version(self) -> str:
        return self.weights.version

    @property
    def fault_injector(self) -> Callable[[str], None] | None:
        return self.loop.fault_injector

    @fault_injector.setter
    def fault_injector(self, fn: Callable[[str], None] | None) -> None:
        self.loop.fault_injector = fn

    # Requests --------------------------------------------------------------------------------
    def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        """ONE prompt's outputs (cumulative; the last has ``finish_reason`` set). Raises
        InvalidRequestError on its first step, before anything is allocated; leaving early
        aborts the request."""
        async def build() -> Req:
            return await self.requests.build_async(obj)

        return self._serve(build, lambda req: self.scheduler.add_request(req), queue_limit=True)

    def add_request(self, obj: GenerateReqInput) -> Req:
        """Validate and queue a request with no consumer (its outputs are not delivered)."""
        req = self.requests.build(obj)
        with self.loop.lock:
            self.weights.submit(req, lambda: self.scheduler.add_request(req))
            self.loop.wake.notify()
        return req

    async def _serve(self, build: Callable[[], Awaitable[Req]], submit: Callable[[Req], None],
                     queue_limit: bool = False) -> AsyncIterator[dict]:
        """Build the request, register its consumer, ``submit(req)`` it (under the lock) and
        yield its outputs until one is final (finish_reason set, or a handover); leaving
        early aborts it. ServiceUnavailableError when the loop cannot serve, or
        (``queue_limit``) when ``--max-queued-requests`` requests are already waiting."""
        req = await build()
        queue: asyncio.Queue = asyncio.Queue()
        loop, delivery = self.loop, self.loop.delivery
        with loop.lock:
            self._check_admission(req, queue_limit)
            delivery.register(req.rid, asyncio.get_running_loop(), queue)
            try:
                self.weights.submit(req, lambda: submit(req))
            except BaseException:
                delivery.unregister(req.rid)
                raise
            loop.stats["num_requests_total"] += 1
            loop.stats["prompt_tokens_total"] += len(req.prompt_ids)
            loop.wake.notify()
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
            with loop.lock:
                delivery.unregister(req.rid)
            if not done:
                self.abort_request(req.rid)

    def _check_admission(self, req: Req, queue_limit: bool) -> None:
        """Lock held: refuse a request the loop cannot serve now."""
        if self.loop.is_dead:
            raise ServiceUnavailableError(f"the scheduler loop is not running ({self.loop.loop_error})")
        self.rl.check_admission()
        limit = self.args.max_queued_requests
        waiting = self.scheduler.num_waiting + len(self.weights.held)
        if queue_limit and limit is not None and waiting >= limit:
            raise ServiceUnavailableError(
                f"The request queue is full ({waiting} requests waiting, "
                f"--max-queued-requests {limit}); retry later")
        if self.loop.delivery.has_consumer(req.rid):
            raise InvalidRequestError("rid", f"rid {req.rid!r} is already in use")

    def abort_request(self, rid: str = "", abort_all: bool = False) -> bool:
        """Abort a queued, running, installing or held request; its pages and slot are free
        on return. False when no such request is in the engine. ``abort_all`` (SGLang's
        flag): every request in the engine instead; True."""
        with self.loop.lock:
            if abort_all:
                self.loop.abort_all(ABORTED_BY_CLIENT)
                self.loop.wake.notify()
                return True
            if self.handover.abort(rid, ABORTED_BY_CLIENT) or self.weights.abort(rid, ABORTED_BY_CLIENT):
                return True
            req = self.scheduler.abort(rid, ABORTED_BY_CLIENT)
            if req is not None:
                self.loop.delivery.deliver([req])
                self.loop.wake.notify()  # its pages may admit a waiting handover
            return req is not None

    def step(self):
        """One step, completed before returning (with ``start_loop=False``); the batch, or
        None when nothing ran."""
        return self.loop.step()

    # Disaggregated prefill / decode ----------------------------------------------------------
    def _check_handover(self) -> None:
        if not self.runner.backend.state_transfer:
            raise NotImplementedError("prefill/decode handover needs one device or --dp-size "
                                      "ranks of one process (not --tp-size > 1 or --nnodes > 1)")

    async def prefill_for_handover(self, obj: GenerateReqInput) -> tuple[dict, RequestHandover | None]:
        """Prefill ``obj`` and sample its first token. Returns the output so far and the
        request's state to continue elsewhere, or (final output, None) when the request
        already finished here (EOS, a stop, ``max_new_tokens`` <= 1)."""
        self._check_handover()

        async def build() -> Req:
            return await self.requests.build_async(obj, export_after_prefill=True)

        last = await _last(self._serve(build, lambda req: self.scheduler.add_request(req),
                                       queue_limit=True))
        if "handover" in last:
            return last["output"], last["handover"]
        return last, None

    def generate_from_handover(self, h: RequestHandover) -> AsyncIterator[dict]:
        """Install ``h`` (pages + a slot here, its arrays scattered into them) and decode it
        to the end, yielding outputs as ``generate_request`` does (the first one when the
        next token is sampled)."""
        self._check_handover()

        async def build() -> Req:
            return await asyncio.to_thread(self.requests.build_from_handover, h)

        return self._serve(build, lambda req: self.handover.queue_install(req, h))

    # Control ---------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Empty the prefix cache (any time): unlocked entries are freed now, entries running
        requests use are detached and freed when those requests release them. True."""
        with self.loop.lock:
            if self.scheduler.prefix is not None:
                self.scheduler.prefix.flush()
            self.loop.wake.notify()  # freed pages may admit a waiting handover
        return True

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> dict:
        """Serve checkpoint ``model_path`` from now on (``managers/weight_updater.py``)."""
        self.rl.check_weights_present()
        return self.weights.update_weights_from_disk(model_path, load_format, abort_all_requests,
                                                     weight_version)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None,
                                   abort_all_requests: bool = False) -> dict:
        """Serve checkpoint-named arrays (``[(hf_name, array), ...]`` or a dict; numpy or
        jax.Array; any subset of the names) from now on; SGLang's answer ``{"success",
        "message", "num_paused_requests"}`` (``managers/weight_updater.py``)."""
        self.rl.check_weights_present()
        return self.weights.update_weights_from_tensor(named_tensors, load_format, flush_cache,
                                                       weight_version, abort_all_requests)

    def get_weight_version(self) -> str:
        return self.weights.version

    # Refit from a trainer process (``managers/weight_group.py``) ----------------------------
    @functools.cached_property
    def weight_groups(self) -> WeightGroups:
        """SGLang's weights update groups of this engine (made on first use)."""
        return WeightGroups(self)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "jax_transfer") -> dict:
        """Join the trainer's group (its ``WeightSender`` at master_address:master_port) as
        rank ``rank_offset``: ``{"success", "message"}``."""
        return self.weight_groups.init(master_address, master_port, rank_offset, world_size,
                                       group_name, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        weight_version: str | None = None) -> dict:
        """Pull the trainer's next refit (device to device) and serve it as
        ``update_weights_from_tensor`` does; its answer plus the transfer's seconds and GB/s."""
        self.rl.check_weights_present()
        return self.weight_groups.update(names, dtypes, shapes, group_name, flush_cache,
                                         weight_version)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self.weight_groups.destroy(group_name)

    # RL controls (``managers/rl_control.py``) ----------------------------------------------
    def pause_generation(self, mode: str = "abort") -> dict:
        return self.rl.pause_generation(mode)

    def continue_generation(self) -> dict:
        return self.rl.continue_generation()

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.rl.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.rl.resume_memory_occupation(tags)

    def start_expert_distribution_record(self) -> None:
        """Record the routed rows per expert and MoE layer from now on (recording runs from
        start-up too; this drops what was recorded)."""
        self._balancer().start_record()

    def stop_expert_distribution_record(self) -> None:
        self._balancer().stop_record()

    def dump_expert_distribution_record(self, output_dir: str) -> str:
        """Write the recorded rows per expert and MoE layer as a load file
        ``expert_distribution_<time ns>.json`` in ``output_dir`` (made if missing;
        ``--init-expert-location`` reads it); recorded from the router stats, with or without
        EPLB. Returns the file's path."""
        balancer = self._balancer()
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, f"expert_distribution_{time.time_ns()}.json")
        balancer.dump(path)  # a step replaces the record array, never edits it
        return path

    def _balancer(self):
        if self.runner.balancer is None:
            raise InvalidRequestError("expert_distribution", "expert loads are recorded from "
                                      "the router stats, which are off on this engine")
        return self.runner.balancer

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """Start a ``jax.profiler`` trace (``managers/profiler.py``); returns its directory."""
        return self.loop.profiler.start(output_dir, num_steps, self.stats["num_steps"])

    def stop_profile(self) -> str:
        """Stop the trace and write it; returns its directory."""
        return self.loop.profiler.stop()

    async def health_generate(self) -> bool:
        """Generate one token end to end (no queue limit); True when it was not aborted."""
        tok = 1 if 1 not in self.eos_ids else 3
        obj = GenerateReqInput(input_ids=[tok], sampling_params={"max_new_tokens": 1, "temperature": 0})

        async def build() -> Req:
            return self.requests.build(obj)

        last = await _last(self._serve(build, lambda req: self.scheduler.add_request(req)))
        return last is not None and last["meta_info"]["finish_reason"]["type"] != "abort"

    # Reports -----------------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        return self.status.model_info()

    def get_server_info(self) -> dict:
        return self.status.server_info()

    def get_load(self) -> list[dict]:
        return self.status.load()

    def pool_stats(self) -> dict:
        return self.status.pool_stats()

    def metrics_text(self) -> bytes:
        """Prometheus text exposition of this engine's metrics (``GET /metrics``)."""
        return self.metrics.render(self.pool_stats())

    def health_error(self) -> str | None:
        """Why the engine cannot serve (``/health`` answers 503 with it), or None."""
        return self.loop.health_error()

    def is_healthy(self) -> bool:
        return self.health_error() is None

    def loop_stalled_for(self) -> float:
        """Seconds the loop has had work without completing a step (inf: the loop is dead)."""
        return self.loop.stalled_for()

    def shutdown(self) -> None:
        """Abort every request, stop the loop thread (multi-host: the followers too) and a
        running profile trace."""
        self.loop.profiler.stop_if_running()
        if self.background_warmup is not None:
            self.background_warmup.stop()
        if self.loop.stop("server shutting down"):
            self.runner.close()
