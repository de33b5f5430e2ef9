"""ServerArgs' command-line flags and their choices: every field as SGLang's flag
(``--dash-name``), with its default and help, grouped as the launch lines group them.
``ServerArgs.add_cli_args`` adds them to a parser (``d``, the defaults, is ``ServerArgs``);
``ServerArgs.from_cli_args`` reads them back."""

from __future__ import annotations

import argparse

from sglang_tpu_backend.config import DTYPES

DTYPE_CHOICES = ("auto", *DTYPES)  # auto: config.resolve_dtype
REASONING_PARSERS = ("qwen3",)  # entrypoints/chat_parsing.py implements each
TOOL_CALL_PARSERS = ("qwen3_coder", "qwen25")
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # SGLang's --load-format values we take
# auto: the KV cache in the model dtype; fp8_e4m3: float8_e4m3fn pages with per-row f32 scales
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
KERNEL_IMPLS = ("auto", "pallas", "interpret", "xla", "reference")  # kernels/dispatch.py
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Waiting requests (queued, not yet running) beyond which a new request gets HTTP 503. SGLang's
# default is unbounded; here a finite bound keeps a burst from growing host memory and
# time-to-first-token without limit.
DEFAULT_MAX_QUEUED_REQUESTS = 1024
TPU_SCHEDULER_STEPS = 8  # multi-step decoding's default on a TPU (ServerArgs.scheduler_steps)
CPU_PAGE_SIZE, TPU_PAGE_SIZE = 16, 128  # tokens per KV page by default (ServerArgs.kv_page_size)
SPECULATIVE_ALGORITHMS = ("NGRAM", "NEXTN", "EAGLE")  # SGLang's names; NGRAM is served today


def add_flags(a, d) -> None:
    """All the flags (``a``: ``parser.add_argument``, ``d``: the defaults, ``ServerArgs``)."""
    _add_model_and_server_flags(a, d)
    _add_serving_flags(a, d)
    _add_expert_and_multihost_flags(a, d)
    _add_speculative_flags(a, d)


def _add_model_and_server_flags(a, d) -> None:
    """The model, its placement and the HTTP server (``a``: ``parser.add_argument``, ``d``:
    the defaults)."""
    a("--model-path", type=str, default=d.model_path,
      help="checkpoint directory (default: the embedded tiny model)")
    a("--tokenizer-path", type=str, default=d.tokenizer_path)
    a("--host", type=str, default=d.host)
    a("--port", type=int, default=d.port)
    a("--page-size", type=int, default=d.page_size,
      help=f"tokens per KV page (default: {TPU_PAGE_SIZE} on a TPU, {CPU_PAGE_SIZE} elsewhere)")
    a("--max-running-requests", type=int, default=d.max_running_requests)
    a("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
      help="max prefill tokens per step")
    a("--max-total-tokens", type=int, default=d.max_total_tokens, help="KV cache capacity in tokens")
    a("--context-length", type=int, default=d.context_length)
    a("--api-key", type=str, default=d.api_key,
      help="Bearer key every route but /health* and /metrics requires")
    a("--admin-api-key", type=str, default=d.admin_api_key,
      help="Bearer key of the admin routes (weight updates, profiling, /flush_cache, "
           "abort_all); when set, --api-key does not unlock them (default: --api-key)")
    a("--tp-size", type=int, default=d.tp_size,
      help="tensor-parallel attention devices: every request on all of them, heads and "
           "experts split (with --dp-size 1)")
    a("--dp-size", type=int, default=d.dp_size,
      help="data-parallel attention ranks, one per device (each with its own KV pool)")
    a("--ep-size", type=int, default=d.ep_size,
      help="expert-parallel devices: must equal --tp-size (TP) or --dp-size (DP), its "
           "default")
    a("--dtype", type=str, default=d.dtype, choices=DTYPE_CHOICES,
      help="weights and KV cache dtype; auto: the checkpoint config's dtype "
           "as stated (float32 too), bfloat16 when it states none")
    a("--kv-cache-dtype", type=str, default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
      help="KV cache storage: auto = the model dtype; fp8_e4m3 = float8_e4m3fn with one f32 "
           "scale per token and K/V head (about half the KV bytes; not with prefill/decode "
           "handover)")
    a("--kernel-impl", type=str, default=d.kernel_impl, choices=KERNEL_IMPLS)
    a("--random-seed", type=int, default=d.random_seed,
      help="sampling seed; with --load-format dummy also the weights' seed")
    a("--load-format", type=str, default=d.load_format, choices=LOAD_FORMATS,
      help="auto/safetensors: read the checkpoint, each process only its devices' share; "
           "dummy: random weights of the config's shapes drawn on the devices (no weights "
           "needed; benchmarks)")
    a("--served-model-name", type=str, default=d.served_model_name)
    a("--enable-metrics", action="store_true", default=False,
      help="accepted for SGLang compatibility and has no effect: metrics are always on "
           "(GET /metrics is always served)")
    a("--weight-version", type=str, default=d.weight_version,
      help="version label of the loaded weights (/get_model_info, /get_weight_version); "
           "/update_weights_from_disk replaces it")


