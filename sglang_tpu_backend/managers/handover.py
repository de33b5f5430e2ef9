"""What a prefill engine hands to a decode engine: one request after its first token.

Plain numpy + metadata (picklable; no JAX): the request as it arrived, what the prefill
produced (first token(s), logprobs, the resolved seed), the weight version it ran with, and
the cache state computed for the prompt (``model_executor/state_transfer.py`` layouts):
  kv:   [La, n, 2*G, page_size, D]  KV pages of every attention layer, n = pages_for(P)
  conv: [Lg, rows, C]               conv state of every GDN layer after the P prompt tokens
  rec:  [Lg, Hv, Dk, Dv]            recurrent state of every GDN layer after them
  mtp_kv: [Lm, n, 2*G, page_size, D] (NEXTN prefill replicas only, else None) the MTP KV
        pages at the same page ids, with ``drafts``: the k drafts its MTP chain proposed
        after the first token, which the decode replica verifies in its first step
  routed_experts: i32[P, M, K] (requests with ``return_routed_experts`` only, else None) the
        LOGICAL expert ids the router picked for each prompt token in each of the M MoE layers
        (``model_executor/routed_experts.py``); the decode side appends its own rows
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sglang_tpu_backend.managers.io_struct import GenerateReqInput


@dataclasses.dataclass
class RequestHandover:
    request: GenerateReqInput  # as the client sent it (rid resolved)
    prompt_ids: list[int]
    output_ids: list[int]  # sampled by the prefill engine (the first token)
    seed: int  # resolved sampling seed (sampling is keyed on seed + output position)
    num_computed: int  # tokens whose KV / GDN state is in the arrays (= len(prompt_ids))
    page_size: int
    kv: np.ndarray
    conv: np.ndarray
    rec: np.ndarray
    weight_version: str  # the prefill engine's weights; the decode engine must serve the same
    input_logprobs: list[float] = dataclasses.field(default_factory=list)
    input_top_logprobs: list[Any] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[Any] = dataclasses.field(default_factory=list)
    export_time: float = 0.0  # time.time() when the prefill engine started the export (s)
    cached_tokens: int = 0  # prompt tokens the prefill engine reused from its prefix cache
    mtp_kv: np.ndarray | None = None  # NEXTN: the MTP KV pages (module docstring)
    drafts: list[int] | None = None  # NEXTN: the first verify step's drafts
    routed_experts: np.ndarray | None = None  # i32[P, M, K] of the prompt (module docstring)

    @property
    def nbytes(self) -> int:
        """Bytes of cache state handed over (KV pages + both GDN states + MTP KV pages)."""
        mtp = 0 if self.mtp_kv is None else self.mtp_kv.nbytes
        return int(self.kv.nbytes + self.conv.nbytes + self.rec.nbytes + mtp)
