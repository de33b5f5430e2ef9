"""Speculative decoding with tensor-parallel attention (run as a script).

Run by tests/engine/test_speculative.py in a subprocess with 4 simulated CPU devices (fixed
before jax starts); the one-device engines the outputs are compared with live in the test
process. Input (JSON): ``seed`` and ``n`` of the test's ``workload``, the plain engine's
output ids of each request, and the --tp-size of each engine. A warmed-up NGRAM engine
(k = 3) serves the workload with drafts replaying the plain engine's continuation (a wrong
one at a varying position, so most tokens come from accepted drafts). A warmed-up NEXTN
engine serves it with its MTP drafts, then with the replayed drafts, recording the MTP drafts
every request holds at each proposal. Writes JSON: each run's outputs, the programs lowered
while serving (after warm-up), the recorded (rid, sequence, MTP drafts) and the engines' step
backends.
"""

from __future__ import annotations

import json
import sys

import jax

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.speculative.drafter import CallbackDrafter
from tests.engine.test_speculative import (ENGINE_ARGS, K, RecordingDrafter, fresh, replay_drafts,
                                           run_all, workload)

# Small pools and buckets: warm-up compiles every bucket of both engines.
ARGS = {**ENGINE_ARGS, "max_running_requests": 8, "skip_warmup": False,
        "speculative_num_draft_tokens": K + 1}


def wrong_at(req, o: int) -> int:
    """The first wrong replayed draft moves through 0..K (K: all right) from step to step."""
    return (o + len(req.prompt_ids)) % (K + 2)


def serve_with(engine, drafter, objs) -> list[dict]:
    sched = engine.scheduler
    with engine.loop.lock:
        own, sched.drafter = sched.drafter, drafter
    try:
        return run_all(engine, objs)
    finally:
        with engine.loop.lock:
            sched.drafter = own


def main(in_path: str, out_path: str) -> None:
    spec = json.loads(open(in_path).read())
    assert len(jax.devices()) == max(spec["ngram_tp"], spec["nextn_tp"]), jax.devices()
    objs = workload(spec["seed"], n=spec["n"])
    reference = {f"{tag}{o.rid}": ids for tag in ("r", "m")
                 for o, ids in zip(objs, spec["want"])}
    replay = replay_drafts(reference, wrong_at)
    out = {}

    engine = Engine(ServerArgs(speculative_algorithm="NGRAM", tp_size=spec["ngram_tp"], **ARGS))
    out["backend"] = type(engine.runner.backend).__name__
    counter = CompileCounter()
    out["replay"] = serve_with(engine, CallbackDrafter(replay), fresh(objs, "r"))
    out["ngram_lowerings"] = counter.lowerings
    engine.shutdown()

    engine = Engine(ServerArgs(speculative_algorithm="NEXTN", tp_size=spec["nextn_tp"], **ARGS))
    out["nextn_backend"] = type(engine.runner.backend).__name__
    counter = CompileCounter()
    out["nextn"] = run_all(engine, fresh(objs, "x"))
    recorder = RecordingDrafter(replay)
    out["nextn_replay"] = serve_with(engine, recorder, fresh(objs, "m"))
    out["nextn_lowerings"] = counter.lowerings
    out["nextn_drafts"] = recorder.seen
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
