"""The offline API (SGLang's ``sglang.Engine``): generate without a server.

    from sglang_tpu_backend import Engine       # this module's OfflineEngine
    with Engine(model_path=..., dtype="float32") as engine:
        out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
        outs = engine.generate(["a", "b"], {"max_new_tokens": 8})           # a list
        for chunk in engine.generate("Hello", {"max_new_tokens": 8}, stream=True): ...

``generate`` / ``async_generate`` take SGLang's arguments, build the same body the native
``/generate`` route parses (``native_protocol.parse_generate``: batches, ``n``, per-prompt
lists) and return exactly what that route returns: one dict ``{"text", "output_ids",
"meta_info"}`` for a single prompt with n == 1, else a list; ``stream=True`` gives the
route's chunks (cumulative ``text``, incremental output logprobs, ``index`` in a batch).
Bad input raises ``InvalidRequestError`` (a ValueError naming the field).

``OfflineEngine`` wraps an ``engine.Engine`` (it builds one from ServerArgs fields, or takes
one: ``OfflineEngine(engine=...)``) and adds only this API; the engine core knows nothing of it.
The sync calls run their coroutines on a private event loop in a daemon thread
(``engine-offline``, started on first use, stopped by ``close`` / ``shutdown``), so they work
from a plain script and from code that already runs an event loop. ``async_generate`` runs on
the caller's loop. The engine's scheduler loop is its own thread either way.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any, AsyncIterator, Iterator

from sglang_tpu_backend.entrypoints.fanout import Fanout
from sglang_tpu_backend.entrypoints.native_protocol import (
    LogprobAccumulator, StreamState, parse_generate)
from sglang_tpu_backend.entrypoints.request_fields import APIError
from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError

SHUTDOWN_TIMEOUT_S = 30.0


def generate_body(prompt=None, sampling_params=None, input_ids=None, *, return_logprob=False,
                  logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=False,
                  stream=False, rid=None, image_data=None, lora_path=None,
                  custom_logit_processor=None, return_hidden_states=False,
                  return_routed_experts=None) -> dict[str, Any]:
    """SGLang ``Engine.generate`` arguments -> the native ``/generate`` body (None: unset).
    Features this backend lacks (images, LoRA, custom logit processors, hidden states) raise
    InvalidRequestError when used."""
    if isinstance(prompt, GenerateReqInput):
        raise TypeError("Engine.generate takes SGLang's offline arguments (prompt, "
                        "sampling_params, ...); for one GenerateReqInput use generate_request")
    for name, value in (("image_data", image_data), ("lora_path", lora_path),
                        ("custom_logit_processor", custom_logit_processor),
                        ("return_hidden_states", return_hidden_states or None)):
        if value is not None:
            raise InvalidRequestError(name, f"{name} is not supported by this backend")
    body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params,
            "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
            "return_text_in_logprobs": return_text_in_logprobs, "stream": stream, "rid": rid,
            "return_routed_experts": return_routed_experts}
    return {k: v for k, v in body.items() if v is not None}


async def _anext(agen: AsyncIterator[dict]) -> dict:
    return await agen.__anext__()


class OfflineEngine:
    """SGLang's offline ``Engine`` API over an ``engine.Engine``.

    ``OfflineEngine(server_args)`` / ``OfflineEngine(**ServerArgs fields)`` builds the engine
    (and ``shutdown`` stops it); ``OfflineEngine(engine=e)`` wraps an existing one.
    """

    def __init__(self, server_args: Any = None, *, engine: Any = None, **kwargs):
        if engine is None:
            from sglang_tpu_backend.engine import Engine

            engine = Engine(server_args, **kwargs)
        elif server_args is not None or kwargs:
            raise TypeError("OfflineEngine: pass engine= or the engine's arguments, not both")
        self.engine = engine
        self._offline_loop: asyncio.AbstractEventLoop | None = None
        self._offline_thread: threading.Thread | None = None
        self._offline_rng = random.Random(engine.args.random_seed)

    # Generation ------------------------------------------------------------------------------
    def _parse(self, body: dict):
        """``parse_generate`` with its APIError as InvalidRequestError; the base seed of an
        n > 1 request without one comes from a ``--random-seed`` generator, as the server's."""
        try:
            return parse_generate(body, self._offline_rng)
        except APIError as e:
            raise InvalidRequestError(e.param or "body", e.message) from None

    async def _outputs(self, body: dict) -> dict | list[dict]:
        """The final outputs, shaped as the ``/generate`` route returns them."""
        parsed = self._parse(body)
        accs = [LogprobAccumulator() for _ in parsed.reqs]
        fan = Fanout([self.engine.generate_request(r) for r in parsed.reqs],
                     transform=lambda i, out: accs[i](out))
        try:
            outs = await fan.last()
        finally:
            fan.close()
        for out, req in zip(outs, parsed.reqs):
            out.setdefault("meta_info", {}).setdefault("id", req.rid)
        return outs if parsed.is_batch else outs[0]

    async def _chunks(self, parsed) -> AsyncIterator[dict]:
        """The stream chunks the ``/generate`` route sends (without the SSE framing)."""
        accs = [LogprobAccumulator() for _ in parsed.reqs]
        states = [StreamState() for _ in parsed.reqs]
        fan = Fanout([self.engine.generate_request(r) for r in parsed.reqs],
                     transform=lambda i, out: accs[i](out))

        def fmt(i: int, out: dict) -> dict:
            chunk = states[i].chunk(out)
            chunk["meta_info"].setdefault("id", parsed.reqs[i].rid)
            return {**chunk, "index": i} if parsed.is_batch else chunk

        try:
            for i, out in enumerate(await fan.first()):
                if out is not None:
                    yield fmt(i, out)
            async for i, out in fan.rest():
                yield fmt(i, out)
        finally:
            fan.close()  # leaving early aborts the requests

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 **kwargs) -> dict | list[dict] | Iterator[dict]:
        """SGLang's ``Engine.generate`` (sync). ``kwargs``: return_logprob, logprob_start_len,
        top_logprobs_num, return_text_in_logprobs, return_routed_experts, stream, rid (each a
        value or, for a batch,
        a list per prompt where SGLang allows it). Returns a dict, a list of dicts, or with
        ``stream=True`` an iterator of chunks (closing it early aborts the requests)."""
        body = generate_body(prompt, sampling_params, input_ids, **kwargs)
        if body.get("stream"):
            return self._sync_iter(self._chunks(self._parse(body)))
        return self._run(self._outputs(body))

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None,
                             **kwargs) -> dict | list[dict] | AsyncIterator[dict]:
        """``generate`` on the caller's event loop; ``stream=True`` returns an async iterator
        (``async for chunk in await engine.async_generate(..., stream=True)``)."""
        body = generate_body(prompt, sampling_params, input_ids, **kwargs)
        if body.get("stream"):
            return self._chunks(self._parse(body))
        return await self._outputs(body)

    # SGLang's other Engine calls (the core's; blocking ones run here, on the caller's thread) -
    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict:
        info = dict(self.engine.get_server_info())
        info["pool_stats"] = self.engine.pool_stats()  # as GET /get_server_info
        return info

    def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "jax_transfer") -> tuple[bool, str]:
        """SGLang's ``(success, message)``; the TPU transport (``managers/weight_group.py``)."""
        r = self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                  world_size, group_name, backend)
        return r["success"], r["message"]

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        weight_version: str | None = None) -> tuple[bool, str]:
        r = self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                        flush_cache, weight_version)
        return r["success"], r["message"]

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                     ) -> tuple[bool, str]:
        r = self.engine.destroy_weights_update_group(group_name)
        return r["success"], r["message"]

    def abort_request(self, rid: str = "", abort_all: bool = False) -> bool:
        """Abort request ``rid``, or with ``abort_all`` every request; False when no such
        request is in the engine."""
        return self.engine.abort_request(rid, abort_all=abort_all)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> tuple[bool, str, int]:
        """SGLang's ``(success, message, num_paused_requests)`` once the new weights serve
        (the route answers the same as a dict)."""
        r = self.engine.update_weights_from_disk(model_path, load_format, abort_all_requests,
                                                 weight_version)
        return r["success"], r["message"], r["num_paused_requests"]

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None
                                   ) -> tuple[bool, str]:
        """Checkpoint-named arrays (``[(name, numpy or jax array), ...]`` or a dict; any subset
        of the names) -> SGLang's ``(success, message)``."""
        r = self.engine.update_weights_from_tensor(named_tensors, load_format, flush_cache,
                                                   weight_version)
        return r["success"], r["message"]

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self.engine.resume_memory_occupation(tags)

    def pause_generation(self, mode: str = "abort") -> dict:
        return self.engine.pause_generation(mode)

    def continue_generation(self) -> dict:
        return self.engine.continue_generation()

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        return self.engine.start_profile(output_dir, num_steps)

    def stop_profile(self) -> str:
        return self.engine.stop_profile()

    def start_expert_distribution_record(self) -> None:
        self.engine.start_expert_distribution_record()

    def stop_expert_distribution_record(self) -> None:
        self.engine.stop_expert_distribution_record()

    def dump_expert_distribution_record(self, output_dir: str | None = None) -> str:
        """Write the record into ``output_dir`` (default: ``--profile-dir-root``'s default,
        ``$SGLANG_TORCH_PROFILER_DIR`` or the temp directory); returns the file's path."""
        import os
        import tempfile

        if output_dir is None:
            output_dir = (self.engine.args.profile_dir_root
                          or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir())
        return self.engine.dump_expert_distribution_record(output_dir)

    # Context manager ---------------------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engine (every request aborted), then the private event loop."""
        self.engine.shutdown()
        self.close()

    # The private event loop --------------------------------------------------------------------
    def _loop_for_sync(self) -> asyncio.AbstractEventLoop:
        if self._offline_loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="engine-offline", daemon=True)
            thread.start()
            self._offline_loop, self._offline_thread = loop, thread
        return self._offline_loop

    def _run(self, coro) -> Any:
        """Run ``coro`` on the private loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop_for_sync()).result()

    def _sync_iter(self, agen: AsyncIterator[dict]) -> Iterator[dict]:
        loop = self._loop_for_sync()
        try:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(_anext(agen), loop).result()
                except StopAsyncIteration:
                    return
        finally:
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(agen.aclose(), loop).result(SHUTDOWN_TIMEOUT_S)

    def close(self) -> None:
        """Stop the private event loop (the engine keeps running)."""
        loop, thread = self._offline_loop, self._offline_thread
        if loop is None:
            return
        self._offline_loop = self._offline_thread = None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(SHUTDOWN_TIMEOUT_S)
            loop.close()
