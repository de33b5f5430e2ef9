"""Online serving benchmark, in the manner of ``sglang.bench_serving`` / ``vllm bench serve``.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --backend native \
        --random-input-len 8192 --random-output-len 1024 --random-range-ratio 1.0 --ignore-eos \
        --num-prompts 256 --max-concurrency 64,128,256 --num-chips 4 --output-dir bench_out

Random token-id prompts (lengths uniform in [len * ratio, len]), streamed so every output
chunk is timed: TTFT (request sent -> first token), ITL (between output chunks, per token),
E2E. For each concurrency tier (``--max-concurrency``, comma-separated; requests arrive at
``--request-rate`` per second, Poisson, ``inf`` = all at once) it prints and saves total
(input + output) and output tokens/s (also per chip with ``--num-chips``) and p50/p90/p99 of
TTFT, ITL and E2E in ``<output-dir>/bench_serving.json``, and draws
``throughput_vs_concurrency.png`` and ``latency_cdf.png``. A few warm-up requests run first.
``--backend openai`` uses ``/v1/completions`` (prompt as token ids) instead of ``/generate``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itls: list[float] = field(default_factory=list)  # seconds, one per token after the first
    e2e: float = 0.0
    ok: bool = False
    error: str = ""


def random_requests(n: int, input_len: int, output_len: int, ratio: float, vocab: int,
                    seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_new_tokens) pairs; lengths uniform in [len * ratio, len]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(max(1, int(input_len * ratio)), input_len)
        o = rng.randint(max(1, int(output_len * ratio)), output_len)
        out.append(([rng.randrange(10, vocab) for _ in range(p)], o))
    return out


def _payload(backend: str, model: str, ids: list[int], max_new: int, ignore_eos: bool) -> tuple[str, dict]:
    if backend == "native":
        return "/generate", {"input_ids": ids, "stream": True, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": ignore_eos}}
    return "/v1/completions", {"model": model, "prompt": ids, "max_tokens": max_new, "temperature": 0.0,
                               "stream": True, "ignore_eos": ignore_eos,
                               "stream_options": {"include_usage": True}}


def _tokens_so_far(backend: str, chunk: dict, count: int) -> int:
    """Output tokens after this SSE chunk (native: cumulative output_ids; OpenAI: usage or +1)."""
    if backend == "native":
        return len(chunk.get("output_ids") or []) or chunk.get("meta_info", {}).get("completion_tokens", count)
    usage = chunk.get("usage")
    if usage:
        return usage["completion_tokens"]
    return count + (1 if chunk.get("choices") and chunk["choices"][0].get("text") else 0)


async def send(session: aiohttp.ClientSession, base: str, backend: str, model: str,
               ids: list[int], max_new: int, ignore_eos: bool) -> RequestResult:
    res = RequestResult(prompt_len=len(ids))
    path, body = _payload(backend, model, ids, max_new, ignore_eos)
    t0 = last = time.perf_counter()
    try:
        async with session.post(base + path, json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                n = _tokens_so_far(backend, chunk, res.output_len)
                if n > res.output_len:
                    if res.output_len == 0:
                        res.ttft = now - t0
                        new = n - 1  # tokens beyond the first in the same chunk share its time
                    else:
                        new = n - res.output_len
                    res.itls.extend([(now - last) / max(new, 1)] * new)
                    res.output_len, last = n, now
        res.e2e = time.perf_counter() - t0
        res.ok = res.output_len > 0
    except aiohttp.ClientError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_tier(base, backend, model, reqs, concurrency, rate, ignore_eos, seed, progress=True):
    """All ``reqs`` with at most ``concurrency`` in flight, arriving at ``rate`` per second."""
    sem = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(seed)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        bar = tqdm(total=len(reqs), desc=f"concurrency {concurrency}", disable=not progress)

        async def one(ids, n):
            async with sem:
                r = await send(s, base, backend, model, ids, n, ignore_eos)
            bar.update(1)
            return r

        tasks = []
        t0 = time.perf_counter()
        for ids, n in reqs:
            tasks.append(asyncio.create_task(one(ids, n)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration


def _pcts(values: list[float]) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    a = np.asarray(values)
    return {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES} | {"mean": float(a.mean())}


def summarise(results: list[RequestResult], duration: float, concurrency: int, num_chips: int | None) -> dict:
    ok = [r for r in results if r.ok]
    inp = sum(r.prompt_len for r in ok)
    out = sum(r.output_len for r in ok)
    s = {
        "max_concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(ok) / duration, "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
        "ttft_s": _pcts([r.ttft for r in ok]), "itl_s": _pcts([x for r in ok for x in r.itls]),
        "e2e_s": _pcts([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    if num_chips:
        s["num_chips"] = num_chips
        s["output_throughput_per_chip"] = s["output_throughput"] / num_chips
        s["total_token_throughput_per_chip"] = s["total_token_throughput"] / num_chips
    return s


def print_tier(s: dict) -> None:
    print(f"{'=' * 20} concurrency {s['max_concurrency']} {'=' * 20}")
    print(f"completed / failed:           {s['completed']} / {s['failed']}  in {s['duration_s']:.2f} s")
    print(f"total tokens/s:               {s['total_token_throughput']:.1f}")
    print(f"output tokens/s:              {s['output_throughput']:.1f}")
    if "num_chips" in s:
        print(f"total / output tokens/s/chip: {s['total_token_throughput_per_chip']:.1f} / "
              f"{s['output_throughput_per_chip']:.1f}  ({s['num_chips']} chips)")
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        v = s[key]
        if v["p50"] is not None:
            print(f"{name:5s} ms p50 / p90 / p99:     {v['p50'] * 1e3:.1f} / {v['p90'] * 1e3:.1f} / {v['p99'] * 1e3:.1f}")


def plot(tiers: list[dict], raw: dict[int, list[RequestResult]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    c = [t["max_concurrency"] for t in tiers]
    fig, ax = plt.subplots(figsize=(6, 4))
    per_chip = "total_token_throughput_per_chip" in tiers[0]
    suffix = "_per_chip" if per_chip else ""
    ax.plot(c, [t["total_token_throughput" + suffix] for t in tiers], "o-", label="total (in + out)")
    ax.plot(c, [t["output_throughput" + suffix] for t in tiers], "s-", label="output")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("tokens/s" + (" per chip" if per_chip else ""))
    ax.set_title("Throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "throughput_vs_concurrency.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (name, get) in zip(axes, (("TTFT", lambda r: [r.ttft]), ("ITL", lambda r: r.itls),
                                      ("E2E", lambda r: [r.e2e]))):
        for conc, results in raw.items():
            v = np.sort([x * 1e3 for r in results if r.ok for x in get(r)])
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=f"c={conc}")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{name} CDF")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


async def amain(a: argparse.Namespace) -> dict:
    base = a.base_url.rstrip("/")
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/get_model_info") as r:
            info = await r.json()
    model = a.model or info.get("served_model_name") or info.get("model_path")
    vocab = a.vocab_size or info.get("vocab_size") or 1000
    tiers_c = [int(x) for x in str(a.max_concurrency).split(",")]
    rate = float(a.request_rate)
    if a.warmup_requests:
        warm = random_requests(a.warmup_requests, min(a.random_input_len, 16), 4, 1.0, vocab, a.seed + 1)
        await run_tier(base, a.backend, model, warm, a.warmup_requests, float("inf"), True, a.seed,
                       progress=False)
    tiers, raw = [], {}
    for i, conc in enumerate(tiers_c):
        reqs = random_requests(a.num_prompts, a.random_input_len, a.random_output_len,
                               a.random_range_ratio, vocab, a.seed + i)
        results, duration = await run_tier(base, a.backend, model, reqs, conc, rate, a.ignore_eos,
                                           a.seed + i, progress=not a.disable_tqdm)
        s = summarise(results, duration, conc, a.num_chips)
        print_tier(s)
        tiers.append(s)
        raw[conc] = results
    out = {"backend": a.backend, "base_url": base, "model": model,
           "random_input_len": a.random_input_len, "random_output_len": a.random_output_len,
           "random_range_ratio": a.random_range_ratio, "ignore_eos": a.ignore_eos,
           "num_prompts": a.num_prompts, "request_rate": a.request_rate, "tiers": tiers}
    out_dir = Path(a.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_serving.json").write_text(json.dumps(out, indent=2))
    if tiers and not a.no_plots:
        out["plots"] = [str(p) for p in plot(tiers, raw, out_dir)]
    print(f"saved {out_dir / 'bench_serving.json'}" + (f" and {len(out.get('plots', []))} plots"))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=("native", "openai"), default="native")
    p.add_argument("--model", default=None, help="model name for --backend openai (default: the server's)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths are uniform in [len * ratio, len]")
    p.add_argument("--vocab-size", type=int, default=None, help="token ids drawn below this (default: the server's)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-concurrency", default="64", help="comma-separated tiers, e.g. 1,4,16")
    p.add_argument("--request-rate", default="inf", help="requests/s (Poisson arrivals); inf = all at once")
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--num-chips", type=int, default=None, help="report tokens/s per chip as well")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-dir", default="bench_serving_out")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    return asyncio.run(amain(parse_args(argv)))


if __name__ == "__main__":
    main()
