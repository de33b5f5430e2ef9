"""SGLang's native ``/generate`` body -> single-prompt engine requests, and stream chunks.

A body holds one prompt (``text: str`` / ``input_ids: list[int]``) or a batch
(``text: list[str]`` / ``input_ids: list[list[int]]``), and ``sampling_params.n`` samples per
prompt. The engine takes one prompt with n == 1, so a body expands into ``B * n`` requests in
SGLang's order: prompt-major, ``index = i * n + j``. The response is a single object for a
single prompt with n == 1 and a list otherwise.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from typing import Any

from sglang_tpu_backend.entrypoints.request_fields import (
    MAX_REQUESTS_PER_BODY, APIError, check_fanout, is_int, is_int_list, opt_field)
from sglang_tpu_backend.managers.io_struct import GenerateReqInput

# Sampling params whose empty value means "unset" (dropped, so engines without them accept it).
UNSET_IF_EMPTY = ("stop_regex",)
# meta_info lists that stream incrementally (each chunk carries only its new entries).
INCREMENTAL_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs")


@dataclasses.dataclass(frozen=True)
class ParsedGenerate:
    """``reqs[i * n + j]`` is sample j of prompt i."""

    reqs: list[GenerateReqInput]
    is_batch: bool
    stream: bool


def new_rid() -> str:
    return uuid.uuid4().hex


def _prompts(body: dict) -> tuple[list[tuple[str, Any]], bool]:
    """[("text", str) | ("input_ids", list[int])] and whether the body is a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise APIError("Exactly one of 'text' and 'input_ids' may be given, not both", "input_ids")
    if text is None and ids is None:
        raise APIError("One of 'text' or 'input_ids' is required", "text")
    if text is not None:
        if isinstance(text, str):
            return [("text", text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [("text", t) for t in text], True
        raise APIError("'text' must be a string or a non-empty list of strings", "text")
    if isinstance(ids, list) and ids and is_int_list(ids):
        return [("input_ids", ids)], False
    if isinstance(ids, list) and ids and all(isinstance(x, list) and x and is_int_list(x) for x in ids):
        return [("input_ids", x) for x in ids], True
    raise APIError("'input_ids' must be a non-empty list of integers or a non-empty list of "
                   "such lists", "input_ids")


def _per_prompt(body: dict, name: str, kind: str, default: Any, num: int) -> list[Any]:
    """A scalar field, or (batch only) a list with one value per prompt."""
    value = body.get(name)
    if isinstance(value, list) and kind != "list":
        if len(value) != num:
            raise APIError(f"'{name}' has {len(value)} entries for {num} prompts", name)
        return [opt_field({name: v}, name, kind, default) for v in value]
    return [opt_field(body, name, kind, default)] * num


def parse_generate(body: dict, seed_rng: random.Random) -> ParsedGenerate:
    """Validate a ``/generate`` body's structure and expand it into engine requests.

    Value ranges (temperature, top_p, vocabulary, context) are the engine's to check.
    ``seed_rng`` draws the base seed of an n > 1 request that names none, so its samples
    get distinct seeds ``base + j``.
    """
    prompts, is_batch = _prompts(body)
    num = len(prompts)
    check_fanout(num, 1, prompts[0][0], "sampling_params.n")
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != num:
            raise APIError(f"'sampling_params' has {len(sps)} entries for {num} prompts", "sampling_params")
    else:
        sps = [sps] * num
    for sp in sps:
        if sp is not None and not isinstance(sp, dict):
            raise APIError("'sampling_params' must be an object", "sampling_params")
    rids = body.get("rid")
    if rids is not None and not (isinstance(rids, str) or (isinstance(rids, list) and len(rids) == num
                                                           and all(isinstance(r, str) for r in rids))):
        raise APIError("'rid' must be a string or a list of strings, one per prompt", "rid")
    if isinstance(rids, str):
        rids = [rids] if num == 1 else [f"{rids}-{i}" for i in range(num)]
    return_logprob = _per_prompt(body, "return_logprob", "bool", False, num)
    start_len = _per_prompt(body, "logprob_start_len", "int", -1, num)
    top_num = _per_prompt(body, "top_logprobs_num", "int", 0, num)
    text_in_lp = opt_field(body, "return_text_in_logprobs", "bool", False)
    routed = _per_prompt(body, "return_routed_experts", "bool", False, num)
    stream = opt_field(body, "stream", "bool", False)
    for v in start_len:
        if v < -1:
            raise APIError(f"'logprob_start_len' must be >= -1, got {v}", "logprob_start_len")
    for v in top_num:
        if v < 0:
            raise APIError(f"'top_logprobs_num' must be >= 0, got {v}", "top_logprobs_num")

    reqs: list[GenerateReqInput] = []
    any_n = False
    for i, (kind, prompt) in enumerate(prompts):
        # null means "unset" in SGLang; the frontend sends every key (stop_regex: [] included)
        sp = {k: v for k, v in (sps[i] or {}).items()
              if v is not None and not (k in UNSET_IF_EMPTY and v in ([], "", ()))}
        n = sp.pop("n", None)
        n = 1 if n is None else n
        if not is_int(n) or n < 1:
            raise APIError(f"'sampling_params.n' must be an integer >= 1, got {n!r}", "sampling_params.n")
        check_fanout(1, n, kind, "sampling_params.n")
        if len(reqs) + n > MAX_REQUESTS_PER_BODY:
            raise APIError(f"{num} prompts with 'sampling_params.n' up to {n}: more than "
                           f"{MAX_REQUESTS_PER_BODY} samples per request", "sampling_params.n")
        any_n |= n > 1
        if sp.get("seed") is None and sp.get("sampling_seed") is not None:
            sp["seed"] = sp["sampling_seed"]
        sp.pop("sampling_seed", None)
        base_seed = sp.get("seed")
        if n > 1 and base_seed is None:
            base_seed = seed_rng.randrange(2**62)
        if base_seed is not None and not is_int(base_seed):
            raise APIError("'sampling_params.seed' must be an integer", "sampling_params.seed")
        for j in range(n):
            sp_j = dict(sp)
            if n > 1:
                sp_j["seed"] = base_seed + j
            rid = rids[i] if rids is not None else new_rid()
            reqs.append(GenerateReqInput(
                text=prompt if kind == "text" else None,
                input_ids=list(prompt) if kind == "input_ids" else None,
                sampling_params=sp_j,
                return_logprob=return_logprob[i],
                logprob_start_len=start_len[i],
                top_logprobs_num=top_num[i],
                return_text_in_logprobs=text_in_lp,
                return_routed_experts=routed[i],
                stream=stream,
                rid=rid if n == 1 else f"{rid}-{j}",
            ))
    return ParsedGenerate(reqs=reqs, is_batch=is_batch or any_n, stream=stream)


class LogprobAccumulator:
    """Makes one request's output logprob lists cumulative, whichever way the engine sends them."""

    def __init__(self):
        self.lists: dict[str, list] = {}

    def __call__(self, out: dict) -> dict:
        meta = out.get("meta_info", {})
        lps = meta.get("output_token_logprobs")
        if lps is None:
            return out
        total = meta.get("completion_tokens", len(lps))
        meta = dict(meta)
        for key in INCREMENTAL_LOGPROB_KEYS:
            if meta.get(key) is None:
                continue
            if len(lps) == total:  # already cumulative
                self.lists[key] = list(meta[key])
            else:
                self.lists.setdefault(key, []).extend(meta[key])
            meta[key] = list(self.lists[key])
        return {**out, "meta_info": meta}


class StreamState:
    """Per-request cursor turning cumulative outputs into SGLang stream chunks.

    ``text`` stays cumulative; the output logprob lists become incremental (each chunk
    carries the entries generated since the previous chunk, plus
    ``output_token_logprobs_length``, the running total), as SGLang streams them.
    """

    def __init__(self):
        self.num_sent = 0

    def chunk(self, out: dict) -> dict:
        meta = dict(out.get("meta_info", {}))
        lps = meta.get("output_token_logprobs")
        if lps is not None:
            for key in INCREMENTAL_LOGPROB_KEYS:
                if meta.get(key) is not None:
                    meta[key] = meta[key][self.num_sent:]
            meta["output_token_logprobs_length"] = len(lps)
            self.num_sent = len(lps)
        return {**out, "meta_info": meta}
