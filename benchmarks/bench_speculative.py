"""Output tokens/s with and without speculative decoding (``--speculative-algorithm NGRAM``
and NEXTN), side by side on the same traffic, plus the ceiling of greedy verification on this
machine.

Three engines of the embedded tiny model (float32, same limits, no loop thread: the
benchmark steps them itself): plain, NGRAM and NEXTN with ``--num-draft-tokens`` (k+1). Each
workload runs ``--rounds`` rounds, each on four setups in alternating order (the machine is
shared and noisy):
  plain   the engine without speculation;
  ngram   NGRAM drafts from each request's own prompt + output (adaptive: a decode step runs
          as a verify step only when enough of its requests have drafts, and a request
          whose drafts keep being rejected backs off);
  nextn   NEXTN drafts from the checkpoint's MTP layer, run on the device after every step
          (the tiny model's MTP weights are random: its drafts are rarely right);
  replay  the speculative engine drafting the plain engine's own greedy continuation of each
          request (a test draft source: every draft is right, so every verify step keeps k+1
          tokens): what verification gains when drafts are good, the ceiling of any drafter.
A round queues ``--requests`` greedy requests (``--max-new-tokens`` outputs, ignore_eos) at
once and steps to the end; output tokens/s = output tokens / wall time of the round
(prefill steps included). Reported: the median over rounds of each, its ratio to plain, the
mean accept length (output tokens per verify step) and the fraction of decode steps that
ran as verify steps, of ngram and replay.

Workloads: "repetitive" prompts quote a passage of the bundled corpus twice (the second copy
cut short, as when a model is asked to repeat a text), "random" prompts are random token ids,
"self-quote" prompts are X + G(X) + X with G(X) the plain engine's own greedy continuation
of a random X: NGRAM then drafts G(X) after the second X, right exactly when the model
continues as it did the first time. NGRAM can only draft what the sequence already contains:
a trained model continuing a quoted passage repeats it; the tiny random model does not, not
even its own earlier output (its continuation depends on the whole context), so on it no
workload makes NGRAM drafts right and "replay" stands in for the workload NGRAM wins.

    JAX_PLATFORMS=cpu python benchmarks/bench_speculative.py [--rounds 3] [--requests 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.managers.io_struct import GenerateReqInput
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.speculative.drafter import CallbackDrafter

CORPUS = Path(__file__).resolve().parents[1] / "sglang_tpu_backend" / "assets" / "corpus.txt"


def workloads(engine: Engine, n: int, max_new: int, seed: int = 0
              ) -> dict[str, list[list[int]]]:
    """``n`` prompts of each workload (token ids); ``engine``: the plain one."""
    rng = random.Random(seed)
    lines = [s for s in CORPUS.read_text().splitlines() if len(s) > 80]
    quoting = []
    for _ in range(n):
        passage = engine.tokenizer.encode(rng.choice(lines))
        quoting.append(passage + passage[: rng.randint(4, len(passage) // 2)])
    vocab = engine.model_config.vocab_size
    randoms = [[rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))] for _ in range(n)]
    xs = [[rng.randrange(3, vocab) for _ in range(20)] for _ in range(n)]
    g = run(engine, xs, max_new)["outputs"]
    self_quote = [x + g[f"p{i}"] + x for i, x in enumerate(xs)]
    return {"repetitive": quoting, "random": randoms, "self-quote": self_quote}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-running-requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    base = dict(max_running_requests=a.max_running_requests, chunked_prefill_size=256,
                context_length=256, page_size=16, dtype="float32", skip_warmup=True,
                disable_radix_cache=True, disable_overlap_schedule=True)
    plain = Engine(ServerArgs(**base), start_loop=False)
    spec = Engine(ServerArgs(**base, speculative_algorithm="NGRAM",
                             speculative_num_draft_tokens=a.num_draft_tokens), start_loop=False)
    ngram = spec.scheduler.drafter
    nextn = Engine(ServerArgs(**base, speculative_algorithm="NEXTN",
                              speculative_num_draft_tokens=a.num_draft_tokens), start_loop=False)
    print(f"tiny model float32, {a.requests} requests x {a.max_new_tokens} outputs, "
          f"max_running_requests {a.max_running_requests}, k+1 = {a.num_draft_tokens}, "
          f"median of {a.rounds} alternating rounds (output tokens/s)")
    for name, prompts in workloads(plain, a.requests, a.max_new_tokens).items():
        reference = run(plain, prompts, a.max_new_tokens)["outputs"]  # also compiles, untimed
        setups = {"plain": (plain, None), "ngram": (spec, ngram),
                  "replay": (spec, replay(reference)), "nextn": (nextn, nextn.scheduler.drafter)}
        for eng, drafter in setups.values():
            if drafter is not None:
                eng.scheduler.drafter = drafter
                run(eng, prompts, a.max_new_tokens)  # compile, untimed
        rounds: dict[str, list[dict]] = {k: [] for k in setups}
        for r in range(a.rounds):
            for key in (list(setups) if r % 2 == 0 else list(reversed(setups))):
                eng, drafter = setups[key]
                if drafter is not None:
                    eng.scheduler.drafter = drafter
                out = run(eng, prompts, a.max_new_tokens)
                assert out["outputs"] == reference, f"{key}: outputs differ from plain decoding"
                rounds[key].append(out)
        tps = {k: statistics.median(x["tokens"] / x["s"] for x in v) for k, v in rounds.items()}
        acc = {k: statistics.mean(x["accept"] for x in v) for k, v in rounds.items()}
        frac = {k: statistics.mean(x["verify_frac"] for x in v) for k, v in rounds.items()}
        print(f"{name:10s}: plain {tps['plain']:7.1f} | " + " | ".join(
            f"{k} {tps[k]:7.1f} (x{tps[k] / tps['plain']:.2f}, accept length {acc[k]:.2f}, "
            f"verify steps {frac[k]:.0%})" for k in ("ngram", "replay", "nextn")), flush=True)
    plain.shutdown()
    spec.shutdown()
    nextn.shutdown()


if __name__ == "__main__":
    main()
