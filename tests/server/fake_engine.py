"""TEST DOUBLE: an ``EngineAPI`` (``entrypoints/engine_protocol.py``) with no model.

Used only by route-level unit tests (tests/server/test_routes_fake.py). It tokenizes with
the embedded tiny tokenizer, validates through the real ``SamplingParams``, "generates"
seeded pseudo-random token ids one per ``step_delay`` seconds, and books pages/slots so
abort-on-disconnect can be checked. Constrained decoding (regex / json_schema) is ignored.
Profiling, weight updates and health are recorded (``calls``) instead of done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from pathlib import Path
from typing import AsyncIterator

from sglang_tpu_backend.managers.io_struct import GenerateReqInput, InvalidRequestError
from sglang_tpu_backend.sampling.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.tokenizer import load_tokenizer

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "sglang_tpu_backend" / "assets" / "tiny-qwen3.5-moe"


@dataclasses.dataclass(frozen=True)
class FakeModelConfig:
    vocab_size: int
    max_position_embeddings: int


class FakeEngine:
    def __init__(self, args: ServerArgs | None = None, step_delay: float = 0.0, context_length: int = 256):
        args = args or ServerArgs(context_length=context_length)
        self.args = dataclasses.replace(args, page_size=args.kv_page_size("cpu"))
        self.tokenizer = load_tokenizer(TOKENIZER_DIR)
        self.context_length = self.args.context_length or context_length
        self.model_config = FakeModelConfig(len(self.tokenizer), self.context_length)
        self.step_delay = step_delay
        self.pages_total, self.slots_total = 64, 8
        self.held: dict[str, int] = {}  # rid -> pages held
        self.aborted: set[str] = set()
        self.requests_seen: list[GenerateReqInput] = []
        self.calls: list[tuple] = []  # (method, args) of the admin calls, in order
        self.health_delay = 0.0  # seconds health_generate takes
        self.health_running = self.health_max_running = 0  # concurrent health_generate calls

    # Validation ---------------------------------------------------------------------------
    def _prompt_ids(self, req: GenerateReqInput) -> list[int]:
        if (req.text is None) == (req.input_ids is None):
            raise InvalidRequestError("text", "exactly one of text and input_ids")
        ids = self.tokenizer.encode(req.text) if req.text is not None else list(req.input_ids)
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError("input_ids", f"input_ids has token {bad[0]} outside the vocabulary")
        if not ids:
            raise InvalidRequestError("text", "empty prompt")
        if len(ids) >= self.context_length:
            raise InvalidRequestError("input_ids", f"prompt of {len(ids)} tokens exceeds the context length")
        return ids

    # Engine API ---------------------------------------------------------------------------
    async def generate_request(self, req: GenerateReqInput) -> AsyncIterator[dict]:
        sp = SamplingParams.from_dict(req.sampling_params)
        sp.validate(self.model_config.vocab_size)
        ids = self._prompt_ids(req)
        room = self.context_length - len(ids)
        max_new = DEFAULT_MAX_NEW_TOKENS if sp.max_new_tokens is None else sp.max_new_tokens
        if sp.max_new_tokens is not None and max_new > room:
            raise InvalidRequestError("sampling_params.max_new_tokens", "max_new_tokens exceeds the context")
        max_new = min(max_new, room)
        self.requests_seen.append(req)
        rid = req.rid
        self.held[rid] = math.ceil((len(ids) + max_new) / self.args.page_size)
        rng = random.Random(sp.seed if sp.seed is not None else hash(tuple(ids)))
        out_ids: list[int] = []
        try:
            while True:
                text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                reason = None
                if rid in self.aborted:
                    reason = {"type": "abort", "message": "aborted"}
                elif len(out_ids) >= max_new:
                    reason = {"type": "length", "length": max_new}
                else:
                    for s in sp.stop:
                        if s in text and len(out_ids) >= sp.min_new_tokens:
                            text = text[: text.index(s)]
                            reason = {"type": "stop", "matched": s}
                            break
                if reason is not None or req.stream:
                    yield self._output(req, ids, out_ids, text, reason, sp)
                if reason is not None:
                    return
                await asyncio.sleep(self.step_delay)
                out_ids.append(rng.randrange(3, self.model_config.vocab_size))
        finally:
            self.held.pop(rid, None)
            self.aborted.discard(rid)

    def _output(self, req, ids, out_ids, text, reason, sp) -> dict:
        meta = {"id": req.rid, "prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                "cached_tokens": 0}
        if reason is not None:
            meta["finish_reason"] = reason
        if req.return_logprob:
            def entry(t: int) -> list:
                return [-1.0 - (t % 7) / 10, t, self.tokenizer.decode([t]) if req.return_text_in_logprobs else None]

            start = max(len(ids) - 1, 0) if req.logprob_start_len < 0 else req.logprob_start_len
            inp = [entry(t) for t in ids[start:]]
            if start == 0 and inp:
                inp[0][0] = None
            k = req.top_logprobs_num
            meta["input_token_logprobs"] = inp
            meta["output_token_logprobs"] = [entry(t) for t in out_ids]
            meta["input_top_logprobs"] = [None if e[0] is None else [entry(t) for t in range(3, 3 + k)]
                                          for e in inp]
            meta["output_top_logprobs"] = [[entry(t) for t in range(3, 3 + k)] for _ in out_ids]
        return {"text": text, "output_ids": list(out_ids), "meta_info": meta}

    def abort_request(self, rid: str) -> bool:
        if rid in self.held:
            self.aborted.add(rid)
            return True
        return False

    def flush_cache(self) -> bool:
        self.calls.append(("flush_cache",))
        return True

    def get_model_info(self) -> dict:
        return {"model_path": str(TOKENIZER_DIR), "tokenizer_path": str(TOKENIZER_DIR), "is_generation": True}

    def get_server_info(self) -> dict:
        return {**self.args.to_dict(), "version": "fake"}

    async def health_generate(self) -> bool:
        self.health_running += 1
        self.health_max_running = max(self.health_max_running, self.health_running)
        try:
            await asyncio.sleep(self.health_delay)
        finally:
            self.health_running -= 1
        self.calls.append(("health_generate",))
        return True

    def health_error(self) -> str | None:
        return None

    def get_load(self) -> list[dict]:
        return [{"dp_rank": 0, "num_reqs": len(self.held), "num_waiting_reqs": 0,
                 "num_tokens": sum(self.held.values()) * self.args.page_size}]

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        self.calls.append(("start_profile", output_dir, num_steps))
        return output_dir or ""

    def stop_profile(self) -> str:
        self.calls.append(("stop_profile",))
        return ""

    def start_expert_distribution_record(self) -> None:
        self.calls.append(("start_expert_distribution_record",))

    def stop_expert_distribution_record(self) -> None:
        self.calls.append(("stop_expert_distribution_record",))

    def dump_expert_distribution_record(self, output_dir: str) -> str:
        self.calls.append(("dump_expert_distribution_record", output_dir))
        return output_dir + "/expert_distribution_0.json"

    def update_weights_from_disk(self, model_path: str, **kwargs) -> dict:
        self.calls.append(("update_weights_from_disk", model_path))
        return {"success": True, "message": "updated (fake)", "num_paused_requests": 0}

    def metrics_text(self) -> bytes:
        return b"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0\n"

    def pool_stats(self) -> dict:
        used = sum(self.held.values())
        return {"kv_pages_used": used, "kv_pages_total": self.pages_total,
                "state_slots_used": len(self.held), "state_slots_total": self.slots_total,
                "num_running": len(self.held), "num_queued": 0, "num_retracted_total": 0}

    def shutdown(self) -> None:
        pass
