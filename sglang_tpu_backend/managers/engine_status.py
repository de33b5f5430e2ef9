"""What an engine reports about itself: model info, server info, load, pool usage, metrics.

Read-only snapshots taken under the engine lock (``/get_model_info``, ``/get_server_info``,
``/get_load``, ``/metrics``; the Ray app's load reports and health checks).
"""

from __future__ import annotations

from typing import Any

import jax

from sglang_tpu_backend import __version__

POOL_TOTALS = ("kv_pages_used", "kv_pages_total", "state_slots_used", "state_slots_total",
               "kv_pages_cached", "kv_pages_evictable", "kv_pages_evicted_total",
               "gdn_snapshots_used", "gdn_snapshots_total")
NO_PREFIX_CACHE = dict(kv_pages_cached=0, kv_pages_evictable=0, kv_pages_evicted_total=0,
                       gdn_snapshots_used=0, gdn_snapshots_total=0)


class EngineStatus:
    """Reports of one engine (``engine.Engine`` builds it from its components)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def model_info(self) -> dict:
        e = self.engine
        return {
            "model_path": e.args.model_path,
            "tokenizer_path": e.args.tokenizer_path,
            "is_generation": True,
            "served_model_name": e.args.served_model_name,
            "model_type": e.model_config.model_type,
            "vocab_size": e.model_config.vocab_size,
            "context_length": e.args.context_length,
            "preferred_sampling_params": None,
            "weight_version": e.weights.version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    def server_info(self) -> dict:
        e = self.engine
        info = e.args.to_dict()
        with e.loop.lock:
            info.update(e.loop.stats)
        stats = self.pool_stats()
        info.update(stats)
        info.update({
            "num_retracted_reqs": stats["num_retracted_total"],
            "num_pages": e.num_pages,
            "num_pages_per_rank": e.num_pages_per_rank,
            "warmup_seconds": e.warmup_seconds,
            "startup_seconds": e.startup_seconds,  # by phase, until ready
            "backend_open_seconds": e.backend_open_seconds,  # on a thread beside the first phase
            # staged warm-up's second stage (None: every program compiled before ready)
            "background_warmup": None if e.background_warmup is None
            else e.background_warmup.status(),
            "token_buckets": list(e.runner.token_buckets),
            "request_buckets": list(e.runner.req_buckets),
            "jax_backend": jax.default_backend(),
            "version": __version__,
            "weight_version": e.weights.version,
            "paused": e.rl.mode,  # pause_generation's mode, None while generating
            "memory_released": e.rl.released,  # release_memory_occupation's tags
            "mem_budget": None if e.mem_budget is None else e.mem_budget.to_dict(),
        })
        return info

    def load(self) -> list[dict]:
        """SGLang's ``/get_load``: one entry per DP rank. ``num_reqs``: running + waiting,
        ``num_waiting_reqs``: waiting, ``num_tokens``: KV tokens in use (pages held, less the
        prefix cache's evictable ones, times page_size) + the waiting requests' prompt tokens.
        The waiting queue is shared by the ranks (a request is placed when admitted), so it
        is counted under ``dp_rank`` 0."""
        e = self.engine
        stats = self.pool_stats()
        with e.loop.lock:
            waiting = e.scheduler.num_waiting
            waiting_tokens = sum(len(r.prompt_ids) for r in e.scheduler.waiting)
        loads = []
        for k, r in enumerate(stats["dp_ranks"]):
            w, wt = (waiting, waiting_tokens) if k == 0 else (0, 0)
            loads.append({"dp_rank": k, "num_reqs": r["num_running"] + w, "num_waiting_reqs": w,
                          "num_tokens": r["kv_pages_used"] * e.args.page_size + wt})
        return loads

    def pool_stats(self) -> dict:
        """Pool usage summed over the DP ranks, and each rank's own under ``dp_ranks``."""
        e = self.engine
        with e.loop.lock:
            sched = e.scheduler
            ranks = [dict(p.stats(), num_running=len(sched.running_on(k)),
                          num_admitted_total=sched.num_admitted_per_rank[k])
                     for k, p in enumerate(sched.pools)]
            for k, r in enumerate(ranks):
                cache = sched.prefix.stats(k) if sched.prefix is not None else NO_PREFIX_CACHE
                r.update(cache)
                r["kv_pages_used"] -= cache["kv_pages_evictable"]  # SGLang: evictable is free
            totals = {key: sum(r[key] for r in ranks) for key in POOL_TOTALS}
            return {
                **totals,
                "num_running": sched.num_running,
                "num_queued": sched.num_waiting + len(e.weights.held),
                "num_retracted_total": sched.num_retracted_total,
                "num_aborted_total": sched.num_aborted_total,
                "num_finished_total": sched.num_finished_total,
                "num_prefill_tokens_total": sched.num_prefill_tokens_total,
                "num_cached_tokens_total": sched.num_cached_tokens_total,
                "token_usage": totals["kv_pages_used"] / totals["kv_pages_total"],
                "dp_ranks": ranks,
            }
