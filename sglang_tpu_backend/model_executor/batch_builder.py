"""Build a ForwardBatch (numpy on the host) from per-request chunks of new tokens.

Used by the offline generator, the model tests and the ModelRunner: one place that knows
the layout rules of ``ForwardBatch`` (requests back to back, padding at the tail).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """One request's part of a step.

    token_ids:   the new tokens of this step (a prefill chunk, or one decode token).
    context_len: tokens of this request already in the KV cache / GDN state.
    pages:       page ids covering at least ``context_len + len(token_ids)`` tokens.
    state_slot:  the request's GDN state slot.
    logits:      "last" (next-token logits), "all" (every new row, for prompt logprobs) or "none".
    """

    token_ids: Sequence[int]
    context_len: int
    pages: Sequence[int]
    state_slot: int
    logits: str = "last"


def build_forward_batch(
    chunks: Sequence[SeqChunk],
    *,
    page_size: int,
    mode: ForwardMode | None = None,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    pages_per_seq: int | None = None,
    num_logits: int | None = None,
) -> tuple[ForwardBatch, list[np.ndarray]]:
    """Lay the chunks out back to back and pad to the given (bucketed) sizes.

    Returns the batch and, per chunk, the indices into the logits rows that belong to it.
    Padding logits rows point at token 0 and are to be ignored.
    """
    q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
    total = int(q_lens.sum())
    R = len(chunks) if num_seqs is None else num_seqs
    T = total if num_tokens is None else num_tokens
    need_pages = max(
        (-(-(c.context_len + len(c.token_ids)) // page_size) for c in chunks), default=1
    )
    P = max(need_pages, 1) if pages_per_seq is None else pages_per_seq
    if R < len(chunks) or T < total or P < need_pages:
        raise ValueError(f"bucket too small: R={R} T={T} P={P} for {len(chunks)} seqs, "
                         f"{total} tokens, {need_pages} pages")
    if mode is None:
        decode = len(chunks) > 0 and all(q == 1 and c.context_len > 0 for q, c in zip(q_lens, chunks))
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND

    if mode == ForwardMode.TARGET_VERIFY and (T % R or any(q != T // R for q in q_lens)):
        raise ValueError(f"TARGET_VERIFY needs T = R * n and n tokens per request: T={T} "
                         f"R={R}, q lens {q_lens.tolist()}")

    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    cu_q_lens = np.full(R + 1, total, np.int32)
    kv_lens = np.zeros(R, np.int32)
    page_table = np.zeros((R, P), np.int32)
    state_slots = np.zeros(R, np.int32)
    logits_rows: list[int] = []
    per_chunk_rows: list[np.ndarray] = []
    start = 0
    for r, c in enumerate(chunks):
        q = len(c.token_ids)
        cu_q_lens[r] = start
        input_ids[start : start + q] = c.token_ids
        positions[start : start + q] = np.arange(c.context_len, c.context_len + q)
        kv_lens[r] = c.context_len + q
        n_pages = -(-(c.context_len + q) // page_size)
        page_table[r, :n_pages] = np.asarray(c.pages[:n_pages], np.int32)
        state_slots[r] = c.state_slot
        if c.logits == "last":
            rows = [start + q - 1]
        elif c.logits == "all":
            rows = list(range(start, start + q))
        else:
            rows = []
        per_chunk_rows.append(np.arange(len(logits_rows), len(logits_rows) + len(rows)))
        logits_rows.extend(rows)
        start += q
    cu_q_lens[len(chunks)] = total
    L = len(logits_rows) if num_logits is None else num_logits
    if L < len(logits_rows):
        raise ValueError(f"bucket too small: {len(logits_rows)} logits rows > {L}")
    logits_indices = np.zeros(max(L, 1), np.int32)
    logits_indices[: len(logits_rows)] = logits_rows
    batch = ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        page_table=page_table,
        state_slots=state_slots,
        num_seqs=np.array([len(chunks)], np.int32),
        logits_indices=logits_indices,
        mode=mode,
    )
    return batch, per_chunk_rows


def num_logits_rows(chunks: list) -> int:
    """Logits rows the ``ScheduledChunk``s need."""
    return sum({"all": c.num_tokens, "last": 1, "none": 0}[c.logits] for c in chunks)


def in_flight_rows(from_slots: list[np.ndarray | None]) -> np.ndarray | None:
    """The step's ``from_slot`` from each rank's: in-flight inputs exist on one rank only."""
    if len(from_slots) == 1:
        return from_slots[0]
    if any(f is not None for f in from_slots):
        raise ValueError("in-flight decode inputs need one device (no DP / TP)")
    return None
