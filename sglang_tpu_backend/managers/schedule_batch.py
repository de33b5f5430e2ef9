"""Per-request state (Req), incremental detokenisation, and what one scheduled step holds.

Plain Python: no JAX. Token bookkeeping: a request's token sequence is
``fill_ids = prompt_ids + output_ids``; ``num_computed`` of them have KV in the request's
pages and are folded into its GDN state slot. A step computes the next
``fill_ids[num_computed:num_computed + n]``. After a retraction ``num_computed`` drops to 0
and the request re-prefills prompt + generated tokens; sampling is keyed on the output
position, so greedy and seeded results do not change.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from sglang_tpu_backend.model_executor.forward_mode import ForwardMode


class IncrementalDetokenizer:
    """Cumulative text of a growing token list, decoding only a short window per step.

    ``decode(ids) -> str`` must be the tokenizer's decode with the request's options. Text
    ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def step(self, ids: list[int]) -> str:
        """Feed the whole id list so far; returns the newly readable text (also appended)."""
        prefix = self.decode(ids[self._prefix_offset:self._read_offset])
        full = self.decode(ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self.text += delta
            return delta
        return ""

    def finish(self, ids: list[int]) -> str:
        """Exact final text: one full decode."""
        self.text = self.decode(ids)
        return self.text


class Req:
    """One request's state from admission to finish.

    Attributes set by the engine at creation: prompt ids, resolved sampling values,
    ``eos_ids`` (set of ints), ``context_length``, logprob options and an optional grammar
    matcher (``constrained.grammar.Grammar``).
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: Any,  # SamplingParams
        *,
        max_new_tokens: int,
        seed: int,
        eos_ids: frozenset[int] = frozenset(),
        context_length: int = 1 << 30,
        return_logprob: bool = False,
        logprob_start_len: int = 0,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False, return_routed_experts: bool = False,
        stream: bool = False,
        grammar: Any = None,
        decode: Callable[[list[int]], str] | None = None,
        export_after_prefill: bool = False,
        request: Any = None,
    ):
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        self.seed, self.eos_ids = seed, eos_ids
        self.context_length = context_length
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.return_text_in_logprobs = return_text_in_logprobs
        self.return_routed_experts = return_routed_experts
        self.routed_rows: list = []  # routed expert ids per position so far (routed_experts.py)
        self.stream, self.grammar = stream, grammar
        self.output_ids: list[int] = []
        # Tokens sampled by launched steps whose values are not back yet (overlap scheduling:
        # the next step is launched before the previous one's tokens reach the host). They
        # count in the sequence (``num_fill``) but not in ``output_ids``/``fill_ids``.
        self.num_inflight = 0
        self.num_computed = 0  # tokens whose KV / GDN state a launched step computes
        self.pages: list[int] = []
        self.state_slot: int | None = None
        self.dp_rank: int | None = None  # DP rank whose pools hold pages and state_slot
        # Prefix cache: the radix-tree node (mem_cache/radix_cache.py) this request locks, the
        # leading entries of ``pages`` that the tree owns, and the prompt tokens reused at the
        # latest admission (reported as ``cached_tokens``).
        self.cache_node: Any = None
        self.num_shared_pages = 0
        self.cached_tokens = 0
        self.finish_reason: dict | None = None
        self.num_retractions = 0
        self.export_after_prefill = export_after_prefill  # prefill side of a handover: stop after the first token
        self.request = request  # prefill side of a handover: the GenerateReqInput to hand over
        self.detok = IncrementalDetokenizer(decode or (lambda ids: ""))
        self.max_stop_len = max((len(s) for s in sampling.stop), default=0)
        self.text = ""  # visible cumulative text (stop strings trimmed / held back)
        # Logprobs: raw values per prompt row / output token.
        self.input_logprobs: list[float] = []  # for rows logprob_start_len .. P-2
        self.input_top_logprobs: list[list[tuple[float, int]]] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.logprob_entries: Any = None  # output entries built so far (output_builder.LogprobEntries)
        # Speculative decoding: the drafter's state and NEXTN's back-off (``speculative/``),
        # the verify steps run (SGLang's ``spec_verify_ct``) and the output tokens they appended.
        self.draft_state: Any = None
        self.draft_guard: Any = None
        self.spec_verify_ct = self.spec_verify_tokens = 0
        # Timing (seconds, time.monotonic()).
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.admit_time: float | None = None
        self.num_sent_tokens = 0  # output tokens already delivered to the consumer
        self.final_delivered = False  # the final output went to the consumer (Delivery.deliver)
        # What the metrics have observed of this request (metrics/collector.py).
        self.metrics_queue_observed = False
        self.metrics_num_tokens = 0
        self.metrics_last_token_time: float | None = None
        self.metrics_finish_observed = False

    def resume_from(self, h: Any) -> None:
        """Decode side of a handover (``managers/handover.RequestHandover``): continue from
        what the prefill side computed (its first token(s), seed, logprobs, the prompt tokens
        its prefix cache served, the prompt's routed expert ids; the KV and GDN state of
        ``h.num_computed`` tokens are installed into this request's pages / slot)."""
        self.seed = h.seed
        self.cached_tokens = h.cached_tokens
        self.output_ids = list(h.output_ids)
        self.num_computed = h.num_computed
        self.num_sent_tokens = len(self.output_ids)  # the prefill side delivered those
        self.input_logprobs, self.input_top_logprobs = list(h.input_logprobs), list(h.input_top_logprobs)
        self.output_logprobs = list(h.output_logprobs)
        self.output_top_logprobs = list(h.output_top_logprobs)
        if self.return_routed_experts and h.routed_experts is not None:
            self.routed_rows = [h.routed_experts]  # the prompt's ids i32[P, M, K]
        if self.grammar is not None:
            for tok in self.output_ids:
                self.grammar.accept(tok)
        self.first_token_time = self.last_token_time = time.monotonic()
        self.update_text()

    # Sequence bookkeeping -----------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def fill_slice(self, start: int, n: int) -> list[int]:
        """``fill_ids[start:start + n]`` without building the whole sequence."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.output_ids[start - P:start - P + n]
        return self.prompt_ids[start:start + n] + self.output_ids[:max(0, start + n - P)]

    @property
    def num_fill(self) -> int:
        """Tokens of the sequence so far, in-flight sampled tokens included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def wants_top_logprobs(self) -> bool:
        """Returns the top logprobs of each sampled token (the sampler then runs with K > 0)."""
        return self.return_logprob and self.top_logprobs_num > 0

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, in flight included."""
        return len(self.output_ids) + self.num_inflight

    @property
    def num_pending(self) -> int:
        """Tokens still to be computed before the next sample."""
        return self.num_fill - self.num_computed

    @property
    def is_decode_ready(self) -> bool:
        """Only the last sampled token is missing from the cache, and another token may be
        sampled (length and context limits counted with the tokens in flight): a one-token
        decode step. A request with a grammar also needs its last token back (the next
        token's mask depends on it); a handover's prefill side never decodes."""
        return (self.num_computed > 0 and self.num_pending == 1 and self.num_sampled > 0
                and self.num_sampled < self.max_new_tokens and self.num_fill < self.context_length
                and not (self.num_inflight and self.grammar is not None)
                and not self.export_after_prefill)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # Prompt logprobs ------------------------------------------------------------------
    def input_logprob_rows(self, start: int, n: int) -> range:
        """Rows in ``[start, start+n)`` whose logits give still-missing prompt logprobs.

        Row ``i`` predicts prompt token ``i + 1``; SGLang reports rows
        ``logprob_start_len .. P-2`` (the first entry of the answer is a null placeholder).
        """
        if not self.return_logprob:
            return range(0)
        lo = max(start, self.logprob_start_len + len(self.input_logprobs))
        hi = min(start + n, len(self.prompt_ids) - 1)
        return range(lo, max(lo, hi))

    # Finishing ------------------------------------------------------------------------
    def check_token_finish(self) -> None:
        """After appending a sampled token: EOS, stop ids, grammar end, length, context."""
        if self.finished or not self.output_ids:
            return
        tok = self.output_ids[-1]
        n_out = len(self.output_ids)
        sp = self.sampling
        if tok in sp.stop_token_ids:
            self.finish_reason = {"type": "stop", "matched": tok}
        elif not sp.ignore_eos and tok in self.eos_ids:
            self.finish_reason = {"type": "stop", "matched": tok}
        elif self.grammar is not None and self.grammar.is_terminated():
            self.finish_reason = {"type": "stop", "matched": None}
        elif n_out >= self.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.max_new_tokens}
        elif len(self.prompt_ids) + n_out >= self.context_length:
            self.finish_reason = {"type": "length", "length": n_out}

    def update_text(self) -> None:
        """Detokenise the new tokens, finish on a stop string, set the visible text.

        Only the text after the previous visible text is searched: everything before it was
        shown because no stop string begins there, and the held-back tail is what may still
        begin one. So a step costs the held-back tail plus the new text, whatever the length
        of the output (the earliest match wins, then the smallest stop string)."""
        shown = min(len(self.text), len(self.detok.text))
        old_len = len(self.detok.text)
        self.detok.step(self.output_ids)
        if self.sampling.stop and not self.finished:
            text = self.detok.text
            hit = self.sampling.stop_strings().find(text, max(shown, old_len - self.max_stop_len + 1))
            if hit is not None:
                i, s = hit
                self.finish_reason = {"type": "stop", "matched": s}
                self.text = text[: i + len(s)] if self.sampling.no_stop_trim else text[:i]
                return
        if self.finished:
            if self.finish_reason.get("type") == "stop" and isinstance(self.finish_reason.get("matched"), str):
                return  # text already trimmed at the stop string
            self.text = self.detok.finish(self.output_ids)
            return
        self.text = self._hold_back_stop_prefix(self.detok.text, len(self.detok.text) - shown)

    def _hold_back_stop_prefix(self, text: str, at_most: int) -> str:
        """``text`` without a tail that may turn out to begin a stop string. That tail is at
        most ``at_most`` long: the previous held-back tail plus the new text (a tail that
        begins a stop string extends one that did)."""
        if not self.sampling.stop:
            return text
        k = self.sampling.stop_strings().held_back(text, at_most)
        return text[:-k] if k else text

    def abort(self, message: str) -> None:
        if not self.finished:
            self.finish_reason = {"type": "abort", "message": message}


@dataclasses.dataclass
class ScheduledChunk:
    """One request's part of a step: ``fill_ids[start:start+num_tokens]``.

    logits: "last" (next-token row), "all" (every row; prompt logprobs) or "none".
    sample: whether to sample a token after this chunk.
    pages, state_slot: snapshots taken at scheduling time (an abort during the step may
    free the request's own lists; the pages are only reallocated at the next schedule).
    dp_rank: the DP rank the chunk runs on; ``pages`` and ``state_slot`` are its local ids.
    drafts: a verify chunk's k drafts (None otherwise): it computes the last token and the
    drafts (``num_tokens`` = k+1) and appends 1 + the accepted drafts; ``accept_drafts``
    False (the drafter proposed nothing for it) keeps only the last token.
    """

    req: Req
    start: int
    num_tokens: int
    sample: bool
    logits: str
    pages: list[int] = dataclasses.field(default_factory=list)
    state_slot: int = 0
    dp_rank: int = 0
    drafts: list[int] | None = None
    accept_drafts: bool = False

    @property
    def is_verify(self) -> bool:
        return self.drafts is not None

    @property
    def input_in_flight(self) -> bool:
        """A decode whose input token is the one the previous (still running) step samples
        for this request: its id is on the device (``ModelRunner.last_tokens``), not here."""
        return self.start >= len(self.req.prompt_ids) + len(self.req.output_ids)


@dataclasses.dataclass(frozen=True)
class SnapshotLoad:
    """Before the step: copy GDN snapshot ``snapshot`` into state slot ``slot`` (rank-local ids)."""

    rank: int
    snapshot: int
    slot: int


@dataclasses.dataclass(frozen=True)
class SnapshotSave:
    """After the step: copy state slot ``slot`` into snapshot ``snapshot``; it then holds the GDN
    state of ``req.prompt_ids[:num_tokens]`` (rank-local ids)."""

    req: Req
    rank: int
    slot: int
    snapshot: int
    num_tokens: int


@dataclasses.dataclass
class ScheduledBatch:
    """One step: the chunks, and the GDN snapshot copies to do before / after the forward.

    ``num_steps`` N > 1 (``--num-scheduler-steps``, DECODE only): the step runs N decode steps
    in one device program (``model_executor/multistep.py``); each chunk then samples N tokens
    (``ChunkResult.run``) and computes the KV of positions ``start .. start + N - 1``.
    """

    chunks: list[ScheduledChunk]
    kind: ForwardMode
    state_loads: list[SnapshotLoad] = dataclasses.field(default_factory=list)
    state_saves: list[SnapshotSave] = dataclasses.field(default_factory=list)
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclasses.dataclass
class ChunkResult:
    """What the runner hands back for one chunk."""

    next_token: int | None = None
    logprob: float | None = None  # of the sampled token
    top_logprobs: list[tuple[float, int]] | None = None
    input_logprobs: list[float] | None = None  # one per row of req.input_logprob_rows(...)
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    # A verify chunk: the accepted drafts then the next token, each (token, logprob, top
    # logprobs), in order; ``num_accepted`` drafts of them.
    run: list[tuple[int, float, list[tuple[float, int]] | None]] | None = None
    num_accepted: int = 0
    # NEXTN: the k drafts the MTP layers propose after this chunk's sampled token(s).
    drafts: list[int] | None = None
    # ``return_routed_experts``: routed expert ids i32[n, M, K] of the request's positions
    # routed_start .. (``model_executor/routed_experts.py``).
    routed_experts: Any = None
    routed_start: int = 0
