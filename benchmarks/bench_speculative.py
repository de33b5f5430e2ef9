"""Output tokens/s with and without speculative decoding (``--speculative-algorithm NGRAM``
and NEXTN), side by side on the same traffic, plus the ceiling of greedy verification on this
machine.

Two tiny float32 checkpoints of the embedded model's architecture:
  tiny     the embedded default (random weights). Its greedy continuation never repeats
           earlier text, not even its own earlier output: its next token depends on the
           whole context, so n-gram drafts are never right on it (the non-repetitive case).
  looping  the same architecture with its token embeddings scaled by ``--loop-scale`` (1000):
           the residual stream is then dominated by the current token, so the greedy
           continuation falls into a loop and repeats a passage it has seen, as small
           language models' greedy continuations do (the repetitive case).
Workloads (``--requests`` prompts queued at once, ``--max-new-tokens`` outputs each, greedy,
ignore_eos):
  repetitive  looping model, prompts X + G(X) + X: a random X, then G(X) the plain engine's
              own greedy continuation of X, then X again (a prompt quoting a passage the
              model goes on to repeat);
  loop        looping model, random prompts: NGRAM drafts once the continuation has gone
              round its loop once;
  random      tiny model, random prompts: nothing to draft.
Setups, each in alternating order over ``--rounds`` rounds (the machine is shared and noisy):
  plain   no speculation;
  ngram   NGRAM drafts from each request's own prompt + output (adaptive: a decode step
          verifies only when enough of its requests have drafts; a request whose drafts keep
          being rejected backs off);
  replay  the NGRAM engine drafting the plain engine's own continuation (a test draft
          source: every draft right, so every verify step keeps k+1 tokens): the ceiling of
          any drafter on this machine;
  nextn   NEXTN drafts from the MTP layer (tiny model only: its MTP weights are random, so
          its drafts are rarely right; the cost of running it).
Output tokens/s = output tokens / wall time of the round (prefill steps included), median
over rounds, with its ratio to plain, the mean accept length (output tokens per verify step)
and the fraction of decode steps that ran as verify steps. Every setup's outputs must equal
the plain engine's (asserted).

    JAX_PLATFORMS=cpu python benchmarks/bench_speculative.py [--rounds 3] [--requests 4,16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.model_loader.tiny_model import write_looping_model
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.speculative.drafter import CallbackDrafter

def run(engine: Engine, prompts: list[list[int]], max_new: int) -> dict:
    """Queue every prompt, step to the end: wall seconds, output tokens, accept length, the
    fraction of decode steps that ran as verify steps."""
    reqs = []
    for i, ids in enumerate(prompts):
        req = engine.requests.build(GenerateReqInput(rid=f"p{i}", input_ids=ids, sampling_params={
            "max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}))
        engine.scheduler.add_request(req)
        reqs.append(req)
    kinds = engine.scheduler.num_steps_by_kind
    before = (kinds[ForwardMode.TARGET_VERIFY], kinds[ForwardMode.DECODE])
    t0 = time.perf_counter()
    while not engine.scheduler.is_idle():
        engine.step()
    dt = time.perf_counter() - t0
    verify_ct = sum(r.spec_verify_ct for r in reqs)
    verify = kinds[ForwardMode.TARGET_VERIFY] - before[0]
    decode = kinds[ForwardMode.DECODE] - before[1]
    return {"s": dt, "tokens": sum(len(r.output_ids) for r in reqs),
            "accept": sum(r.spec_verify_tokens for r in reqs) / verify_ct if verify_ct else 0.0,
            "verify_frac": verify / max(verify + decode, 1),
            "outputs": {r.rid: list(r.output_ids) for r in reqs}}


def replay(outputs: dict[str, list[int]]) -> CallbackDrafter:
    """Drafts: each request's continuation from ``outputs`` (the plain engine's)."""
    def drafts(req, k):
        o = len(req.output_ids)
        return outputs[req.rid][o:o + k]
    return CallbackDrafter(drafts)


def random_prompts(rng: random.Random, n: int, vocab: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def compare(setups: dict, prompts: list[list[int]], max_new: int, rounds: int) -> dict:
    """Run every setup ``rounds`` times in alternating order; per setup the median tok/s,
    mean accept length and verify-step fraction. ``setups``: name -> (engine, drafter or
    None); the first is the reference whose outputs every other must equal."""
    names = list(setups)
    first = setups[names[0]][0]
    reference = run(first, prompts, max_new)["outputs"]  # also compiles, untimed
    results: dict[str, list[dict]] = {k: [] for k in names}
    for r in range(rounds + 1):
        for key in (names if r % 2 == 0 else names[::-1]):
            eng, drafter = setups[key]
            if drafter is not None:
                eng.scheduler.drafter = drafter
            out = run(eng, prompts, max_new)
            assert out["outputs"] == reference, f"{key}: outputs differ from plain decoding"
            if r:  # round 0 compiles the setups' buckets
                results[key].append(out)
    return {k: (statistics.median(x["tokens"] / x["s"] for x in v),
                statistics.mean(x["accept"] for x in v),
                statistics.mean(x["verify_frac"] for x in v)) for k, v in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="4,16", help="concurrencies, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop-scale", type=float, default=1000.0)
    a = ap.parse_args()
    concurrencies = [int(x) for x in a.requests.split(",")]
    base = dict(max_running_requests=max(concurrencies), chunked_prefill_size=256,
                context_length=512, page_size=16, dtype="float32", skip_warmup=True,
                disable_radix_cache=True, disable_overlap_schedule=True)
    spec = dict(speculative_num_draft_tokens=a.num_draft_tokens)
    looping_dir = str(write_looping_model(tempfile.mkdtemp(prefix="looping-"), a.loop_scale))
    engines = {
        "tiny": Engine(ServerArgs(**base), start_loop=False),
        "tiny+ngram": Engine(ServerArgs(**base, speculative_algorithm="NGRAM", **spec),
                             start_loop=False),
        "tiny+nextn": Engine(ServerArgs(**base, speculative_algorithm="NEXTN", **spec),
                             start_loop=False),
        "looping": Engine(ServerArgs(**base, model_path=looping_dir), start_loop=False),
        "looping+ngram": Engine(ServerArgs(**base, model_path=looping_dir,
                                           speculative_algorithm="NGRAM", **spec),
                                start_loop=False),
    }
    ngram = {k: engines[k].scheduler.drafter for k in ("tiny+ngram", "looping+ngram")}
    vocab = engines["tiny"].model_config.vocab_size
    print(f"float32, {a.max_new_tokens} outputs per request, k+1 = {a.num_draft_tokens}, "
          f"median of {a.rounds} alternating rounds (output tokens/s)")
    for R in concurrencies:
        rng = random.Random(R)
        xs = random_prompts(rng, R, vocab, 20, 20)
        g = run(engines["looping"], xs, a.max_new_tokens)["outputs"]
        work = {"repetitive": ("looping", [x + g[f"p{i}"] + x for i, x in enumerate(xs)]),
                "loop": ("looping", random_prompts(rng, R, vocab, 20, 60)),
                "random": ("tiny", random_prompts(rng, R, vocab, 20, 60))}
        for name, (model, prompts) in work.items():
            reference = run(engines[model], prompts, a.max_new_tokens)["outputs"]
            setups = {"plain": (engines[model], None),
                      "ngram": (engines[model + "+ngram"], ngram[model + "+ngram"]),
                      "replay": (engines[model + "+ngram"], replay(reference))}
            if model == "tiny":
                setups["nextn"] = (engines["tiny+nextn"], engines["tiny+nextn"].scheduler.drafter)
            res = compare(setups, prompts, a.max_new_tokens, a.rounds)
            plain = res["plain"][0]
            print(f"R={R:<3d} {name:10s} ({model}): plain {plain:7.1f} | " + " | ".join(
                f"{k} {tps:7.1f} (x{tps / plain:.2f}, accept length {acc:.2f}, verify steps "
                f"{frac:.0%})" for k, (tps, acc, frac) in res.items() if k != "plain"),
                flush=True)
    for eng in engines.values():
        eng.shutdown()


if __name__ == "__main__":
    main()
