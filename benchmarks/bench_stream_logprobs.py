"""Host time of building one streaming request's output per step, as the output grows.

A request with ``top_logprobs_num=5`` and ``return_text_in_logprobs`` grows one token per
step (synthetic token ids, logprobs and top-5 alternatives appended as the scheduler does);
each step runs what the engine does under its lock for a streamed delivery:
``req.update_text()`` and ``OutputBuilder.snapshot(req)`` (new logprob entries built, the cumulative
lists only measured: an ``OutputSnapshot``). Reports the median per-step time around 100,
1,000 and 2,000 output tokens, and the 2,000 / 100 ratio, for the engine's path, for the
consumer's ``OutputSnapshot.materialize()`` (the list copies, on the event loop, off the
lock; O(tokens) like the JSON it feeds), and for the first full rebuild (``legacy_output``
below), all in the same run.

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/bench_stream_logprobs.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.server_args import ServerArgs

MARKS = (100, 1000, 2000)


def legacy_output(eng: Engine, req) -> dict:
    """The previous ``OutputBuilder.snapshot``: every entry (and its text) rebuilt at each delivery."""
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": dict(req.finish_reason) if req.finish_reason else None,
        "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
    }
    s = req.logprob_start_len
    in_toks = req.prompt_ids[s:]
    in_vals = [None] + req.input_logprobs[: len(in_toks) - 1]
    meta["input_token_logprobs"] = [[lp, t, eng.outputs._token_text(req, t)] for lp, t in zip(in_vals, in_toks)]
    meta["output_token_logprobs"] = [
        [lp, t, eng.outputs._token_text(req, t)] for lp, t in zip(req.output_logprobs, req.output_ids)]
    meta["input_top_logprobs"] = [None] + [
        eng.outputs._top_entries(req, tops) for tops in req.input_top_logprobs[: len(in_toks) - 1]]
    meta["output_top_logprobs"] = [eng.outputs._top_entries(req, tops) for tops in req.output_top_logprobs]
    return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}


def per_step_times(eng: Engine, build, num_tokens: int, window: int, seed: int,
                   consumer: bool = False) -> dict[int, float]:
    """Median seconds of ``update_text`` + ``build(req)`` over ``window`` steps ending at each
    mark; with ``consumer`` the seconds of ``build(req).materialize()`` alone."""
    rng = random.Random(seed)
    V = min(eng.model_config.vocab_size, 10000)
    obj = GenerateReqInput(input_ids=[rng.randrange(3, V) for _ in range(32)], return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=5, return_text_in_logprobs=True,
                           stream=True, sampling_params={"max_new_tokens": num_tokens + 1})
    req = eng.requests.build(obj)
    req.return_text_in_logprobs = True
    req.input_logprobs = [-rng.random() for _ in range(len(req.prompt_ids) - 1)]
    req.input_top_logprobs = [[(-rng.random(), rng.randrange(3, V)) for _ in range(5)]
                              for _ in req.input_logprobs]
    times: list[float] = []
    for _ in range(num_tokens):
        req.output_ids.append(rng.randrange(3, V))
        req.output_logprobs.append(-rng.random())
        req.output_top_logprobs.append([(-rng.random(), rng.randrange(3, V)) for _ in range(5)])
        t0 = time.perf_counter()
        req.update_text()
        out = build(req)
        if consumer:
            t0 = time.perf_counter()
            out.materialize()
        times.append(time.perf_counter() - t0)
    return {m: statistics.median(times[m - window:m]) for m in MARKS if m <= num_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--window", type=int, default=100, help="steps per median")
    args = ap.parse_args()
    eng = Engine(ServerArgs(model_path=args.model_path, max_running_requests=4, context_length=4096,
                            max_total_tokens=8192, dtype="float32", skip_warmup=True), start_loop=False)
    n = max(MARKS)
    rows = {"under the lock (OutputBuilder.snapshot)": per_step_times(eng, eng.outputs.snapshot, n, args.window, 0),
            "consumer (materialize)": per_step_times(eng, eng.outputs.snapshot, n, args.window, 0,
                                                     consumer=True),
            "full rebuild (first version)": per_step_times(eng, lambda r: legacy_output(eng, r), n,
                                                           args.window, 0)}
    print(f"per-step host time of update_text + output building, top_logprobs_num=5, "
          f"return_text_in_logprobs (median of {args.window} steps)")
    print(f"{'path':32s}" + "".join(f"{m:>11d} tok" for m in MARKS) + f"{'2000/100':>11s}")
    for name, t in rows.items():
        print(f"{name:32s}" + "".join(f"{t[m] * 1e3:>11.3f} ms" for m in MARKS) + f"{t[2000] / t[100]:>11.2f}")
    eng.shutdown()


if __name__ == "__main__":
    main()
