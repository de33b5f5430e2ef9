"""Request structs shared by the engine and the HTTP layer."""

from __future__ import annotations

import dataclasses
from typing import Any


class InvalidRequestError(ValueError):
    """A request the engine refuses before allocating anything; the HTTP layer answers 400.

    Attributes:
      field:   the offending request field, e.g. ``"sampling_params.temperature"``.
      message: human-readable reason (includes the field name).
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message if field in message else f"{field}: {message}"
        super().__init__(self.message)

    def __reduce__(self):  # picklable (raised inside a Ray replica, re-raised at the ingress)
        return type(self), (self.field, self.message)


class ServiceUnavailableError(RuntimeError):
    """The engine cannot take the request now (queue full, scheduler loop dead); HTTP 503."""

    def __reduce__(self):
        return type(self), (str(self),)


@dataclasses.dataclass
class GenerateReqInput:
    """ONE prompt with n == 1 (the HTTP side expands batches and ``n > 1``).

    Exactly one of ``text`` / ``input_ids`` is set. ``sampling_params`` is SGLang's dict
    (unset values may be None). ``logprob_start_len == -1`` means "only the last prompt token".
    """

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False  # meta_info["routed_experts"] (--enable-return-routed-experts)
    stream: bool = False
    rid: str | None = None
