"""Tensor-parallel attention generation on CPU devices vs each request alone on one device
(run as a script by tests/parallel/test_tp.py with 4 simulated CPU devices).

Two widths over the tiny model (4 q heads, 2 kv heads, 2 GDN key heads, 4 GDN value heads,
16 experts): TP=2 splits every head kind; TP=4 gives each device one q and one GDN value head
and replicates the kv and GDN key heads (each device holds the one its heads read). Requests
of several pages and GDN chunks are prefilled together, decoded together, and one arrives
mid-way (MIXED steps). Writes an .npz of greedy tokens and logits of both runs.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.model_loader.tiny_model import default_model_path
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.parallel.tp_forward import TPForward
from tests.parallel.dp_ep_run import PAGE, PAGES_PER_SEQ, alone

PROMPT_LENS = [37, 9, 22, 3, 41, 17]
LATE_LEN, LATE_STEP, STEPS = 19, 2, 6
R = 8  # request rows per step


class Request:
    def __init__(self, slot, prompt):
        self.slot, self.prompt = slot, prompt
        self.pages = list(range(slot * PAGES_PER_SEQ, (slot + 1) * PAGES_PER_SEQ))
        self.tokens, self.logits, self.context = [], [], 0

    def chunk(self):
        ids = self.prompt if self.context == 0 else [self.tokens[-1]]
        return SeqChunk(ids, self.context, self.pages, self.slot)


def generate(tp: TPForward, params, cfg):
    rng = np.random.default_rng(1)
    requests = [Request(i, rng.integers(3, cfg.vocab_size, n).tolist())
                for i, n in enumerate(PROMPT_LENS)]
    late = Request(len(requests), rng.integers(3, cfg.vocab_size, LATE_LEN).tolist())
    cache = tp.init_cache(num_pages=R * PAGES_PER_SEQ, page_size=PAGE, num_state_slots=R,
                          kv_dtype=jnp.float32, state_dtype=jnp.float32)
    sharded, active, modes = tp.shard_params(params), list(requests), []
    for step in range(STEPS + 1):
        if step == LATE_STEP:
            active.append(late)
        live = [r for r in active if len(r.logits) <= STEPS - (LATE_STEP if r is late else 0)]
        decode = all(r.context > 0 for r in live)
        n = sum(len(r.chunk().token_ids) for r in live)
        T = R if decode else 1 << (max(n, 8) - 1).bit_length()
        mode = ForwardMode.DECODE if decode else ForwardMode.MIXED
        fb, rows = build_forward_batch([r.chunk() for r in live], page_size=PAGE, mode=mode,
                                       num_tokens=T, num_seqs=R, pages_per_seq=PAGES_PER_SEQ,
                                       num_logits=R)
        logits, cache = tp(sharded, cache, tp.put_batch(fb))
        logits = np.asarray(logits)
        modes.append(int(mode))
        for r, rw in zip(live, rows):
            r.context += len(r.chunk().token_ids)
            r.logits.append(logits[rw[-1]])
            r.tokens.append(int(np.argmax(r.logits[-1])))
    return active, modes


def main(out_path: str) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    cfg, params = load_model(default_model_path(), dtype=jnp.float32)
    results = {}
    refs: dict[int, tuple] = {}
    for width in (2, 4):
        tp = TPForward(cfg, make_mesh(width), impl="reference")
        done, modes = generate(tp, params, cfg)
        results[f"tp{width}_modes"] = np.asarray(modes)
        results[f"tp{width}_local_kv_heads"] = np.asarray(tp.local_cfg.num_key_value_heads)
        for i, r in enumerate(done):
            steps = len(r.logits) - 1
            if i not in refs:
                refs[i] = alone(params, cfg, r.prompt, steps)
            results[f"tp{width}_tokens_{i}"] = np.asarray(r.tokens[:steps])
            results[f"tp{width}_logits_{i}"] = np.stack(r.logits)
    for i, (tokens, logits) in refs.items():
        results[f"ref_tokens_{i}"] = np.asarray(tokens)
        results[f"ref_logits_{i}"] = logits
    results["num_requests"] = np.asarray(len(refs))
    np.savez(out_path, **results)


if __name__ == "__main__":
    main(sys.argv[1])
