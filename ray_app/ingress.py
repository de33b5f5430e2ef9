"""HTTP ingress: the standalone server's app (``entrypoints/http_server.create_app``: the same
router and error handlers) over a ``RemoteEngine`` that forwards the Engine API to the
engine deployments. The app is built when the ingress replica starts (Serve's late-bound
ingress, ``__serve_build_asgi_app__``), once the engine handles exist.

Colocated: ``generate_request`` streams from one engine replica. Disaggregated: a prefill replica
runs the prompt and the first token and returns a transport ticket; a decode replica
installs the state and streams the rest (the ingress releases the ticket once the decode
replica's first output shows it holds the state, ``ray_app/handover.release``); the first
output is yielded in between (streaming requests see the first token before decoding starts). A ``rid`` already in flight at this
ingress is refused (400).
A handle call reaches one replica; what concerns every replica is broadcast to all running
replicas of every engine deployment (``DeploymentHandle.broadcast`` to
``EngineServer.on_replica``, answers labelled by replica): ``health_error`` (``/health`` is
503 naming the deployment that has no running replica or a replica that is unhealthy or
silent), cache flushes and profiles (failures named by replica), aborts of requests this
ingress does not serve, and SGLang's RL calls (pause / continue generation, release / resume
memory occupation, weight updates from tensors or from disk, the weight version: answers
aggregated over the replicas, failures named by replica; the calls that stop or change
replicas are refused up front when a replica might be missed). The weights update group
calls stay unsupported (501 with the reason: ``unsupported_calls``). ``abort_request`` of a
request it serves cancels its in-flight replica call (Serve cancels the replica task, the
engine aborts it).
``/metrics`` merges every engine replica's metrics (``ray_app/metrics_hub.py``; families by
name, samples labelled ``replica``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI
from ray import serve

from ray_app.handover import release as release_ticket
from ray_app.metrics_hub import get_hub
from ray_app.routing import prefix_key

TEXT_CHARS_PER_TOKEN = 8  # text read per affinity token: more than any tokenizer's token needs
from sglang_tpu_backend.entrypoints.http_server import create_app
from sglang_tpu_backend.managers.io_struct import (
    GenerateReqInput, InvalidRequestError, ServiceUnavailableError)
from sglang_tpu_backend.managers.output_builder import abort_output
from sglang_tpu_backend.server_args import CPU_PAGE_SIZE, ServerArgs

log = logging.getLogger(__name__)
RAY_TASK_ERROR = ray.exceptions.RayTaskError  # an exception raised inside a replica call
# The object store copy of a handover is owned by the prefill replica that made it; if that
# replica dies before the decode replica fetched it, the fetch fails with one of these.
HANDOVER_LOST = (ray.exceptions.ObjectLostError,)
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                serve.exceptions.ReplicaUnavailableError, serve.exceptions.DeploymentUnavailableError)
HEALTH_TIMEOUT_S = 5.0  # a replica that does not answer a health broadcast within this is unhealthy
ADMIN_TIMEOUT_S = 120.0  # aborts, cache flushes and profile starts / stops on every replica


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


@dataclasses.dataclass
class ReplicaReply:
    """One engine replica's answer to a broadcast (``EngineServer.on_replica``): ``result``, or
    ``error`` with the refused request ``field`` (None: the replica failed or was unreachable).
    ``replica`` is None for an answer of no known replica (none running, no answer, died)."""

    deployment: str
    replica: str | None = None
    result: Any = None
    error: str | None = None
    field: str | None = None

    def __str__(self) -> str:
        where = self.deployment if self.replica is None else f"{self.deployment} replica {self.replica}"
        return f"{where}: {self.result if self.error is None else self.error}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class _Flight:
    """A request this ingress serves: its replica call in progress (prefill, decode or
    colocated generate), whether ``abort_request`` cancelled it, and its latest output."""

    def __init__(self):
        self.call = None
        self.aborted = False
        self.last: dict | None = None

    def start(self, call):
        """Track ``call``; one started after an abort is cancelled at once."""
        self.call = call
        if self.aborted:
            call.cancel()
        return call

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()


class RemoteEngine:
    """The Engine API over deployment handles (``engine`` or ``prefill`` + ``decode``)."""

    def __init__(self, args: ServerArgs, *, engine=None, prefill=None, decode=None,
                 affinity_tokens: int = 0):
        """``affinity_tokens``: how many leading prompt tokens key a request's replica (prefix
        cache affinity, ``ray_app/routing.py``); 0: none."""
        from sglang_tpu_backend.tokenizer import load_tokenizer
        from sglang_tpu_backend.model_loader.tiny_model import default_model_path

        self.args, self.affinity_tokens = args, affinity_tokens
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path or default_model_path())
        self.engine, self.prefill, self.decode = engine, prefill, decode
        self.engines = [h for h in (engine, prefill, decode) if h is not None]
        self.roles = ["colocated"] if engine is not None else ["prefill", "decode"]
        self._flights: dict[str, _Flight] = {}  # rid -> the request this ingress serves
        self._hub = None  # the application's metrics hub handle, looked up on first scrape

    # Requests ------------------------------------------------------------------------------
    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        """The engine's outputs for ``obj``. A request whose replica dies ends with
        ``finish_reason`` abort and a message (a prefill is retried once first); a request
        the engine refuses raises its ``InvalidRequestError`` (400 at the routes), as does a
        ``rid`` this ingress already serves."""
        if obj.rid in self._flights:
            raise InvalidRequestError("rid", f"rid {obj.rid!r} is already in flight")
        flight = self._flights[obj.rid] = _Flight()
        try:
            async with contextlib.aclosing(self._outputs(obj, flight)) as outs:
                async for out in outs:
                    flight.last = out
                    yield out
        except (asyncio.CancelledError, serve.exceptions.RequestCancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and not flight.aborted:
                raise  # this task itself is being cancelled
            yield abort_output(obj.rid, "Aborted by the client or the server", flight.last)
        except RAY_TASK_ERROR as e:
            if isinstance(e.cause, (InvalidRequestError, ServiceUnavailableError)):
                raise e.cause from None  # a 400, or a 503 (e.g. the engine's memory is released)
            if not isinstance(e.cause, HANDOVER_LOST):
                raise
            log.warning("request %s: handover lost: %s", obj.rid, e.cause)
            where = ("with its prefill replica" if isinstance(e.cause, ray.exceptions.OwnerDiedError)
                     else "before its decode replica fetched it")
            yield abort_output(obj.rid, f"the request's prefilled state was lost {where} "
                               f"({type(e.cause).__name__})", flight.last)
        except REPLICA_GONE as e:
            log.warning("request %s: replica failed: %s", obj.rid, e)
            yield abort_output(obj.rid, f"the serving replica failed: {type(e).__name__}", flight.last)
        finally:
            del self._flights[obj.rid]
            flight.cancel()  # the client left: stop the replica's work

    async def _outputs(self, obj: GenerateReqInput, flight: _Flight) -> AsyncIterator[dict]:
        """Colocated: one replica's stream. Disaggregated: the prefill replica's first output
        (yielded when streaming, or when it is the final one), then the decode replica's."""
        key = self._routing_key(obj)
        if self.engine is not None:
            async for out in flight.start(self.engine.options(stream=True).generate.remote(
                    obj, routing_key=key)):
                yield out
            return
        res = await self._prefill(obj, flight, key)
        flight.last, ticket = res["first"], res["ticket"]
        if ticket is None or obj.stream:
            yield res["first"]
        if ticket is None:
            return
        held = True  # the prefill side holds the state until the ticket is released
        try:
            async for out in flight.start(self.decode.options(stream=True).decode.remote(ticket)):
                if held:  # the decode replica's first output: it has the state
                    release_ticket(ticket)
                    held = False
                yield out
        finally:
            if held:
                release_ticket(ticket)

    def _routing_key(self, obj: GenerateReqInput) -> str | None:
        """The prefix-affinity key of ``obj``'s prompt (None: route by load alone)."""
        if not self.affinity_tokens or self.args.disable_radix_cache:
            return None
        ids = obj.input_ids
        if ids is None and isinstance(obj.text, str):
            # The key needs the leading tokens only: tokenize a bounded prefix of the text (the
            # engine tokenizes the whole prompt); equal text prefixes give equal keys.
            ids = self.tokenizer.encode(obj.text[:TEXT_CHARS_PER_TOKEN * self.affinity_tokens])
        if not isinstance(ids, list):
            return None  # malformed: the engine answers it with a 400
        try:
            # (any page granularity groups equal prefixes; the replicas' own is per backend)
            page = self.args.page_size or CPU_PAGE_SIZE
            return prefix_key(ids, page, self.affinity_tokens)
        except (TypeError, ValueError, OverflowError):
            return None

    async def _prefill(self, obj: GenerateReqInput, flight: _Flight, key: str | None = None,
                       attempts: int = 2) -> dict[str, Any]:
        """A prefill replica's ``{"first", "ticket"}``; retried on another replica when the
        one serving it dies (nothing was streamed to the client yet)."""
        for attempt in range(attempts):
            try:
                return await flight.start(self.prefill.prefill.remote(obj, routing_key=key))
            except REPLICA_GONE as e:
                if attempt + 1 == attempts:
                    raise
                log.warning("request %s: prefill replica failed (%s), retrying", obj.rid, e)
        raise AssertionError("unreachable")

    async def abort_request(self, rid: str) -> bool:
        """Abort ``rid``: a request this ingress serves is cancelled here (its replica call;
        the engine aborts it); any other is aborted by rid on every engine replica (one that
        another ingress replica routed). True when it was found."""
        flight = self._flights.get(rid)
        if flight is not None:
            flight.aborted = True
            flight.cancel()
            return True
        replies = await self._broadcast("abort_request", rid)
        for r in replies:
            if r.error is not None:
                log.warning("abort of %s: %s", rid, r)
        return any(r.result for r in replies if r.error is None)

    # Every replica ---------------------------------------------------------------------------
    async def health_error(self) -> str | None:
        """Why the application cannot serve (``/health`` answers 503 with it), or None: an
        engine deployment has no running replica, or one of its replicas reports a health
        error (``EngineServer.health_error``), fails, or does not answer within
        ``HEALTH_TIMEOUT_S``. Each cause is named by deployment (and replica when known)."""
        replies = await self._broadcast("health_error", timeout_s=HEALTH_TIMEOUT_S)
        bad = [str(r) for r in replies if r.error is not None or r.result is not None]
        return "; ".join(bad) or None

    async def flush_cache(self) -> bool:
        """True when every engine replica flushed its prefix cache; False when one declined
        (logged by replica); ServiceUnavailableError naming the replicas that failed."""
        replies = await self._broadcast("flush_cache")
        self._raise_failures("flush_cache", replies)
        declined = [r for r in replies if not r.result]
        if declined:
            log.warning("cache not flushed on: %s", "; ".join(map(str, declined)))
        return not declined

    async def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """A trace on every engine replica (written on its replica's node); raises naming the
        replicas that refused (e.g. a trace runs there already: 400) or failed (503); those
        that started keep tracing until ``stop_profile``."""
        replies = await self._broadcast("start_profile", output_dir=output_dir, num_steps=num_steps)
        self._raise_failures("start_profile", replies)
        return ", ".join(map(str, replies))

    async def stop_profile(self) -> str:
        """Stop the trace on every replica that runs one: ``"<deployment> replica <id>:
        <directory>"`` each; InvalidRequestError when none runs one."""
        replies = await self._broadcast("stop_profile")
        stopped = [r for r in replies if r.error is None]
        self._raise_failures("stop_profile", replies, ignore_refusals=bool(stopped))
        return ", ".join(map(str, stopped))

    async def start_expert_distribution_record(self) -> None:
        self._raise_failures("start_expert_distribution_record",
                             await self._broadcast("start_expert_distribution_record"))

    async def stop_expert_distribution_record(self) -> None:
        self._raise_failures("stop_expert_distribution_record",
                             await self._broadcast("stop_expert_distribution_record"))

    async def dump_expert_distribution_record(self, output_dir: str) -> str:
        """Every replica writes its own record on its node: ``"<deployment> replica <id>:
        <path>"`` each."""
        replies = await self._broadcast("dump_expert_distribution_record", output_dir)
        self._raise_failures("dump_expert_distribution_record", replies)
        return ", ".join(map(str, replies))

    async def _broadcast(self, method: str, *args, timeout_s: float = ADMIN_TIMEOUT_S,
                         **kwargs) -> list[ReplicaReply]:
        """``EngineServer.<method>`` on every running replica of every engine deployment."""
        per_deployment = await asyncio.gather(
            *(self._broadcast_to(h, method, args, kwargs, timeout_s) for h in self.engines))
        return [reply for replies in per_deployment for reply in replies]

    @staticmethod
    async def _broadcast_to(handle, method: str, args: tuple, kwargs: dict,
                            timeout_s: float) -> list[ReplicaReply]:
        name = handle.deployment_name
        try:
            answers = await handle.broadcast("on_replica", method, *args, **kwargs).results_async(
                timeout_s=timeout_s, return_exceptions=True)
        except serve.exceptions.DeploymentUnavailableError:
            return [ReplicaReply(name, error="no running replica")]
        except TimeoutError:
            return [ReplicaReply(name, error=f"no answer from its replicas within {timeout_s:g} s")]
        return [ReplicaReply(name, **a) if isinstance(a, dict)
                else ReplicaReply(name, error=f"a replica failed: {_first_line(a)}") for a in answers]

    @staticmethod
    def _raise_failures(action: str, replies: list[ReplicaReply], ignore_refusals: bool = False,
                        note: str = "") -> None:
        """Raise when replicas failed ``action`` (ServiceUnavailableError, a 503) or refused it
        (the engine's InvalidRequestError, a 400, unless ``ignore_refusals``), naming them;
        ``note`` (what became of the other replicas) ends the message."""
        failed = [r for r in replies if r.error is not None and r.field is None]
        refused = [r for r in replies if r.error is not None and r.field is not None]
        tail = f" ({note})" if note and len(failed) + len(refused) < len(replies) else ""
        if failed:
            raise ServiceUnavailableError(f"{action} failed on {len(failed)} of {len(replies)} "
                                          f"replicas: {'; '.join(map(str, failed + refused))}{tail}")
        if refused and not ignore_refusals:
            raise InvalidRequestError(refused[0].field, f"{action} refused by {len(refused)} of "
                                      f"{len(replies)} replicas: {'; '.join(map(str, refused))}{tail}")

    # One replica per deployment ------------------------------------------------------------
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

    # SGLang's RL calls: every replica of every engine deployment -------------------------
    # The distributed weight-group calls stay unsupported here (the routes answer 501 with
    # this reason): a group pairs the trainer with ONE engine process.
    unsupported_calls = dict.fromkeys(
        ("init_weights_update_group", "update_weights_from_distributed",
         "destroy_weights_update_group"),
        "a weights update group joins one engine process to the trainer, and a Ray Serve "
        "application runs several behind one address; refit its replicas with "
        "/update_weights_from_tensor or /update_weights_from_disk (every replica), or use "
        "ray_app.rollout.RolloutGroup for trainer refits under Ray")

    def _replica_states(self) -> dict[str, dict[str, int]]:
        """``{deployment: {replica state: count}}`` of this application's engine deployments
        (Serve's controller; states such as ``RUNNING``, ``STARTING``, ``STOPPING``)."""
        app = serve.status().applications[self.engines[0].app_name]
        return {h.deployment_name: {str(getattr(state, "value", state)): n for state, n in
                                    app.deployments[h.deployment_name].replica_states.items()}
                for h in self.engines}

    async def _unreachable(self) -> str | None:
        """Why a broadcast now might miss an engine replica, or None when it reaches all: a
        replica not running (starting, stopping, recovering: a broadcast reaches running
        replicas only), or fewer running replicas answering a probe (``get_weight_version``)
        than Serve counts (the ingress's view of the replicas lags a change)."""
        states = await asyncio.to_thread(self._replica_states)
        other = {d: {k: n for k, n in st.items() if k != "RUNNING" and n}
                 for d, st in states.items()}
        other = {d: st for d, st in other.items() if st}
        if other:
            return f"replicas are not all running ({other})"
        replies = await self._broadcast("get_weight_version")
        failed = [str(r) for r in replies if r.error is not None]
        if failed:
            return f"replicas did not answer: {'; '.join(failed)}"
        for d, st in states.items():
            answered = sum(r.deployment == d for r in replies)
            if answered != st.get("RUNNING", 0):
                return (f"{d}: {answered} of its {st.get('RUNNING', 0)} running replicas are "
                        "reachable now (retry once the deployment is stable)")
        return None

    @staticmethod
    def _update_answer(action: str, replies: list[ReplicaReply]) -> dict:
        """SGLang's ``{"success", "message", "num_paused_requests"}`` over every replica's
        answer: success only when each replica succeeded; the message names the replicas that
        failed or refused (and how many serve the update), else says every replica does."""
        ok = [r for r in replies if r.error is None and r.result.get("success")]
        bad = [r if r.error is not None else ReplicaReply(r.deployment, r.replica,
                                                          error=r.result.get("message"))
               for r in replies if r not in ok]
        paused = sum(r.result.get("num_paused_requests", 0) for r in ok)
        if not bad:
            return {"success": True, "num_paused_requests": paused, "message":
                    f"{ok[-1].result['message']} (on all {len(ok)} engine replicas)"}
        where = "; ".join(map(str, bad))
        updated = ", ".join(f"{r.deployment} replica {r.replica}" for r in ok)
        kept = ("nothing was changed" if not ok else
                f"{len(ok)} replica(s) serve the new weights ({updated}): send the update again")
        return {"success": False, "num_paused_requests": paused,
                "message": f"{action} failed on {len(bad)} of {len(replies)} replicas: {where}; {kept}"}

    async def _update_every_replica(self, action: str, *args, **kwargs) -> dict:
        """``action`` (a weight update) on every replica of every engine deployment, prefill
        and decode alike, through the broadcast. Refused up front, nothing changed, when the
        broadcast might miss a replica (``_unreachable``). A refusal that concerns the
        update itself (a bad name or shape, an unreadable checkpoint) is every replica's
        alike, so nothing changes anywhere; a replica failing on its own (out of memory, gone)
        leaves the others on the new weights: the answer says so, with ``success`` false,
        and sending the update again brings every replica to it. A replica Serve starts later
        (a replacement, a scale-up) serves the application's configured checkpoint."""
        why = await self._unreachable()
        if why is not None:
            return {"success": False, "num_paused_requests": 0, "message":
                    f"{action} needs every engine replica reachable: {why}; nothing was changed"}
        return self._update_answer(action, await self._broadcast(action, *args, **kwargs))

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       abort_all_requests: bool = False,
                                       weight_version: str | None = None) -> dict:
        """The engine's weight update from a checkpoint directory (readable on every replica's
        node) on every engine replica (``_update_every_replica``)."""
        return await self._update_every_replica(
            "update_weights_from_disk", model_path, load_format=load_format,
            abort_all_requests=abort_all_requests, weight_version=weight_version)

    async def update_weights_from_tensor(self, named_tensors, load_format: str | None = None,
                                         flush_cache: bool = True,
                                         weight_version: str | None = None,
                                         abort_all_requests: bool = False) -> dict:
        """The engine's update from checkpoint-named arrays (``{name: numpy array}`` or
        pairs) on every engine replica (``_update_every_replica``). The arrays go into Ray's
        object store once (``ray.put``, off the event loop) and every replica reads that copy
        (``EngineServer.update_weights_from_tensor``); outside a Ray worker (tests over
        in-process replicas) the dict itself is passed."""
        named = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        payload = await asyncio.to_thread(ray.put, named) if ray.is_initialized() else named
        return await self._update_every_replica(
            "update_weights_from_tensor", payload, load_format=load_format,
            flush_cache=flush_cache, weight_version=weight_version,
            abort_all_requests=abort_all_requests)

    async def get_weight_version(self) -> str:
        """The weight version every engine replica serves; ServiceUnavailableError (503) naming
        each replica's version when they differ (an update failed on some) or one fails."""
        replies = await self._broadcast("get_weight_version")
        self._raise_failures("get_weight_version", replies)
        versions = {r.result for r in replies}
        if len(versions) != 1:
            raise ServiceUnavailableError("the engine replicas serve different weight versions: "
                                          + "; ".join(map(str, replies)))
        return versions.pop()

    async def pause_generation(self, mode: str = "abort") -> dict:
        """Pause every engine replica (``managers/rl_control.py``) once each has no step in
        flight: ``{"success", "mode", "num_aborted", "num_retracted"}``, the counts summed
        over the replicas. Refused up front (503, nothing paused) when the broadcast might
        miss a replica; a bad ``mode`` is refused by every replica alike (400, nothing
        paused). A replica failing: 503 naming it; the others stay paused
        (``continue_generation`` resumes them)."""
        why = await self._unreachable()
        if why is not None:
            raise ServiceUnavailableError(f"pause_generation needs every engine replica "
                                          f"reachable: {why}; nothing was paused")
        replies = await self._broadcast("pause_generation", mode)
        self._raise_failures("pause_generation", replies, note=(
            "the other replicas are paused: continue_generation resumes them"))
        return {"success": True, "mode": mode,
                "num_aborted": sum(r.result["num_aborted"] for r in replies),
                "num_retracted": sum(r.result["num_retracted"] for r in replies)}

    async def continue_generation(self) -> dict:
        """Resume every running engine replica: ``{"success"}``; 503 naming a replica that
        failed (the others run again). A replica that starts later starts unpaused."""
        replies = await self._broadcast("continue_generation")
        self._raise_failures("continue_generation", replies)
        return {"success": True}

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Release ``tags`` (None: all) on every engine replica: ``{"success", "tags" (released
        now, the union over the replicas), "freed_bytes" (summed)}``. Refused up front (503)
        when the broadcast might miss a replica. When a replica refuses (400: requests still
        run there) or fails (503), the release is undone on every replica (a resume of the
        same tags), so no replica stays asleep, and the error names the replica."""
        why = await self._unreachable()
        if why is not None:
            raise ServiceUnavailableError(f"release_memory_occupation needs every engine replica "
                                          f"reachable: {why}; nothing was released")
        replies = await self._broadcast("release_memory_occupation", tags)
        if any(r.error is not None for r in replies):
            undo = await self._broadcast("resume_memory_occupation", tags)
            undone = all(r.error is None for r in undo)
            self._raise_failures("release_memory_occupation", replies, note=(
                "the replicas that released resumed again" if undone else
                "resuming the others failed on " + "; ".join(str(r) for r in undo if r.error)))
        return {"success": True, "freed_bytes": sum(r.result["freed_bytes"] for r in replies),
                "tags": sorted({t for r in replies for t in r.result["tags"]})}

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Resume ``tags`` (None: all) on every running engine replica: ``{"success", "tags"
        (still released somewhere)}``; 400 / 503 naming a replica that refused or failed (the
        others resumed)."""
        replies = await self._broadcast("resume_memory_occupation", tags)
        self._raise_failures("resume_memory_occupation", replies)
        return {"success": True, "tags": sorted({t for r in replies for t in r.result["tags"]})}


@serve.deployment
@serve.ingress()
class Ingress:
    """HTTP routes of the standalone server; ``engine`` or ``prefill`` + ``decode`` handles."""

    def __init__(self, server_args: ServerArgs, engine=None, prefill=None, decode=None,
                 affinity_tokens: int = 0):
        self.remote_engine = RemoteEngine(server_args, engine=engine, prefill=prefill,
                                          decode=decode, affinity_tokens=affinity_tokens)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.remote_engine)
