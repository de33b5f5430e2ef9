"""HTTP ingress: the standalone server's app (``entrypoints/http_server.create_app``: the same
router and error handlers) over a ``RemoteEngine`` that forwards the Engine API to the
engine deployments. The app is built when the ingress replica starts (Serve's late-bound
ingress, ``__serve_build_asgi_app__``), once the engine handles exist.

Colocated: ``generate_request`` streams from one engine replica. Disaggregated: a prefill replica
runs the prompt and the first token and returns a transport ticket; a decode replica
installs the state and streams the rest; the first output is yielded in between (streaming
requests see the first token before decoding starts). ``abort_request`` cancels the
request's in-flight replica call (Serve cancels the replica task, the engine aborts it).
``/metrics`` merges every engine replica's metrics (``ray_app/metrics_hub.py``; families by
name, samples labelled ``replica``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI
from ray import serve

from ray_app.metrics_hub import get_hub
from sglang_tpu_backend.entrypoints.http_server import create_app
from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError
from sglang_tpu_backend.server_args import ServerArgs

log = logging.getLogger(__name__)
RAY_TASK_ERROR = ray.exceptions.RayTaskError  # an exception raised inside a replica call
# The object store copy of a handover is owned by the prefill replica that made it; if that
# replica dies before the decode replica fetched it, the fetch fails with one of these.
HANDOVER_LOST = (ray.exceptions.ObjectLostError,)
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                serve.exceptions.ReplicaUnavailableError, serve.exceptions.DeploymentUnavailableError)

def merge_exposition(texts: list[bytes]) -> bytes:
    """Prometheus text expositions of several engines as one: each family's HELP / TYPE once,
    then the samples of every input (they differ by their ``role`` label)."""
    families: dict[str, list[str]] = {}
    for text in texts:
        name = None
        for line in text.decode().splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                name = line.split()[2]
                fam = families.setdefault(name, [])
                if line not in fam:
                    fam.append(line)
            elif line and name is not None:
                families[name].append(line)
    return "".join(line + "\n" for fam in families.values() for line in fam).encode()


def _aborted(obj: GenerateReqInput, message: str, last: dict | None) -> dict:
    out = dict(last or {"text": "", "output_ids": []})
    out["meta_info"] = {**(last or {}).get("meta_info", {"id": obj.rid}),
                        "finish_reason": {"type": "abort", "message": message}}
    return out


class RemoteEngine:
    """The Engine API over deployment handles (``engine`` or ``prefill`` + ``decode``)."""

    def __init__(self, args: ServerArgs, *, engine=None, prefill=None, decode=None):
        from sglang_tpu_backend.tokenizer import load_tokenizer
        from sglang_tpu_backend.tiny_model import default_model_path

        self.args = args
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path or default_model_path())
        self.engine, self.prefill, self.decode = engine, prefill, decode
        self.engines = [h for h in (engine, prefill, decode) if h is not None]
        self.roles = ["colocated"] if engine is not None else ["prefill", "decode"]
        self._inflight: dict[str, Any] = {}  # rid -> the replica call in progress
        self._aborted: set[str] = set()  # rids cancelled by abort_request, not yet ended
        self._hub = None  # the application's metrics hub handle, looked up on first scrape

    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        """The engine's outputs for ``obj``. A request whose replica dies ends with
        ``finish_reason`` abort and a message (a prefill is retried once first); a request
        the engine refuses raises its ``InvalidRequestError`` (400 at the routes)."""
        last = None
        try:
            if self.engine is not None:
                async for out in self._stream(obj, self.engine.options(stream=True).generate.remote(obj)):
                    last = out
                    yield out
                return
            res = await self._prefill(obj)
            last = res["first"]
            if res["ticket"] is None or obj.stream:
                yield last
            if res["ticket"] is None:
                return
            async for out in self._stream(obj, self.decode.options(stream=True).decode.remote(res["ticket"])):
                last = out
                yield out
        except (asyncio.CancelledError, serve.exceptions.RequestCancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and obj.rid not in self._aborted:
                raise  # this task itself is being cancelled
            yield _aborted(obj, "Aborted by the client or the server", last)
        except RAY_TASK_ERROR as e:
            if isinstance(e.cause, InvalidRequestError):
                raise e.cause from None
            if isinstance(e.cause, HANDOVER_LOST):  # its prefill replica died after the prefill
                log.warning("request %s: handover lost: %s", obj.rid, e.cause)
                yield _aborted(obj, "the request's prefilled state was lost with its prefill "
                               f"replica ({type(e.cause).__name__})", last)
                return
            raise
        except REPLICA_GONE as e:
            log.warning("request %s: replica failed: %s", obj.rid, e)
            yield _aborted(obj, f"the serving replica failed: {type(e).__name__}", last)
        finally:
            self._aborted.discard(obj.rid)
            call = self._inflight.pop(obj.rid, None)
            if call is not None:
                call.cancel()  # the client left: stop the replica's work

    async def _prefill(self, obj: GenerateReqInput, attempts: int = 2) -> dict[str, Any]:
        """A prefill replica's ``{"first", "ticket"}``; retried on another replica when the
        one serving it dies (nothing was streamed to the client yet)."""
        for attempt in range(attempts):
            call = self.prefill.prefill.remote(obj)
            self._inflight[obj.rid] = call
            try:
                return await call
            except REPLICA_GONE as e:
                if attempt + 1 == attempts:
                    raise
                log.warning("request %s: prefill replica failed (%s), retrying", obj.rid, e)
        raise AssertionError("unreachable")

    async def _stream(self, obj: GenerateReqInput, gen) -> AsyncIterator[dict]:
        self._inflight[obj.rid] = gen
        async for out in gen:
            yield out

    def abort_request(self, rid: str) -> bool:
        call = self._inflight.pop(rid, None)
        if call is None:
            return False
        self._aborted.add(rid)
        call.cancel()
        return True

    async def get_model_info(self) -> dict:
        return await self.engines[-1].get_model_info.remote()

    async def get_server_info(self) -> dict:
        infos = await asyncio.gather(*(h.get_server_info.remote() for h in self.engines))
        info = dict(infos[-1])
        if len(infos) > 1:
            info["roles"] = {i["role"]: i for i in infos}
        return info

    async def pool_stats(self) -> dict:
        return await self.engines[-1].pool_stats.remote()

    async def flush_cache(self) -> bool:
        return all(await asyncio.gather(*(h.flush_cache.remote() for h in self.engines)))

    async def metrics_text(self) -> bytes:
        """Every engine replica's metrics (each labelled ``replica``) from the application's
        metrics hub; before any replica has pushed, one replica of each deployment."""
        try:
            texts = await (await self._metrics_hub()).collect.remote()
        except ray.exceptions.RayActorError:  # the hub was restarted: look it up again
            self._hub = None
            texts = await (await self._metrics_hub()).collect.remote()
        if not texts:
            texts = await asyncio.gather(*(h.metrics_text.remote() for h in self.engines))
        return merge_exposition(list(texts))

    async def _metrics_hub(self):
        if self._hub is None:  # a named-actor lookup: once, not per scrape
            self._hub = await asyncio.to_thread(get_hub, self.engines[0].app_name)
        return self._hub

    async def health_generate(self) -> bool:
        return all(await asyncio.gather(*(h.health_generate.remote() for h in self.engines)))

    async def _on_every_deployment(self, method: str, *args, **kwargs) -> list:
        """``method`` on one replica of every engine deployment, in ``roles`` order; an
        ``InvalidRequestError`` raised there is raised here (a 400 at the routes)."""
        try:
            return list(await asyncio.gather(
                *(getattr(h, method).remote(*args, **kwargs) for h in self.engines)))
        except RAY_TASK_ERROR as e:
            if isinstance(e.cause, InvalidRequestError):
                raise e.cause from None
            raise

    async def get_load(self) -> list[dict]:
        """Every engine deployment's per-DP-rank load entries, each with its ``role``."""
        loads = await self._on_every_deployment("get_load")
        return [dict(entry, role=role) for role, load in zip(self.roles, loads) for entry in load]

    async def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """A trace on one replica of each engine deployment (written on that replica's node)."""
        return ", ".join(await self._on_every_deployment(
            "start_profile", output_dir=output_dir, num_steps=num_steps))

    async def stop_profile(self) -> str:
        return ", ".join(await self._on_every_deployment("stop_profile"))

    def _replica_counts(self) -> dict[str, int]:
        """Running or starting replicas of each engine deployment of this application."""
        app = serve.status().applications[self.engines[0].app_name]
        return {h.deployment_name: sum(app.deployments[h.deployment_name].replica_states.values())
                for h in self.engines}

    async def update_weights_from_disk(self, model_path: str, **kwargs) -> dict:
        """The weight update on every engine deployment (prefill and decode alike). A handle
        reaches one replica, so a deployment with several replicas is refused up front
        rather than left half updated."""
        counts = await asyncio.to_thread(self._replica_counts)
        many = {d: n for d, n in counts.items() if n != 1}
        if many:
            return {"success": False, "num_paused_requests": 0, "message":
                    f"weight updates under Ray need exactly one replica per engine deployment "
                    f"(replicas: {many}); nothing was changed"}
        results = await self._on_every_deployment("update_weights_from_disk", model_path, **kwargs)
        failed = [f"{role}: {r['message']}" for role, r in zip(self.roles, results) if not r["success"]]
        return {"success": not failed,
                "message": "; ".join(failed) if failed else results[-1]["message"],
                "num_paused_requests": sum(r.get("num_paused_requests", 0) for r in results)}


@serve.deployment
@serve.ingress()
class Ingress:
    """HTTP routes of the standalone server; ``engine`` or ``prefill`` + ``decode`` handles."""

    def __init__(self, server_args: ServerArgs, engine=None, prefill=None, decode=None):
        self.remote_engine = RemoteEngine(server_args, engine=engine, prefill=prefill, decode=decode)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.remote_engine)
