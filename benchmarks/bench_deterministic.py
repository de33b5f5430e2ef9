"""Cost of ``--enable-deterministic-inference``: the same traffic with and without the flag.

Two engines of the embedded tiny model (bf16, same limits, no loop thread: the benchmark
steps them itself), then for each traffic shape ``--rounds`` rounds, each running the
traffic once on each engine, the order alternating (this machine is shared and noisy). A
round of one engine: ``n`` requests with ``--prompt-len``-token prompts and
``--max-new-tokens`` outputs (greedy, ignore_eos) queued at once, stepped to the end; the
wall time of each step is added to prefill (steps holding prompt chunks: EXTEND or MIXED)
or decode (DECODE steps). Reported per engine (median over rounds, or with ``--best`` the best
round): prefill tokens/s, decode time per output token (decode tokens computed inside MIXED
steps count as prefill), whole-traffic tokens/s; and the ratios deterministic / default
(> 1 = slower for times, < 1 = slower for throughputs).

Where the cost comes from: deterministic mode pads every step to one of two fixed shapes
(DECODE at ``--max-running-requests`` rows, prefill at ``max_tokens_per_step`` rows), so a
small batch pays for a full one, and decodes wait while prompt chunks run.

    JAX_PLATFORMS=cpu python benchmarks/bench_deterministic.py [--best] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.server_args import ServerArgs


def run_traffic(engine: Engine, n: int, prompt_len: int, max_new: int) -> dict[str, float]:
    """Queue ``n`` requests, step to the end; seconds and tokens of prefill and decode steps."""
    for i in range(n):
        ids = [3 + (7 * i + 13 * j) % 997 for j in range(prompt_len)]
        req = engine.requests.build(GenerateReqInput(input_ids=ids, sampling_params={
            "max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}))
        engine.scheduler.add_request(req)
    t = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_tokens": 0, "decode_tokens": 0}
    while not engine.scheduler.is_idle():
        t0 = time.perf_counter()
        batch = engine.step()
        dt = time.perf_counter() - t0
        if batch is None:
            continue
        if batch.kind == ForwardMode.DECODE:
            t["decode_s"] += dt
            t["decode_tokens"] += len(batch.chunks)
        else:
            t["prefill_s"] += dt
            t["prefill_tokens"] += sum(c.num_tokens for c in batch.chunks)
    return t


def summary(rounds: list[dict[str, float]], best: bool) -> dict[str, float]:
    """Per-engine figures over rounds: the median, or with ``best`` the best round of each
    (least disturbed by other load on a shared machine)."""
    pick = (lambda xs, hi: max(xs) if hi else min(xs)) if best else (
        lambda xs, hi: statistics.median(xs))
    return {
        "prefill_tok_s": pick([r["prefill_tokens"] / max(r["prefill_s"], 1e-9)
                               for r in rounds], True),
        "decode_ms_per_tok": pick([1e3 * r["decode_s"] / max(r["decode_tokens"], 1)
                                   for r in rounds], False),
        "total_tok_s": pick([(r["prefill_tokens"] + r["decode_tokens"])
                             / (r["prefill_s"] + r["decode_s"]) for r in rounds], True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--chunked-prefill-size", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--best", action="store_true",
                    help="report each engine's best round instead of the median")
    a = ap.parse_args()
    base = dict(max_running_requests=a.max_running_requests,
                chunked_prefill_size=a.chunked_prefill_size, context_length=512, page_size=16,
                dtype="bfloat16", skip_warmup=True, disable_radix_cache=True,
                disable_overlap_schedule=True)
    engines = {"default": Engine(ServerArgs(**base), start_loop=False),
               "deterministic": Engine(ServerArgs(**base, enable_deterministic_inference=True),
                                       start_loop=False)}
    print(f"tiny model bf16, prompt {a.prompt_len} tokens, {a.max_new_tokens} outputs each, "
          f"max_running_requests {a.max_running_requests}, chunked_prefill_size "
          f"{a.chunked_prefill_size}, {'best' if a.best else 'median'} of {a.rounds} "
          f"alternating rounds (prefix cache off in both)")
    for n in a.batches:
        for eng in engines.values():  # compile this traffic's shapes, untimed
            run_traffic(eng, n, a.prompt_len, a.max_new_tokens)
        rounds: dict[str, list] = {k: [] for k in engines}
        for r in range(a.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                rounds[name].append(run_traffic(engines[name], n, a.prompt_len, a.max_new_tokens))
        s = {k: summary(v, a.best) for k, v in rounds.items()}
        d, x = s["default"], s["deterministic"]
        print(f"batch {n:3d}: prefill tok/s default {d['prefill_tok_s']:8.0f} det "
              f"{x['prefill_tok_s']:8.0f} "
              f"(det/default {x['prefill_tok_s'] / d['prefill_tok_s']:.2f})"
              f" | decode ms/token default {d['decode_ms_per_tok']:7.2f} det "
              f"{x['decode_ms_per_tok']:7.2f} (det/default "
              f"{x['decode_ms_per_tok'] / d['decode_ms_per_tok']:.2f})"
              f" | total tok/s det/default {x['total_tok_s'] / d['total_tok_s']:.2f}", flush=True)
    for eng in engines.values():
        eng.shutdown()


if __name__ == "__main__":
    main()
