"""The engine interface the HTTP routes use, as a ``Protocol``.

Two classes implement it: ``sglang_tpu_backend.engine.Engine`` (in process, plain return values)
and the Ray ingress's ``RemoteEngine`` (forwards to the engine deployments, returning
awaitables). The routes therefore await any result that is awaitable (``MaybeAwaitable``).
``generate_request`` is an async iterator in both. The blocking calls (``start_profile``,
``stop_profile``, ``update_weights_from_disk``) run on a worker thread at the routes.

``install`` (``http_server``) refuses an engine that lacks a member, naming it, instead of each
route probing with ``hasattr``.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Protocol, TypeVar, runtime_checkable

from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.server_args import ServerArgs

T = TypeVar("T")
MaybeAwaitable = T | Awaitable[T]


@runtime_checkable
class EngineAPI(Protocol):
    """What ``app.state.engine`` provides. Every method may instead return an awaitable of
    the type shown; the errors it raises are ``InvalidRequestError`` (400) and
    ``ServiceUnavailableError`` (503)."""

    args: ServerArgs
    tokenizer: Any  # a transformers tokenizer: the OpenAI routes apply its chat template

    def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        """SGLang-format outputs of ONE prompt; closing it early aborts the request."""

    def abort_request(self, rid: str) -> MaybeAwaitable[bool]:
        """Abort request ``rid``; False when no such request runs."""

    def flush_cache(self) -> MaybeAwaitable[bool]:
        """Empty the prefix cache (at any time). True; a remote engine: False when some
        replica did not flush (the route answers 500)."""

    def get_model_info(self) -> MaybeAwaitable[dict]:
        """``{"model_path", "tokenizer_path", "is_generation", "weight_version", ...}``."""

    def get_server_info(self) -> MaybeAwaitable[dict]:
        """The server arguments (keys masked) and runtime facts."""

    def pool_stats(self) -> MaybeAwaitable[dict]:
        """KV page / state slot use and request counts (``/get_server_info``'s ``pool_stats``)."""

    def get_load(self) -> MaybeAwaitable[list[dict]]:
        """SGLang's load report, one entry per DP rank."""

    def start_profile(self, output_dir: str | None = None,
                      num_steps: int | None = None) -> MaybeAwaitable[str]:
        """Start a trace into ``output_dir`` (the routes pass a path inside the profile root);
        returns the directory."""

    def stop_profile(self) -> MaybeAwaitable[str]:
        """Stop the trace; returns where it was written."""

    def start_expert_distribution_record(self) -> MaybeAwaitable[None]:
        """Record routed rows per expert from now on (dropping the record so far)."""

    def stop_expert_distribution_record(self) -> MaybeAwaitable[None]:
        """Stop adding to the record."""

    def dump_expert_distribution_record(self, output_dir: str) -> MaybeAwaitable[str]:
        """Write the record as a load file into ``output_dir``; returns where (a remote
        engine: every replica's file, on its own node)."""

    def update_weights_from_disk(self, model_path: str, *, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> MaybeAwaitable[dict]:
        """``{"success", "message", "num_paused_requests"}`` once the new weights serve."""

    def health_generate(self) -> MaybeAwaitable[bool]:
        """Run a one-token request; False when it was aborted."""

    def health_error(self) -> MaybeAwaitable[str | None]:
        """Why the engine cannot serve (a dead or stalled loop), or None when healthy."""

    def metrics_text(self) -> MaybeAwaitable[bytes]:
        """Prometheus text exposition of the ``sglang:*`` families."""


ENGINE_API_MEMBERS = tuple(sorted(
    {*EngineAPI.__annotations__} | {n for n, v in vars(EngineAPI).items()
                                    if callable(v) and not n.startswith("_")}))


def missing_members(engine: Any) -> list[str]:
    """The ``EngineAPI`` members ``engine`` lacks (empty: it conforms)."""
    return [n for n in ENGINE_API_MEMBERS if not hasattr(engine, n)]