def _add_serving_flags(a, d) -> None:
    """Scheduling, caches, limits, fault handling, chat parsing, multi-host."""
    a("--skip-warmup", action="store_true", default=d.skip_warmup)
    a("--stream-interval", type=int, default=d.stream_interval)
    a("--max-request-body-bytes", type=int, default=d.max_request_body_bytes)
    a("--max-top-logprobs-num", type=int, default=d.max_top_logprobs_num)
    a("--log-level", type=str, default=d.log_level, choices=LOG_LEVELS)
    a("--disable-radix-cache", action="store_true", default=d.disable_radix_cache,
      help="turn the prefix cache (shared KV pages + GDN state snapshots) off")
    a("--max-gdn-snapshots", type=int, default=d.max_gdn_snapshots,
      help="GDN state snapshots the prefix cache may keep (host total; default: "
           "--max-running-requests)")
    a("--disable-overlap-schedule", action="store_true", default=d.disable_overlap_schedule,
      help="complete each step before scheduling the next (default: the host prepares "
           "step i+1 while the device runs step i; needs one device, off with DP / TP)")
    a("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
      help="decode steps per device launch (multi-step decoding): a decode batch whose "
           "requests need no per-token host work (no grammar, min_new_tokens met) runs N "
           "steps in one program; one device only, not with speculative decoding (default: "
           f"{TPU_SCHEDULER_STEPS} on a TPU, 1 elsewhere)")
    a("--warmup-compile-threads", type=int, default=d.warmup_compile_threads,
      help="threads compiling the warm-up's programs side by side (one device; default: "
           "one per core but one, at most 8; 1: one after another)")
    a("--warmup-in-background", action=argparse.BooleanOptionalAction,
      default=d.warmup_in_background,
      help="ready once the programs that serve any step are compiled (one prefill bucket), "
           "the others compiled in the background while serving (one device; default: on a "
           "TPU, off elsewhere)")
    a("--compilation-cache-dir", type=str, default=d.compilation_cache_dir,
      help="persistent XLA compilation cache (default: <cache dir>/jax-compilation-cache; "
           "'' turns it off)")
    a("--max-queued-requests", type=int, default=d.max_queued_requests,
      help="waiting-queue bound: a new request beyond it gets HTTP 503 (default: "
           f"{DEFAULT_MAX_QUEUED_REQUESTS})")
    a("--profile-dir-root", type=str, default=d.profile_dir_root,
      help="/start_profile's output_dir must resolve inside this directory (default: "
           "$SGLANG_TORCH_PROFILER_DIR, else the temp directory)")
    a("--profile-max-seconds", type=float, default=d.profile_max_seconds,
      help="a profile trace without num_steps stops by itself after this many seconds")
    a("--watchdog-timeout", type=float, default=d.watchdog_timeout,
      help="seconds the scheduler loop may have work without finishing a step before "
           "/health and /health_generate answer 503 (a dead loop: at once)")
    a("--handover-wait-timeout", type=float, default=d.handover_wait_timeout,
      help="decode role: seconds a request handed over by a prefill replica may wait for "
           "free KV pages and a state slot before it ends with finish_reason abort")
    a("--max-consecutive-step-errors", type=int, default=d.max_consecutive_step_errors,
      help="steps failing in a row (each fails only its own requests) after which /health "
           "answers 503 until a step succeeds: the replica is broken, not one request")
    a("--weight-update-timeout", type=float, default=d.weight_update_timeout,
      help="seconds a weight update waits for the requests running on the old weights; "
           "then it aborts them (finish_reason abort) and swaps")

    a("--mem-fraction-static", type=float, default=d.mem_fraction_static,
      help="fraction of device memory for weights + KV pages + GDN state (sizes the KV "
           "pool; --max-total-tokens, when given, caps it)")
    a("--device-memory-bytes", type=int, default=d.device_memory_bytes,
      help="device memory that --mem-fraction-static divides (default: the device's "
           "bytes_limit; needed on CPU, which reports none)")
    a("--enable-deterministic-inference", action="store_true",
      default=d.enable_deterministic_inference,
      help="batch-invariant outputs: a request's tokens are the same alone or in any batch "
           "(fixed step shapes, no mixed prefill+decode steps, aligned prefill chunks, "
           "prefix cache off)")
    a("--enable-return-routed-experts", action="store_true",
      default=d.enable_return_routed_experts,
      help="requests may set return_routed_experts: meta_info['routed_experts'] then holds "
           "the routed expert ids per token (base64 int32 [tokens, moe_layers, top_k])")
    a("--reasoning-parser", type=str, default=d.reasoning_parser, choices=REASONING_PARSERS,
      help="chat completions: <think> reasoning -> message.reasoning_content")
    a("--tool-call-parser", type=str, default=d.tool_call_parser, choices=TOOL_CALL_PARSERS,
      help="chat completions: tool calls -> message.tool_calls (qwen3_coder: Qwen3.5's "
           "XML format; qwen25: JSON in <tool_call> tags)")


