"""Server configuration: one frozen dataclass, built once from the command line (SGLang flag names).

Defaults are sized for the embedded tiny model on a CPU; ``page_size`` defaults per backend
(``kv_page_size``). On a TPU host serving a large model raise ``page_size`` (256),
``chunked_prefill_size`` (1024) and ``max_total_tokens`` to what HBM holds.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax.numpy as jnp

from sglang_tpu_backend.config import DTYPES, cache_storage_dtype
from sglang_tpu_backend.server_flags import (  # (the flags' choices, re-exported here)
    CPU_PAGE_SIZE, DEFAULT_MAX_QUEUED_REQUESTS, DTYPE_CHOICES, KERNEL_IMPLS, KV_CACHE_DTYPES,
    LOAD_FORMATS, LOG_LEVELS, REASONING_PARSERS, SPECULATIVE_ALGORITHMS, TOOL_CALL_PARSERS,
    TPU_PAGE_SIZE, TPU_SCHEDULER_STEPS, add_flags)

DETERMINISTIC_MIN_CHUNK = 64  # a multiple of every GDN chunk size (kernels/gdn.py: 64 TPU, 32 XLA)
DEFAULT_PROFILE_MAX_SECONDS = 600.0  # a trace without num_steps stops by itself after this


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """Everything the engine and the HTTP server are configured with.

    Sizes are in tokens unless the name says pages/requests/bytes. ``None`` means "derive a
    default": ``model_path`` -> the embedded tiny model, ``tokenizer_path`` -> ``model_path``,
    ``context_length`` -> the model's ``max_position_embeddings`` (capped at 32768),
    ``max_total_tokens`` -> ``max_running_requests * min(context_length, 1024)``,
    ``served_model_name`` -> ``model_path``.

    Data-parallel attention (``--dp-size D --ep-size D``): each of D devices is a DP rank with
    its own KV pages and GDN state slots, and the routed experts are split over the same D
    devices. ``max_total_tokens`` and ``max_running_requests`` are host totals (SGLang's
    meaning), split evenly: each rank gets ``max_total_tokens // (D * page_size)`` KV pages
    and ``max_running_requests // D`` running requests (= its state slots). The step limits
    hold per rank: ``chunked_prefill_size`` prefill tokens and ``max_tokens_per_step`` token
    rows each. A request must fit in one rank's KV pages.

    Tensor-parallel attention (``--tp-size T --ep-size T``, ``--dp-size 1``): every request
    runs on all T devices, each holding 1/T of every layer's heads (kv heads replicated when
    the model has fewer than T) and of the routed experts; one KV page pool and one set of
    state slots, limits as with one device. The comparison point of DP attention: it stores
    each request's KV cache once per kv-head replica, so fewer requests fit.

    Prefix cache (on unless ``disable_radix_cache``): a radix tree per DP rank keeps the KV
    pages of computed prompt prefixes and, at page boundaries, snapshots of every GDN layer's
    conv + recurrent state. ``max_gdn_snapshots`` is the number of snapshots (host total,
    split evenly over the DP ranks like the state slots; ``None`` -> ``max_running_requests``,
    i.e. as much device memory again as the running requests' GDN state).

    ``dtype`` ``"auto"`` (the default) takes the checkpoint config's ``dtype`` /
    ``torch_dtype`` (``config.resolve_dtype``: as stated, bfloat16 when unstated);
    the engine replaces it with the resolved name.

    Memory sizing (SGLang's ``--mem-fraction-static F``): weights plus every static pool take
    at most ``F`` of each device's memory, and the KV page pool gets what the weights, the GDN
    state slots and snapshots, the penalty state and the step activations leave
    (``planning/mem_budget.py``). Device memory is the device's ``bytes_limit``, or
    ``device_memory_bytes`` where the device reports none (CPU) or to override it. A given
    ``max_total_tokens`` caps the result.

    Deterministic inference (``enable_deterministic_inference``): a request's tokens do not
    depend on what else is batched with it (greedy and seeded sampling). Every step
    runs one of two fixed shapes (a DECODE step of ``max_running_requests`` rows, or a
    prefill-only step of ``max_tokens_per_step`` rows: decodes and prefill chunks never share
    a step), a prompt's prefill chunks end only at multiples of 64 (a multiple of the GDN chunk size) or at
    its end, and the prefix cache is off. ``chunked_prefill_size`` must be at least 64.

    Multi-host (``nnodes`` N > 1, SGLang's ``--nnodes`` / ``--node-rank`` / ``--dist-init-addr``):
    N processes, one per host, form one mesh of all their devices (``dp_size`` = every device
    of every host) and run the same DP x EP steps; node 0 runs the engine (scheduler, HTTP,
    sampling, the prefix tree), the others follow its steps, snapshot copies and handover
    transfers (``parallel/multihost.py``). TP attention and weight updates are not available
    there.

    Speculative decoding (SGLang's ``--speculative-algorithm``; ``speculative/``): each decode
    step verifies ``speculative_num_draft_tokens - 1`` chain drafts per request in one
    TARGET_VERIFY forward and keeps the accepted drafts (exact match for greedy rows,
    rejection sampling for drawn ones) plus one token.
    NGRAM drafts from the request's own prompt + output (suffixes of
    ``speculative_ngram_min/max_match_window_size`` tokens); NEXTN (EAGLE an alias) drafts
    with the checkpoint's MTP layers on the device after every step
    (``model_executor/nextn_step.py``); the checkpoint must have MTP weights (``Engine``
    checks). One device, DP ranks, or TP attention (the verify states, the GDN commit and the
    MTP layer's KV split by heads like the cache); not multi-host. The overlap scheduler is
    off under it (the next step's drafts need this step's tokens).

    Multi-step decoding (vLLM's ``--num-scheduler-steps``; ``model_executor/multistep.py``):
    ``num_scheduler_steps`` N > 1 (default: ``TPU_SCHEDULER_STEPS`` on a TPU, 1 elsewhere:
    ``scheduler_steps``) runs a DECODE step whose requests are all eligible as N
    decode steps in one device program (forward -> sampler -> next input, N times), so the
    host's per-step work is paid once per N tokens. Requests with a grammar, a pending
    ``min_new_tokens`` ban or routed experts, or fewer than N positions of context left, make
    their step a single one; tokens past a stop or max_new_tokens are computed and dropped.
    One device only: DP / TP attention, speculative decoding, ``--enable-return-routed-experts``,
    ``--enable-eplb`` and deterministic inference run single steps. Multi-step launches
    return no router stats (the MoE health gauges then come from the other steps).

    Staged warm-up (``warmup_in_background``; ``None``: on a TPU, off elsewhere;
    ``model_executor/background_warmup.py``): the engine is ready once one prefill bucket and
    its samplers are compiled; every other program compiles in the background while it
    serves, with steps held to that bucket (and single decode steps) until they are done.
    One device only; the rest (and ``skip_warmup``) as before.

    Compilation cache: XLA executables of the step programs are kept under
    ``compilation_cache_dir`` (``None`` -> ``<cache dir>/jax-compilation-cache``, the cache
    directory being ``$STB_CACHE_DIR`` or ``~/.cache/sglang_tpu_backend``; ``""`` turns it
    off), so a restart with the same model and flags loads its warm-up instead of compiling.

    Access (SGLang's ``--api-key`` / ``--admin-api-key``, ``entrypoints/auth.py``): ``api_key``
    guards the serving routes; the admin routes (weight updates, profiling, cache flush,
    abort-all) take ``admin_api_key`` when it is set (the plain key is refused there), else
    ``api_key``; health checks and ``/metrics`` are always open. Profile traces are written
    only under ``profile_dir_root`` (``None`` -> ``$SGLANG_TORCH_PROFILER_DIR``, else the
    temp directory) and stop after ``profile_max_seconds`` unless ``num_steps`` ends them first.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    page_size: int | None = None  # None: CPU_PAGE_SIZE / TPU_PAGE_SIZE (``kv_page_size``)
    max_running_requests: int = 64
    chunked_prefill_size: int = 256
    max_total_tokens: int | None = None
    context_length: int | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int | None = None  # None: --tp-size when > 1, else --dp-size
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    kernel_impl: str = "auto"
    random_seed: int = 0
    load_format: str = "auto"  # auto/safetensors: the checkpoint; dummy: random weights
    served_model_name: str | None = None
    weight_version: str = "default"  # reported by /get_model_info; set by weight updates
    skip_warmup: bool = False
    stream_interval: int = 1
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_top_logprobs_num: int = 20
    log_level: str = "info"
    disable_radix_cache: bool = False
    max_gdn_snapshots: int | None = None
    compilation_cache_dir: str | None = None
    disable_overlap_schedule: bool = False
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS  # None: unlimited
    profile_dir_root: str | None = None  # None: $SGLANG_TORCH_PROFILER_DIR, else the temp dir
    profile_max_seconds: float = DEFAULT_PROFILE_MAX_SECONDS
    watchdog_timeout: float = 300.0  # seconds a loop with work may go without finishing a step
    nnodes: int = 1  # processes (hosts) forming one engine's mesh; node 0 leads
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0's coordinator (nnodes > 1)
    handover_wait_timeout: float = 300.0  # seconds a handed-over request may wait for decode room
    max_consecutive_step_errors: int = 5  # failed steps in a row that make /health answer 503
    weight_update_timeout: float = 300.0  # seconds a weight update waits for running requests
    mem_fraction_static: float | None = None  # None: pools sized by max_total_tokens
    device_memory_bytes: int | None = None  # None: the device's bytes_limit
    enable_deterministic_inference: bool = False
    # RL routing replay: requests may ask for their routed expert ids (``return_routed_experts``)
    enable_return_routed_experts: bool = False
    reasoning_parser: str | None = None  # chat: split <think> reasoning into reasoning_content
    tool_call_parser: str | None = None  # chat: parse tool calls into tool_calls
    # EPLB (parallel/eplb.py): redundant expert slots, the start-up placement, rebalancing.
    ep_num_redundant_experts: int = 0
    init_expert_location: str | None = None  # None / "trivial": slot p holds expert p mod E
    enable_eplb: bool = False
    eplb_rebalance_num_iterations: int = 1000  # steps between rebalances
    # Speculative decoding (speculative/): None = off.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None  # k + 1 (drafts plus the last token); None: 4
    speculative_num_steps: int | None = None  # chain drafts: num_draft_tokens - 1
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    num_scheduler_steps: int | None = None  # decode steps per launch; None: 8 on a TPU, else 1
    warmup_compile_threads: int | None = None  # warm-up compiles side by side; None: cores - 1
    warmup_in_background: bool | None = None  # staged warm-up; None: on a TPU, else off

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the flag for any unusable value; an unset ``ep_size``
        becomes the size its parallel layout implies."""
        if self.ep_size is None:  # frozen: set once, before the checks
            object.__setattr__(self, "ep_size", self.tp_size if self.tp_size != 1 else self.dp_size)
        def positive(name: str, value: int | None, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

        positive("page_size", self.page_size, allow_none=True)
        positive("max_running_requests", self.max_running_requests)
        positive("chunked_prefill_size", self.chunked_prefill_size)
        positive("max_total_tokens", self.max_total_tokens, allow_none=True)
        positive("context_length", self.context_length, allow_none=True)
        positive("stream_interval", self.stream_interval)
        positive("max_request_body_bytes", self.max_request_body_bytes)
        positive("max_top_logprobs_num", self.max_top_logprobs_num)
        positive("tp_size", self.tp_size)
        positive("dp_size", self.dp_size)
        positive("ep_size", self.ep_size)
        positive("max_gdn_snapshots", self.max_gdn_snapshots, allow_none=True)
        positive("max_queued_requests", self.max_queued_requests, allow_none=True)
        positive("eplb_rebalance_num_iterations", self.eplb_rebalance_num_iterations)
        self._validate_eplb()
        positive("max_consecutive_step_errors", self.max_consecutive_step_errors)
        positive("num_scheduler_steps", self.num_scheduler_steps, allow_none=True)
        positive("warmup_compile_threads", self.warmup_compile_threads, allow_none=True)
        for name in ("watchdog_timeout", "handover_wait_timeout", "weight_update_timeout",
                     "profile_max_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of "
                                 f"seconds, got {value!r}")
        positive("device_memory_bytes", self.device_memory_bytes, allow_none=True)
        f = self.mem_fraction_static
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"--mem-fraction-static must be a number in (0, 1], got {f!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        self._validate_parallel_layout()
        if self.max_running_requests < self.dp_size:
            raise ValueError(
                f"--max-running-requests {self.max_running_requests} is split over --dp-size "
                f"{self.dp_size} ranks: it must be at least {self.dp_size}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.kernel_impl not in KERNEL_IMPLS:
            raise ValueError(f"--kernel-impl must be one of {KERNEL_IMPLS}, got {self.kernel_impl!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.max_gdn_snapshots is not None and self.max_gdn_snapshots < self.dp_size:
            raise ValueError(
                f"--max-gdn-snapshots {self.max_gdn_snapshots} is split over --dp-size "
                f"{self.dp_size} ranks: it must be at least {self.dp_size}")
        self._validate_multihost()
        self._validate_speculative()
        if self.enable_return_routed_experts and (self.nnodes > 1 or self.speculative_algorithm):
            raise ValueError("--enable-return-routed-experts is not supported with --nnodes > 1 "
                             "or --speculative-algorithm")
        if (self.enable_deterministic_inference
                and self.chunked_prefill_size < DETERMINISTIC_MIN_CHUNK):
            raise ValueError(
                f"--chunked-prefill-size {self.chunked_prefill_size} with "
                f"--enable-deterministic-inference: prefill chunks end at multiples of "
                f"{DETERMINISTIC_MIN_CHUNK} tokens, so it must be at least {DETERMINISTIC_MIN_CHUNK}")
        if (self.max_total_tokens is not None and self.page_size is not None
                and self.max_total_tokens < self.page_size * self.dp_size):
            raise ValueError(
                f"--max-total-tokens {self.max_total_tokens} is smaller than one page "
                f"(--page-size {self.page_size}) per DP rank (--dp-size {self.dp_size})"
            )

    def _validate_parallel_layout(self) -> None:
        """DP attention (--dp-size N --ep-size N) or TP attention (--tp-size N --ep-size N)."""
        if self.tp_size != 1:
            if self.dp_size != 1:
                raise ValueError(
                    f"--tp-size {self.tp_size} with --dp-size {self.dp_size}: choose data-parallel "
                    "attention (--dp-size N --ep-size N) or tensor-parallel attention "
                    "(--tp-size N --ep-size N), not both")
            if self.ep_size != self.tp_size:
                raise ValueError(
                    f"--ep-size {self.ep_size} with --tp-size {self.tp_size}: experts are split "
                    "over the tensor-parallel devices: --ep-size must equal --tp-size (or be left out)")
        elif self.ep_size != self.dp_size:
            raise ValueError(
                f"--ep-size {self.ep_size} with --dp-size {self.dp_size}: experts are split over "
                "the DP ranks: --ep-size must equal --dp-size (or be left out)")

    @property
    def uses_expert_location(self) -> bool:
        """Experts stored per physical slot (EPLB): any of the three EPLB flags set."""
        return (self.ep_num_redundant_experts > 0 or self.enable_eplb
                or self.init_expert_location not in (None, "trivial"))

    def _validate_eplb(self) -> None:
        r = self.ep_num_redundant_experts
        if not isinstance(r, int) or r < 0:
            raise ValueError(f"--ep-num-redundant-experts must be a non-negative integer, "
                             f"got {r!r}")
        if self.uses_expert_location and self.tp_size != 1:
            raise ValueError("--ep-num-redundant-experts / --init-expert-location / --enable-eplb "
                             f"need expert parallelism over DP ranks (--tp-size {self.tp_size})")
        if self.uses_expert_location and self.nnodes > 1:
            raise ValueError("--ep-num-redundant-experts / --init-expert-location / --enable-eplb "
                             f"are not supported with --nnodes {self.nnodes}")

    def _validate_speculative(self) -> None:
        """The speculative flags: an algorithm served here, chain drafts (num_steps + 1 ==
        num_draft_tokens when both are given), window sizes in order, not multi-host."""
        algo, steps, n = (self.speculative_algorithm, self.speculative_num_steps,
                          self.speculative_num_draft_tokens)
        if algo is None:
            if n is not None or steps is not None:
                raise ValueError("--speculative-num-draft-tokens / --speculative-num-steps need "
                                 "--speculative-algorithm")
            return
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                             f"got {algo!r}")
        for name, value, low in (("speculative_num_steps", steps, 1),
                                 ("speculative_num_draft_tokens", n, 2)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < low):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}, "
                                 f"got {value!r}")
        if steps is not None and n is not None and steps + 1 != n:
            raise ValueError(
                f"--speculative-num-draft-tokens {n} with --speculative-num-steps {steps}: "
                "drafts are a chain, so num_draft_tokens must be num_steps + 1")
        lo, hi = (self.speculative_ngram_min_match_window_size,
                  self.speculative_ngram_max_match_window_size)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"--speculative-ngram-min-match-window-size {lo!r} and "
                f"--speculative-ngram-max-match-window-size {hi!r} must be integers with "
                "1 <= min <= max")
        if self.nnodes != 1:
            raise ValueError(f"--speculative-algorithm with --nnodes {self.nnodes}: the "
                             "followers of a multi-host mesh run forward steps only; "
                             "speculation needs --nnodes 1")

    @property
    def speculative_num_drafts(self) -> int:
        """Drafts verified per request and step (k): num_draft_tokens - 1, else num_steps,
        else 3; 0 when speculation is off."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        return self.speculative_num_steps if self.speculative_num_steps is not None else 3

    def _validate_multihost(self) -> None:
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"--nnodes must be a positive integer, got {self.nnodes!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank!r}")
        if self.nnodes == 1:
            return
        if not self.dist_init_addr or ":" not in self.dist_init_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's "
                             f"coordinator), got {self.dist_init_addr!r}")
        if self.dp_size == 1 or self.tp_size != 1:
            raise ValueError(f"--nnodes {self.nnodes} runs data-parallel attention over every "
                             "host's devices: give --dp-size/--ep-size (all devices), not --tp-size")

    def check_devices(self, num_devices: int, num_experts: int) -> None:
        """Raise ValueError naming the flag when the DP/EP sizes do not fit the host or model
        (``num_devices``: every process's devices with ``nnodes`` > 1)."""
        if self.nnodes > 1 and self.dp_size != num_devices:
            raise ValueError(f"--dp-size {self.dp_size} with --nnodes {self.nnodes} must equal "
                             f"the {num_devices} devices of all nodes")
        for flag, size in (("--dp-size", self.dp_size), ("--tp-size", self.tp_size)):
            if size > num_devices:
                raise ValueError(f"{flag} {size} needs {size} devices, {num_devices} visible")
        if num_experts % self.ep_size:
            raise ValueError(f"--ep-size {self.ep_size} must divide the model's {num_experts} "
                             "routed experts")
        if (num_experts + self.ep_num_redundant_experts) % self.ep_size:
            raise ValueError(f"--ep-num-redundant-experts {self.ep_num_redundant_experts}: the "
                             f"{num_experts} experts plus it must be a multiple of --ep-size "
                             f"{self.ep_size} (physical slots per EP rank)")

    @property
    def max_running_requests_per_rank(self) -> int:
        return self.max_running_requests // self.dp_size

    @property
    def num_gdn_snapshots_per_rank(self) -> int:
        """GDN state snapshots of each DP rank's prefix cache (0 when it is disabled)."""
        if self.disable_radix_cache or self.enable_deterministic_inference:
            return 0
        total = self.max_running_requests if self.max_gdn_snapshots is None else self.max_gdn_snapshots
        return total // self.dp_size

    def check_role(self, role: str) -> None:
        """ValueError naming the flag when these args cannot serve ``role`` (colocated,
        prefill or decode): the handover state carries no FP8 KV scales."""
        if role in ("prefill", "decode") and self.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: a {role} replica hands "
                             "request state over, which does not carry the KV scales; use "
                             "--kv-cache-dtype auto")

    def kv_page_size(self, backend: str) -> int:
        """Tokens per KV page: ``--page-size``, or by default ``TPU_PAGE_SIZE`` on a TPU (the
        decode attention kernel DMAs K/V a page at a time: 16-token pages made it 2.4 ms of
        a 64-request, 8-step launch of the tiny model on a v5e, 128-token pages 1.1 ms) and
        ``CPU_PAGE_SIZE`` elsewhere (finer prefix-cache hits; tests and CI use it)."""
        if self.page_size is not None:
            return self.page_size
        return TPU_PAGE_SIZE if backend == "tpu" else CPU_PAGE_SIZE

    def scheduler_steps(self, backend: str) -> int:
        """Decode steps per launch: ``--num-scheduler-steps``, or by default
        ``TPU_SCHEDULER_STEPS`` on a TPU (one step's host work outlasts a small batch's device
        step there: ``bench_multistep.py``) and 1 elsewhere (a CPU's device step is the
        host's own work, and tests and CI keep the single-step path)."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return TPU_SCHEDULER_STEPS if backend == "tpu" else 1

    def staged_warmup(self, backend: str) -> bool:
        """``--warmup-in-background``, by default on a TPU (where compiling every program
        before ready is most of a start-up) and off elsewhere (tests count compiles)."""
        return backend == "tpu" if self.warmup_in_background is None else self.warmup_in_background

    def kv_storage_dtype(self, backend: str) -> Any:
        """The dtype of the KV pages (``--dtype`` resolved, not "auto"): float8_e4m3fn with
        ``--kv-cache-dtype fp8_e4m3`` (scales beside the pages), else
        ``config.cache_storage_dtype`` of ``--dtype`` on ``backend``."""
        if self.kv_cache_dtype == "fp8_e4m3":
            return jnp.float8_e4m3fn
        return cache_storage_dtype(DTYPES[self.dtype], backend)

    @property
    def max_tokens_per_step(self) -> int:
        """Token rows one rank's step may hold: a prefill chunk budget that always fits all
        of the rank's decodes."""
        return max(self.chunked_prefill_size, self.max_running_requests_per_rank)

    # CLI ---------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Every field as SGLang's flag (``--dash-name``; ``server_flags.py``)."""
        add_flags(parser.add_argument, ServerArgs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The fields, keys masked (``/get_server_info`` reports this)."""
        d = dataclasses.asdict(self)
        for key in ("api_key", "admin_api_key"):
            if d.get(key):
                d[key] = "***"
        return d
