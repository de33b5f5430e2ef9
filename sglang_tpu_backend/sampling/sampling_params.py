"""SGLang's per-request sampling parameters, parsed from the request dict and validated."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sglang_tpu_backend.managers.io_struct import InvalidRequestError
from sglang_tpu_backend.sampling.stop_strings import StopStrings

DEFAULT_MAX_NEW_TOKENS = 128
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit; sampler.MAX_LOGIT_BIAS pads to it)
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100], as OpenAI
# Stop strings per request and characters per stop string. Every generated token is checked
# against them under the engine lock, so they are bounded (OpenAI's API allows 4).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_LEN = 256
# Accepted for SGLang compatibility but without effect here.
_IGNORED_KEYS = frozenset({"n", "stream_interval", "custom_params", "sampling_seed"})
_UNSUPPORTED_KEYS = frozenset({"ebnf", "structural_tag", "lora_path"})


def check_stop_limits(stop: list[str], field: str) -> None:
    """Raise InvalidRequestError(``field``) for more than ``MAX_STOP_STRINGS`` stop strings or
    one longer than ``MAX_STOP_STRING_LEN`` characters."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(field, f"{field} has {len(stop)} stop strings; at most "
                                  f"{MAX_STOP_STRINGS} are allowed")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_STRING_LEN:
        raise InvalidRequestError(field, f"{field} has a stop string of {len(longest)} characters; "
                                  f"at most {MAX_STOP_STRING_LEN} are allowed")


@dataclasses.dataclass
class SamplingParams:
    """Fields as SGLang names them. ``top_k <= 0`` (SGLang's -1) disables top-k.

    ``max_new_tokens`` None means "the default, clamped to what the context leaves" (the
    engine resolves it). ``temperature == 0`` is greedy.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    regex: str | None = None
    json_schema: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    # SGLang / OpenAI: {"<token id>": bias} added to that token's logit before sampling.
    logit_bias: dict[str, float] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Parse a request's ``sampling_params``; None values take the defaults.

        Raises:
          InvalidRequestError: unknown or unsupported key, or a value of the wrong type.
        """
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise InvalidRequestError("sampling_params", "sampling_params must be an object")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            field = f"sampling_params.{key}"
            if key in _UNSUPPORTED_KEYS and value is not None:
                raise InvalidRequestError(field, f"{field} is not supported by this server")
            if key in _IGNORED_KEYS or key in _UNSUPPORTED_KEYS:
                continue
            if key not in names:
                raise InvalidRequestError(field, f"unknown sampling parameter {key!r}")
            if value is not None:
                kwargs[key] = value
        if "stop" in kwargs and isinstance(kwargs["stop"], str):
            kwargs["stop"] = [kwargs["stop"]]
        if "stop_token_ids" in kwargs and isinstance(kwargs["stop_token_ids"], int):
            kwargs["stop_token_ids"] = [kwargs["stop_token_ids"]]
        sp = cls(**kwargs)
        sp._check_types()
        return sp

    def _check_types(self) -> None:
        def bad(name: str, what: str):
            raise InvalidRequestError(f"sampling_params.{name}", f"sampling_params.{name} must be {what}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for name in ("max_new_tokens", "seed"):
            v = getattr(self, name)
            if v is not None and not is_int(v):
                bad(name, "an integer")
        for name in ("min_new_tokens", "top_k"):
            if not is_int(getattr(self, name)):
                bad(name, "an integer")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            if not is_num(getattr(self, name)):
                bad(name, "a number")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "a boolean")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            bad("stop", "a string or a list of strings")
        check_stop_limits(self.stop, "sampling_params.stop")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of integers")
        if self.regex is not None and not isinstance(self.regex, str):
            bad("regex", "a string")
        if self.json_schema is not None and not isinstance(self.json_schema, (str, dict)):
            bad("json_schema", "a JSON string")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "an object mapping token ids to biases")
            for k, v in self.logit_bias.items():
                if not (isinstance(k, str) and k.strip().lstrip("-").isdecimal()) or not is_num(v):
                    bad("logit_bias", f"an object mapping token-id strings to numbers (got {k!r}: {v!r})")

    def validate(self, vocab_size: int | None = None) -> None:
        """Range checks; raises InvalidRequestError naming the field."""
        def bad(name: str, what: str):
            raise InvalidRequestError(f"sampling_params.{name}", f"sampling_params.{name} {what}")

        self._check_types()
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", f"must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.regex is not None and self.json_schema is not None:
            bad("regex", "and sampling_params.json_schema cannot both be set")
        if any(s == "" for s in self.stop):
            bad("stop", "must not contain empty strings")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", f"must be in [0, 2^63), got {self.seed}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
            for k, v in self.logit_bias.items():
                if not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
                    bad("logit_bias", f"value for token {k} must be in [-100, 100], got {v}")
                if vocab_size is not None and not 0 <= int(k) < vocab_size:
                    bad("logit_bias", f"has token id {k}, outside the vocabulary [0, {vocab_size})")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    bad("stop_token_ids", f"contains {t}, outside the vocabulary [0, {vocab_size})")

    def stop_strings(self) -> StopStrings:
        """The matcher of ``stop`` (validated), built once."""
        cached = self.__dict__.get("_stop_strings")
        if cached is None:
            cached = self.__dict__["_stop_strings"] = StopStrings(self.stop)
        return cached

    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(token ids i32[n], biases f32[n]) of ``logit_bias`` (validated), or None when it
        is unset or empty; built once."""
        if not self.logit_bias:
            return None
        cached = self.__dict__.get("_bias_arrays")
        if cached is None:
            ids = np.array([int(k) for k in self.logit_bias], np.int32)
            vals = np.array(list(self.logit_bias.values()), np.float32)
            cached = self.__dict__["_bias_arrays"] = (ids, vals)
        return cached

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def top_k_or_off(self) -> int:
        """top_k with 0 meaning off (the sampler's convention)."""
        return 0 if self.top_k <= 0 else self.top_k
