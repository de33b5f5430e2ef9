"""Validation and tokenisation: a ``GenerateReqInput`` becomes a ``Req``, or an error.

Every check runs before anything is allocated; a bad request raises InvalidRequestError naming
the field (HTTP 400). Tokenising a long prompt or compiling a grammar runs on a worker thread
(``build_async``), so the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from typing import Any

import numpy as np

from sglang_tpu_backend.managers.handover import RequestHandover
from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError
from sglang_tpu_backend.managers.schedule_batch import Req
from sglang_tpu_backend.mem_cache.page_pool import pages_for
from sglang_tpu_backend.sampling.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from sglang_tpu_backend.tokenizer import ids_decoder

# Above this prompt size (characters of text / token ids), or with a grammar to compile, a
# request is built on a worker thread; below it inline, where the thread hop would cost more
# than tokenising.
OFFLOAD_PROMPT_LEN = 2048


class RequestBuilder:
    """Builds the engine's requests.

    Args:
      tokenizer: the served tokenizer (``transformers`` fast tokenizer).
      vocab_size: token ids must lie in [0, vocab_size).
      context_length: prompt + max_new_tokens bound (tokens).
      kv_capacity_tokens: KV tokens one request may hold (one DP rank's pool).
      max_top_logprobs_num: bound of ``top_logprobs_num``.
      eos_ids: token ids that end generation (unless ``ignore_eos``).
      grammar_backend: compiles regex / JSON-schema constraints.
      random_seed: seeds the per-request seeds of requests that give none.
      per_rank: the capacity is per DP rank (named in the error).
      routed_experts: requests may set ``return_routed_experts``
        (``--enable-return-routed-experts``).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, context_length: int,
                 kv_capacity_tokens: int, page_size: int, max_top_logprobs_num: int,
                 eos_ids: frozenset[int], grammar_backend: Any, random_seed: int,
                 per_rank: bool = False, routed_experts: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size, self.context_length = vocab_size, context_length
        self.kv_capacity_tokens, self.page_size = kv_capacity_tokens, page_size
        self.max_top_logprobs_num = max_top_logprobs_num
        self.eos_ids, self.grammar_backend = eos_ids, grammar_backend
        self.per_rank, self.routed_experts = per_rank, routed_experts
        self._rng = random.Random(random_seed)
        self._decode_ids = ids_decoder(tokenizer)

    def decode_token(self, tok: int) -> str:
        return self.tokenizer.decode([tok])

    async def build_async(self, obj: GenerateReqInput, **kwargs) -> Req:
        """``build`` on a worker thread when it may take long (a grammar to compile, a prompt
        over ``OFFLOAD_PROMPT_LEN``), inline otherwise."""
        sp = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
        prompt = obj.text if obj.text is not None else obj.input_ids
        if (sp.get("regex") is not None or sp.get("json_schema") is not None
                or (isinstance(prompt, (str, list)) and len(prompt) > OFFLOAD_PROMPT_LEN)):
            return await asyncio.to_thread(self.build, obj, **kwargs)
        return self.build(obj, **kwargs)

    def build(self, obj: GenerateReqInput, *, export_after_prefill: bool = False) -> Req:
        """A validated ``Req`` for ``obj``; ``export_after_prefill``: the prefill side of a
        handover (stops after the first token and keeps ``obj`` to hand over)."""
        ids, field = self._prompt_ids(obj)
        P, ctx = len(ids), self.context_length
        sp = SamplingParams.from_dict(obj.sampling_params)
        sp.validate(self.vocab_size)
        max_new = self._max_new_tokens(sp, P)
        start = obj.logprob_start_len
        if start is None or start == -1 or start >= P:
            start = P - 1
        if start < 0:
            raise InvalidRequestError("logprob_start_len",
                                      f"logprob_start_len must be >= -1, got {obj.logprob_start_len}")
        n_top = obj.top_logprobs_num or 0
        if not 0 <= n_top <= self.max_top_logprobs_num:
            raise InvalidRequestError("top_logprobs_num", f"top_logprobs_num must be in "
                                      f"[0, {self.max_top_logprobs_num}], got {n_top}")
        self._check_routed(obj)
        grammar = None
        if sp.regex is not None or sp.json_schema is not None:
            grammar = self.grammar_backend.compile(regex=sp.regex, json_schema=sp.json_schema)
        rid = obj.rid or uuid.uuid4().hex
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        decode_ids, skip = self._decode_ids, sp.skip_special_tokens
        return Req(
            rid, ids, sp, max_new_tokens=max_new, seed=seed, eos_ids=self.eos_ids,
            context_length=ctx, return_logprob=bool(obj.return_logprob), logprob_start_len=start,
            top_logprobs_num=n_top, return_text_in_logprobs=bool(obj.return_text_in_logprobs),
            return_routed_experts=bool(obj.return_routed_experts),
            stream=bool(obj.stream), grammar=grammar,
            decode=lambda tok_ids: decode_ids(tok_ids, skip),
            export_after_prefill=export_after_prefill,
            request=dataclasses.replace(obj, rid=rid) if export_after_prefill else None,
        )

    def _check_routed(self, obj: GenerateReqInput) -> None:
        if not obj.return_routed_experts:
            return
        if not self.routed_experts:
            raise InvalidRequestError("return_routed_experts", "return_routed_experts needs a "
                                      "server started with --enable-return-routed-experts")

    def build_from_handover(self, h: RequestHandover) -> Req:
        """The decode side's ``Req`` for a handover: validated like a new request, then
        continued from what the prefill side computed."""
        if h.page_size != self.page_size:
            raise InvalidRequestError("page_size", f"handover pages of {h.page_size} tokens, "
                                      f"this engine's page_size is {self.page_size}")
        req = self.build(h.request)
        if list(h.prompt_ids) != req.prompt_ids:
            raise InvalidRequestError("input_ids", "handover prompt differs from the request's")
        self._check_handover_routed(h, req)
        req.resume_from(h)
        return req

    def _check_handover_routed(self, h: RequestHandover, req: Req) -> None:
        """A request with ``return_routed_experts`` continues from the prompt's ids
        ``h.routed_experts`` i32[num_computed, M, K] (M, K: checked against this engine's
        store when the handover is queued, ``HandoverManager.queue_install``)."""
        if not req.return_routed_experts:
            return
        rows = h.routed_experts
        if rows is None:
            raise InvalidRequestError("return_routed_experts", "the handover carries no routed "
                                      "experts (was the prefill replica started with "
                                      "--enable-return-routed-experts?)")
        if rows.dtype != np.int32 or rows.ndim != 3 or len(rows) != h.num_computed:
            raise InvalidRequestError("return_routed_experts", f"handover routed experts "
                                      f"{rows.dtype}{list(rows.shape)}, expected int32 "
                                      f"[{h.num_computed}, moe_layers, top_k]")

    def _prompt_ids(self, obj: GenerateReqInput) -> tuple[list[int], str]:
        if (obj.text is None) == (obj.input_ids is None):
            raise InvalidRequestError("text", "exactly one of text / input_ids must be given")
        if obj.text is not None:
            if not isinstance(obj.text, str):
                raise InvalidRequestError("text", "text must be a string")
            ids, field = self.tokenizer.encode(obj.text), "text"
        else:
            ids, field = obj.input_ids, "input_ids"
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError(field, "input_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(field, f"input_ids contains token id {bad[0]} outside "
                                          f"the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise InvalidRequestError(field, f"{field} is empty (0 prompt tokens)")
        if len(ids) >= self.context_length:
            raise InvalidRequestError(field, f"the input ({len(ids)} tokens) is longer than the "
                                      f"context length ({self.context_length} tokens)")
        return ids, field

    def _max_new_tokens(self, sp: SamplingParams, P: int) -> int:
        ctx = self.context_length
        if sp.max_new_tokens is None:
            max_new = min(DEFAULT_MAX_NEW_TOKENS, ctx - P)
        else:
            max_new = sp.max_new_tokens
            if P + max_new > ctx:
                raise InvalidRequestError(
                    "sampling_params.max_new_tokens",
                    f"sampling_params.max_new_tokens ({max_new}) + prompt ({P} tokens) exceeds "
                    f"the context length ({ctx} tokens)")
        if pages_for(P + max_new, self.page_size) * self.page_size > self.kv_capacity_tokens:
            raise InvalidRequestError(
                "sampling_params.max_new_tokens",
                f"sampling_params.max_new_tokens: prompt ({P}) + max_new_tokens ({max_new}) "
                f"exceeds the KV cache capacity ({self.kv_capacity_tokens} tokens"
                + (" per DP rank)" if self.per_rank else ")"))
        return max_new