def _add_expert_and_multihost_flags(a, d) -> None:
    """EPLB placement and rebalancing; one engine over several hosts."""
    a("--ep-num-redundant-experts", type=int, default=d.ep_num_redundant_experts,
      help="EPLB: extra physical expert slots per MoE layer holding copies of hot experts "
           "(experts + it must be a multiple of --ep-size)")
    a("--init-expert-location", type=str, default=d.init_expert_location,
      help="EPLB start-up placement: a load file the engine wrote "
           "(Engine.dump_expert_distribution_record) or 'trivial' (slot p holds expert p mod E)")
    a("--enable-eplb", action="store_true", default=d.enable_eplb,
      help="rebalance the expert placement periodically from the recorded expert loads")
    a("--eplb-rebalance-num-iterations", type=int, default=d.eplb_rebalance_num_iterations,
      help="steps between EPLB rebalances (with --enable-eplb)")

    a("--nnodes", type=int, default=d.nnodes,
      help="hosts (processes) one engine spans; node 0 serves, the others follow its steps")
    a("--node-rank", type=int, default=d.node_rank, help="this process's node (0: leader)")
    a("--dist-init-addr", type=str, default=d.dist_init_addr,
      help="HOST:PORT of node 0's jax.distributed coordinator (with --nnodes > 1)")


def _add_speculative_flags(a, d) -> None:
    """Speculative decoding (SGLang's names)."""
    a("--speculative-algorithm", type=str, default=d.speculative_algorithm,
      choices=SPECULATIVE_ALGORITHMS,
      help="speculative decoding: NGRAM drafts from the request's own tokens; NEXTN (EAGLE "
           "an alias) with the checkpoint's MTP layers")
    a("--speculative-num-draft-tokens", type=int, default=d.speculative_num_draft_tokens,
      help="tokens verified per request and step: the last token plus the drafts (default 4)")
    a("--speculative-num-steps", type=int, default=d.speculative_num_steps,
      help="draft steps (chain drafts: --speculative-num-draft-tokens - 1)")
    a("--speculative-ngram-min-match-window-size", type=int,
      default=d.speculative_ngram_min_match_window_size,
      help="NGRAM: shortest suffix of the sequence matched against its earlier tokens")
    a("--speculative-ngram-max-match-window-size", type=int,
      default=d.speculative_ngram_max_match_window_size,
      help="NGRAM: longest suffix matched (the longest match wins)")
