"""Routed experts per token (``--enable-return-routed-experts``, SGLang's RL routing replay).

With the flag every forward step also returns its rows' routed LOGICAL expert ids
i32[D*T, M, K] (M MoE layers, K = num_experts_per_tok; ``qwen3_5_moe.ROUTED``), fetched with
the step's other outputs. As in SGLang (``RoutedExpertsCapturer``: a host buffer indexed by KV
cache location), the ids are stored on the host per KV location: rank r's token at position p
of a request lives at ``pages[p // page_size] * page_size + p % page_size`` of rank r's pool.
A prefix-cache hit reuses the pages and so the ids recorded when that prefix was computed; a
page that is freed and reused is overwritten by its next forward.

A request's ids are its positions 0 .. seqlen - 2 (every prompt token, then every output token
but the last sampled one: the tokens the model forwarded for it), SGLang's ``seqlen - 1``
rows, sent as ``meta_info["routed_experts"]``: base64 of the int32 array [seqlen - 1, M, K]
in C order (:func:`encode`). Under prefill / decode disaggregation the prefill engine hands the
prompt's rows i32[P, M, K] over with the request (``RequestHandover.routed_experts``); the
decode engine starts the request with them, writes them into its store at the installed pages
(:meth:`RoutedExpertsStore.install`) and appends the output tokens' rows.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from sglang_tpu_backend.metrics.router_stats import ROUTED


def num_moe_layers(cfg: Any) -> int:
    """M: the MoE layers of the model (every layer for Qwen3.5-MoE)."""
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def encode(rows: np.ndarray) -> str:
    """SGLang's ``meta_info["routed_experts"]``: base64 of the raw int32 bytes (C order)."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype=np.int32).tobytes()).decode("ascii")


def decode(text: str, num_layers: int, top_k: int) -> np.ndarray:
    """The inverse of :func:`encode`: i32[tokens, num_layers, top_k]."""
    return np.frombuffer(base64.b64decode(text), np.int32).reshape(-1, num_layers, top_k)


class RoutedExpertsStore:
    """Host buffer i32[ranks, num_pages * page_size, M, K] of routed ids per KV location."""

    def __init__(self, cfg: Any, num_ranks: int, num_pages: int, page_size: int):
        self.page_size = page_size
        self.num_layers, self.top_k = num_moe_layers(cfg), cfg.num_experts_per_tok
        self.buffer = np.zeros((num_ranks, num_pages * page_size, self.num_layers, self.top_k),
                               np.int32)

    def _locs(self, pages: list[int], start: int, n: int) -> np.ndarray:
        """KV locations i64[n] of positions start .. start + n - 1 of a request's ``pages``."""
        pos = np.arange(start, start + n)
        return np.asarray(pages, np.int64)[pos // self.page_size] * self.page_size + pos % self.page_size

    def record(self, routed: np.ndarray, chunks: list, token_rows: list[int]) -> None:
        """Store a step's ids: ``routed`` i32[D*T, M, K]; chunk i's rows start at
        ``token_rows[i]`` (its rank's block plus its offset there). Verify chunks are skipped
        (speculative decoding is refused with the flag)."""
        for c, row in zip(chunks, token_rows):
            if c.is_verify or not c.num_tokens:
                continue
            self.buffer[c.dp_rank, self._locs(c.pages, c.start, c.num_tokens)] = (
                routed[row:row + c.num_tokens])

    def install(self, rows: np.ndarray, pages: list[int], rank: int = 0) -> None:
        """Decode side of a PD handover: store the prompt's ids ``rows`` i32[P, M, K] (from
        the prefill engine) at positions 0 .. P - 1 of ``pages`` on DP rank ``rank``, as if
        this engine had computed them: the store then agrees with the request's rows (a chunk
        starting at the request's ``cached_tokens`` reads its ids from position 0)."""
        self.buffer[rank, self._locs(pages, 0, len(rows))] = rows

    def chunk_rows(self, c: Any) -> tuple[int, np.ndarray]:
        """What a chunk adds to its request's ids: (first position, i32[n, M, K]). A
        request's first chunk since admission (it starts at ``cached_tokens``) also reads the
        cached prefix's ids, so it starts at 0 (after a retraction too: they replace)."""
        first = 0 if c.start == c.req.cached_tokens else c.start
        end = c.start + c.num_tokens
        return first, self.buffer[c.dp_rank, self._locs(c.pages, first, end - first)]


def routed_store(router_stats: Any, num_drafts: int, *sizes) -> RoutedExpertsStore | None:
    """The runner's store when ``router_stats`` is ``qwen3_5_moe.ROUTED`` (else None);
    ``sizes``: :class:`RoutedExpertsStore`'s (cfg, num_ranks, num_pages, page_size)."""
    if router_stats != ROUTED:
        return None
    if num_drafts:
        raise ValueError("--enable-return-routed-experts is not supported with speculative "
                         "decoding")
    return RoutedExpertsStore(*sizes)


def append_rows(req: Any, first: int, rows: np.ndarray) -> None:
    """Add a chunk's ids (from position ``first``) to ``req.routed_rows`` (a list of arrays);
    rows it already has from ``first`` on are replaced (a retracted request's re-prefill)."""
    have = sum(len(r) for r in req.routed_rows)
    if first < have:
        kept = np.concatenate(req.routed_rows)[:first] if first else None
        req.routed_rows = [kept] if kept is not None else []
    elif first > have:  # a gap: no ids for some positions (should not happen)
        raise RuntimeError(f"routed experts of {req.rid}: rows from {first}, have {have}")
    req.routed_rows.append(rows)


def request_rows(req: Any) -> np.ndarray | None:
    """``req``'s ids of positions 0 .. seqlen - 2 (i32[seqlen - 1, M, K]), or None."""
    if not req.routed_rows:
        return None
    n = len(req.prompt_ids) + len(req.output_ids) - 1
    return np.concatenate(req.routed_rows)[:n]
