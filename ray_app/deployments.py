"""Engine replicas: one ``Engine`` per replica, in role colocated, prefill or decode.

Methods the ingress calls through its deployment handles:
  ``generate(obj)`` (streaming, colocated), ``prefill(obj) -> {"first", "ticket"}`` (prefill
  role: prompt + first token, state handed over through the transport), ``decode(ticket)``
  (streaming, decode role), and the engine's info / stats / cache / abort calls.
``on_replica(method, ...)`` runs one of ``BROADCAST_METHODS`` (health, abort, cache flush,
profiling, the expert distribution record, SGLang's RL calls: pause / continue generation,
release / resume memory, weights from tensors, the weight version) for the ingress's
``DeploymentHandle.broadcast``, which reaches every running replica
but returns their answers unlabelled: each answer carries this replica's id.
Every replica pushes its metrics (labelled ``replica``) to the application's metrics hub
(``ray_app/metrics_hub.py``), which the ingress's ``/metrics`` reads.
Serve calls ``check_health`` every ``health_check_period_s``: it raises ``health_error()``, set
when the engine reports one (its loop thread died, or stalled past ``--watchdog-timeout``) or the
loop has had work without finishing a step for ``stall_timeout_s``. On shutdown
Serve first drains (stops routing, waits up to ``graceful_shutdown_timeout_s`` for running
requests), then ``__del__`` stops the engine loop (aborting anything left).
A multi-host replica (``hosts > 1``) leads follower actors on the other hosts
(``ray_app/multihost.py``); its health check also fails once one of them stopped, and
``__del__`` stops and kills them (Serve removes the replica's placement group).
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

from ray import serve

from ray_app.handover import make_transport
from ray_app.metrics_hub import MetricsPusher
from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError
from sglang_tpu_backend.server_args import ServerArgs

log = logging.getLogger(__name__)
BROADCAST_METHODS = ("health_error", "abort_request", "flush_cache", "start_profile", "stop_profile",
                     "start_expert_distribution_record", "stop_expert_distribution_record",
                     "dump_expert_distribution_record", "pause_generation", "continue_generation",
                     "release_memory_occupation", "resume_memory_occupation",
                     "update_weights_from_tensor", "update_weights_from_disk",
                     "get_weight_version")


@serve.deployment
class EngineServer:
    def __init__(self, server_args: ServerArgs, role: str = "colocated",
                 transport: str = "object_store", stall_timeout_s: float = 600.0,
                 hosts: int = 1, host_options: dict[str, Any] | None = None):
        """``hosts`` > 1: this replica leads an engine over that many hosts, starting a
        follower actor per other host (``host_options``: ``start_followers`` keywords)."""
        from sglang_tpu_backend.engine import Engine

        self.role = role
        self.followers = None
        if hosts > 1:
            from ray_app.multihost import start_followers

            server_args, self.followers = start_followers(server_args, hosts,
                                                          **(host_options or {}))
        try:
            self.engine = Engine(server_args, role=role)
        except BaseException:
            if self.followers is not None:
                self.followers.kill()
            raise
        self.transport = make_transport(transport)
        self.stall_timeout_s = stall_timeout_s
        replica = serve.get_replica_context().replica_id
        self.replica_id = replica.unique_id
        self.metrics_pusher = MetricsPusher(replica.deployment_id.app_name, replica.unique_id,
                                            self.engine.metrics_text)

    # Requests ------------------------------------------------------------------------------
    async def generate(self, obj: GenerateReqInput, routing_key: str | None = None
                       ) -> AsyncIterator[dict]:
        """``routing_key``: read by the deployment's request router (``ray_app/routing.py``)."""
        async for out in self.engine.generate_request(obj):
            yield out

    async def prefill(self, obj: GenerateReqInput, routing_key: str | None = None) -> dict[str, Any]:
        """Prefill + first token; ``ticket`` is None when the request already finished.
        ``routing_key``: read by the deployment's request router (``ray_app/routing.py``)."""
        first, h = await self.engine.prefill_for_handover(obj)
        return {"first": first, "ticket": None if h is None else self.transport.send(h)}

    async def decode(self, ticket: dict[str, Any]) -> AsyncIterator[dict]:
        try:
            h = await self.transport.receive(ticket)
        except Exception:
            self.engine.metrics.observe_handover(0.0, 0, ok=False)
            raise
        async for out in self.engine.generate_from_handover(h):
            yield out

    def record_routing_stats(self) -> dict[str, Any]:
        """What the decode deployment's router ranks replicas by (Serve polls it): the KV
        tokens free on this replica's emptiest DP rank (a request lives on one rank)."""
        stats = self.engine.pool_stats()
        page = self.engine.args.page_size
        free = max((r["kv_pages_total"] - r["kv_pages_used"]) * page for r in stats["dp_ranks"])
        return {"free_kv_tokens": free, "num_running": stats["num_running"]}

    # Engine API ----------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        return self.engine.get_model_info()

    def get_server_info(self) -> dict:
        return {**self.engine.get_server_info(), "role": self.role,
                "pool_stats": self.engine.pool_stats()}

    def pool_stats(self) -> dict:
        return self.engine.pool_stats()

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def abort_request(self, rid: str) -> bool:
        return self.engine.abort_request(rid)

    def metrics_text(self) -> bytes:
        return self.engine.metrics_text()

    def get_load(self) -> list[dict]:
        return self.engine.get_load()

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        return self.engine.start_profile(output_dir=output_dir, num_steps=num_steps)

    def stop_profile(self) -> str:
        return self.engine.stop_profile()

    def start_expert_distribution_record(self) -> None:
        self.engine.start_expert_distribution_record()

    def stop_expert_distribution_record(self) -> None:
        self.engine.stop_expert_distribution_record()

    def dump_expert_distribution_record(self, output_dir: str) -> str:
        return self.engine.dump_expert_distribution_record(output_dir)

    def update_weights_from_disk(self, model_path: str, **kwargs) -> dict:
        return self.engine.update_weights_from_disk(model_path, **kwargs)

    async def health_generate(self) -> bool:
        return await self.engine.health_generate()

    # RL calls (broadcast by the ingress to every replica) ----------------------------------
    def pause_generation(self, mode: str = "abort") -> dict:
        return self.engine.pause_generation(mode)

    def continue_generation(self) -> dict:
        return self.engine.continue_generation()

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.engine.resume_memory_occupation(tags)

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None,
                                   abort_all_requests: bool = False) -> dict:
        """``named_tensors``: ``{hf_name: numpy array}``, or a Ray ``ObjectRef`` of one (the
        ingress puts the arrays into the object store once; every replica reads that copy)."""
        import ray

        if isinstance(named_tensors, ray.ObjectRef):
            named_tensors = ray.get(named_tensors)
        return self.engine.update_weights_from_tensor(
            named_tensors, load_format=load_format, flush_cache=flush_cache,
            weight_version=weight_version, abort_all_requests=abort_all_requests)

    def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    def on_replica(self, method: str, *args, **kwargs) -> dict[str, Any]:
        """``method`` (one of ``BROADCAST_METHODS``) here, labelled with this replica's id:
        ``{"replica", "result"}``, or ``{"replica", "error", "field"}`` when it raised (``field``:
        the request field an ``InvalidRequestError`` names, None for any other exception)."""
        if method not in BROADCAST_METHODS:
            raise ValueError(f"{method!r} is not one of {BROADCAST_METHODS}")
        try:
            return {"replica": self.replica_id, "result": getattr(self, method)(*args, **kwargs)}
        except InvalidRequestError as e:
            return {"replica": self.replica_id, "error": e.message, "field": e.field}
        except Exception as e:
            log.exception("%s failed on this replica", method)
            return {"replica": self.replica_id, "error": f"{type(e).__name__}: {e}", "field": None}

    # Serve lifecycle -----------------------------------------------------------------------
    def multihost_info(self) -> dict[str, Any]:
        """This replica's placement group id (hex, None outside one) and its follower
        actors' names (none for a one-host replica)."""
        import ray

        return {"placement_group_id": ray.get_runtime_context().get_placement_group_id(),
                "followers": [] if self.followers is None else list(self.followers.names)}

    def health_error(self) -> str | None:
        """Why this replica cannot serve, or None: a follower host stopped, the engine reports
        a health error, or its loop has had work without finishing a step for longer than
        ``stall_timeout_s``."""
        followers = getattr(self, "followers", None)
        if followers is not None and (dead := followers.dead()):
            return f"follower host(s) of this multi-host replica stopped: {', '.join(dead)}"
        if (err := self.engine.health_error()) is not None:
            return f"{self.role} engine: {err}"
        stalled = self.engine.loop_stalled_for()
        if stalled > self.stall_timeout_s:
            return (f"{self.role} engine loop made no progress for {stalled:.0f} s "
                    f"(limit {self.stall_timeout_s:.0f} s)")
        return None

    def check_health(self) -> None:
        """Serve's periodic probe: raises ``health_error()`` (Serve then replaces the replica)."""
        if (err := self.health_error()) is not None:
            raise RuntimeError(err)

    def __del__(self) -> None:
        pusher = getattr(self, "metrics_pusher", None)
        if pusher is not None:
            pusher.stop()
        engine = getattr(self, "engine", None)
        followers = getattr(self, "followers", None)
        if engine is not None and followers is not None and followers.dead():
            engine.runner.close = lambda: None  # the stop step would find no peer
        if engine is not None:
            t0 = time.monotonic()
            engine.shutdown()  # multi-host: also stops the followers' loops
            log.info("%s engine stopped in %.1f s", self.role, time.monotonic() - t0)
        if followers is not None:
            followers.kill()
