"""SGLang-format outputs of a request: cumulative text, ids, logprob entries, abort outputs.

The loop thread builds an :class:`OutputSnapshot` per delivery under the engine lock in
O(new tokens): each logprob entry (``[logprob | None, token_id, text | None]``) is built once
into the request's :class:`LogprobEntries`, and the snapshot only records each cumulative
list's length. The consumer materialises the dict off the lock.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from sglang_tpu_backend.model_executor.routed_experts import encode, request_rows


class OutputSnapshot:
    """One delivery of a request's output, taken under the engine lock in O(1): the text (a
    str), the scalar meta_info, and each cumulative list as (list, length at delivery). The
    lists are append-only, so ``materialize()`` (run by the consumer, off the lock) copies
    exactly what they held then: an earlier output never changes."""

    __slots__ = ("text", "meta", "lists")

    def __init__(self, text: str, meta: dict, lists: dict[str, tuple[list, int]]):
        self.text, self.meta, self.lists = text, meta, lists

    def materialize(self) -> dict:
        """The SGLang output dict: {"text", "output_ids", "meta_info"}."""
        meta = dict(self.meta)
        for key, (values, n) in self.lists.items():
            if key != "output_ids":
                meta[key] = values[:n]
        ids, n = self.lists["output_ids"]
        return {"text": self.text, "output_ids": ids[:n], "meta_info": meta}


class LogprobEntries:
    """One request's SGLang logprob entries built so far.

    input_tokens / output_tokens: ``[logprob | None, token_id, text | None]`` per position;
    input_tops / output_tops: per position a list of such entries (input_tops starts with
    SGLang's ``None`` for the first prompt position). Append-only.
    """

    __slots__ = ("input_tokens", "input_tops", "output_tokens", "output_tops")

    def __init__(self):
        self.input_tokens: list[list] = []
        self.input_tops: list[list[list] | None] = [None]
        self.output_tokens: list[list] = []
        self.output_tops: list[list[list]] = []


def abort_output(rid: str, message: str, last: dict | None = None,
                 prompt_tokens: int | None = None) -> dict:
    """The final output of a request that ends with ``finish_reason`` abort: ``last`` (the
    latest output the client saw, if any) with its finish_reason replaced, else an empty one."""
    out = dict(last or {"text": "", "output_ids": []})
    meta = dict((last or {}).get("meta_info") or {"id": rid, "completion_tokens": 0,
                                                  "cached_tokens": 0})
    if prompt_tokens is not None:
        meta.setdefault("prompt_tokens", prompt_tokens)
    meta["finish_reason"] = {"type": "abort", "message": message}
    out["meta_info"] = meta
    return out


class OutputBuilder:
    """Builds a request's outputs; ``decode_token(id) -> str`` gives a token's text for
    ``return_text_in_logprobs``. ``speculative``: meta_info carries SGLang's
    ``spec_verify_ct`` (verify steps the request ran) and ``spec_accept_length`` (output
    tokens it gained per verify step, on average: 1 + the drafts accepted, less what a stop
    dropped; 0 before its first). ``weight_version``: the label of the weights serving now,
    in every output's meta_info (SGLang's; the weight updater sets it at each swap)."""

    def __init__(self, decode_token: Callable[[int], str], speculative: bool = False,
                 weight_version: str = "default"):
        self.decode_token = decode_token
        self.speculative = speculative
        self.weight_version = weight_version

    def snapshot(self, req: Any) -> OutputSnapshot:
        """``req``'s SGLang output so far (cumulative text, ids and logprob lists)."""
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": dict(req.finish_reason) if req.finish_reason else None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "weight_version": self.weight_version,
        }
        if req.finished:
            meta["e2e_latency"] = time.monotonic() - req.arrival_time
            if req.return_routed_experts:  # SGLang: in the final output only
                rows = request_rows(req)
                if rows is not None:
                    meta["routed_experts"] = encode(rows)
        if self.speculative:
            n = req.spec_verify_ct
            meta["spec_verify_ct"] = n
            meta["spec_accept_length"] = req.spec_verify_tokens / n if n else 0.0
        lists = {"output_ids": (req.output_ids, len(req.output_ids))}
        if req.return_logprob:
            e = self.logprob_entries(req)
            lists["input_token_logprobs"] = (e.input_tokens, len(e.input_tokens))
            lists["output_token_logprobs"] = (e.output_tokens, len(e.output_tokens))
            if req.top_logprobs_num > 0:
                lists["input_top_logprobs"] = (e.input_tops, len(e.input_tops))
                lists["output_top_logprobs"] = (e.output_tops, len(e.output_tops))
        return OutputSnapshot(req.text, meta, lists)

    def final_fallback(self, req: Any) -> dict:
        """A bare final output for ``req`` when building the full one failed."""
        return {"text": "", "output_ids": [], "meta_info": {
            "id": req.rid, "finish_reason": dict(req.finish_reason),
            "prompt_tokens": len(req.prompt_ids), "completion_tokens": 0, "cached_tokens": 0}}

    def _token_text(self, req: Any, tok: int) -> str | None:
        return self.decode_token(tok) if req.return_text_in_logprobs else None

    def _top_entries(self, req: Any, tops: list[tuple[float, int]]) -> list[list]:
        return [[lp, tid, self._token_text(req, tid)] for lp, tid in tops]

    def logprob_entries(self, req: Any) -> LogprobEntries:
        """``req``'s built logprob entries, extended by what it computed since the last call
        (each entry is built once: cost proportional to the new tokens, not the total)."""
        e = req.logprob_entries
        if e is None:
            e = req.logprob_entries = LogprobEntries()
        s = req.logprob_start_len
        num_in = len(req.prompt_ids) - s  # prompt positions reported: s .. P-1
        # input_token_logprobs[i] = [input_logprobs[i-1] (None for i = 0), prompt_ids[s+i], text]
        for i in range(len(e.input_tokens), min(num_in, 1 + len(req.input_logprobs))):
            t = req.prompt_ids[s + i]
            e.input_tokens.append([req.input_logprobs[i - 1] if i else None, t, self._token_text(req, t)])
        for i in range(len(e.output_tokens), min(len(req.output_logprobs), len(req.output_ids))):
            t = req.output_ids[i]
            e.output_tokens.append([req.output_logprobs[i], t, self._token_text(req, t)])
        if req.top_logprobs_num > 0:
            # input_top_logprobs = [None] + one list per reported input logprob
            for i in range(len(e.input_tops) - 1, min(num_in - 1, len(req.input_top_logprobs))):
                e.input_tops.append(self._top_entries(req, req.input_top_logprobs[i]))
            for i in range(len(e.output_tops), len(req.output_top_logprobs)):
                e.output_tops.append(self._top_entries(req, req.output_top_logprobs[i]))
        return e
