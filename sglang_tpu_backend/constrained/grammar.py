"""Regex / JSON-schema constrained decoding per request through llguidance.

``GrammarBackend`` wraps the HF tokenizer once (an ``LLTokenizer``, ~1 s to build);
``GrammarBackend.compile`` validates a request's regex or JSON schema (raising
InvalidRequestError naming the field) and returns a per-request ``Grammar`` holding an
``LLMatcher``. Each step the runner asks ``fill_bitmask`` for the allowed tokens and the
scheduler feeds the sampled token to ``accept``. A speculative verify step asks
``fill_draft_bitmasks`` for one mask per draft position, from a fork of the matcher: the
request's own matcher only ever consumes emitted tokens.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from typing import Any, Sequence

import numpy as np

from sglang_tpu_backend.managers.io_struct import InvalidRequestError

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Grammar:
    """One request's matcher state."""

    def __init__(self, matcher: Any, num_words: int, tokenizer_words: int):
        self.matcher = matcher
        self.num_words = num_words  # W of the model vocabulary
        self._buf = np.zeros((1, tokenizer_words), np.int32)  # llguidance's own width

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed-token mask into ``out`` (i32[W])."""
        self._fill(self.matcher, out)

    def fill_draft_bitmasks(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """The masks of a verify step over ``drafts`` (k tokens): row j of ``out`` (i32[n, W],
        n >= k + 1) := the tokens allowed after d_0 .. d_{j-1}. Stops at the first draft the
        grammar rejects and returns how many it allows (a); rows past a are left as they are.
        The drafts are consumed by a copy of the matcher: this request's state is unchanged."""
        self._fill(self.matcher, out[0])
        fork = None
        for j, token in enumerate(drafts):
            words = out[j].view(np.uint32)
            if not 0 <= token < 32 * len(words) or not (words[token // 32] >> (token % 32)) & 1:
                return j
            fork = fork or self.matcher.deep_copy()
            if not fork.consume_token(int(token)):
                return j
            self._fill(fork, out[j + 1])
        return len(drafts)

    def _fill(self, matcher: Any, out: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, self._buf, 0)
        n = min(self.num_words, self._buf.shape[1])
        out[:n] = self._buf[0, :n]
        out[n:] = 0

    def accept(self, token: int) -> None:
        """Consume a sampled token; a rejected token leaves the matcher stopped (logged)."""
        if not self.matcher.consume_token(token):
            logger.warning("grammar rejected token %d: %s", token, self.matcher.get_error())

    def is_terminated(self) -> bool:
        """The grammar accepts nothing more (a complete match, or an error)."""
        return self.matcher.is_stopped()


def _byte_level_chars() -> dict[int, str]:
    """GPT-2 byte-level BPE's printable stand-in character of each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
          *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: chr(b) for b in bs}
    extra = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + k)) for k, b in enumerate(extra))
    return chars


def text_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer JSON with its non-special added tokens (Qwen's ``<think>``,
    ``<tool_call>``, ...) moved into a byte-level BPE vocabulary.

    llguidance takes every added token for a special one (never text): a grammar whose text
    needs ``</think>`` then allows that token by its bytes and rejects it once sampled, which
    ends the request early. As vocabulary entries they are text like any other token. Other
    tokenizer kinds come back unchanged.
    """
    d = json.loads(tokenizer_json)
    if (d.get("model") or {}).get("type") != "BPE" or (d.get("decoder") or {}).get("type") != "ByteLevel":
        return tokenizer_json
    chars = _byte_level_chars()
    vocab, kept = d["model"]["vocab"], []
    for t in d.get("added_tokens") or []:
        if t.get("special", True):
            kept.append(t)
        else:
            vocab["".join(chars[b] for b in t["content"].encode("utf-8"))] = t["id"]
    if len(kept) == len(d.get("added_tokens") or []):
        return tokenizer_json
    d["added_tokens"] = kept
    return json.dumps(d, ensure_ascii=False)


class GrammarBackend:
    """Builds per-request grammars for one tokenizer and model vocabulary."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.num_words = bitmask_words(vocab_size)
        self._lltok = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                eos = self.eos_token_ids or self.hf_tokenizer.eos_token_id
                n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
                backend = copy.copy(self.hf_tokenizer.backend_tokenizer)  # as llguidance.hf does
                backend.no_padding()
                backend.no_truncation()
                self._lltok = llguidance.LLTokenizer(text_added_tokens(backend.to_str()), n_vocab=n_vocab,
                                                     eos_token=eos)
            return self._lltok

    def compile(self, *, regex: str | None = None, json_schema: Any = None) -> Grammar:
        """Validate and build. Raises InvalidRequestError("sampling_params.regex" / ".json_schema")."""
        import llguidance

        if regex is not None:
            field = "sampling_params.regex"
            grammar = llguidance.LLMatcher.grammar_from_regex(regex)
        elif json_schema is not None:
            field = "sampling_params.json_schema"
            schema = json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(field, f"{field} is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(field, f"{field} must be a JSON object")
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False}
                )
            except (ValueError, TypeError) as e:
                raise InvalidRequestError(field, f"{field} is invalid: {e}") from None
        else:
            raise ValueError("compile needs regex or json_schema")
        tok = self.lltokenizer
        err = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if err and not err.startswith("WARNING"):
            raise InvalidRequestError(field, f"{field} is invalid: {err}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(field, f"{field} is invalid: {matcher.get_error()}")
        return Grammar(matcher, self.num_words, bitmask_words(tok.vocab_size))
