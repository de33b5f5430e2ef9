"""Handover transport bandwidth: a request's KV pages + GDN states through the disaggregated
app's transports (``ray_app/handover.py``: object_store and device) against a raw
``ray.put`` / ``ray.get`` of the same number of bytes, between the same two actors of one
local Ray cluster, side by side.

    python benchmarks/bench_handover.py [--tokens 500 4000] [--trials 7] [--config 397b|tiny]

A "prefill" actor builds the request's arrays in the handover layout
(``model_executor/state_transfer.py``) for the config's shapes (default: Qwen3.5-397B, page 256,
bf16 KV and GDN state, what one request of that many tokens holds), sends them through the
transport and hands the ticket on; a "decode" actor receives them (the arrays readable in its
process). The raw figure is one ``ray.put`` of a byte array of the same size (in memory, like
the handover's arrays) in the first actor and a ``ray.get`` in the second. Times run from before the send to after the receive; medians
over the trials, the kinds taking turns (rotated each round). Prints bytes per request, each
bandwidth and each transport's ratio to raw (the target is >= 0.8). The device transport
pulls into the decode actor's (CPU) device and reads the arrays back to numpy, as the engine
receives them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import ray

from ray_app.handover import TRANSPORTS, make_transport, release
from sglang_tpu_backend.config import model_config_from_dict
from sglang_tpu_backend.managers.handover import RequestHandover
from sglang_tpu_backend.managers.io_struct import GenerateReqInput

ASSETS = Path(__file__).resolve().parents[1] / "sglang_tpu_backend" / "assets"
CONFIGS = {"397b": (ASSETS / "configs" / "qwen3.5-397b-a17b.json", 256),
           "tiny": (ASSETS / "tiny-qwen3.5-moe" / "config.json", 16)}


def handover_arrays(cfg_path: Path, page_size: int, tokens: int) -> dict[str, np.ndarray]:
    """kv [La, n, 2G, page, D], conv [Lg, K-1, C], rec [Lg, Hv, Dk, Dv] in bf16 for a request of
    ``tokens`` tokens (random bytes: nothing compresses them)."""
    cfg = model_config_from_dict(json.loads(cfg_path.read_text()))
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def arr(*shape):
        return rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(bf16)

    n = -(-tokens // page_size)
    return {"kv": arr(len(cfg.attention_layers), n, 2 * cfg.num_key_value_heads, page_size,
                      cfg.head_dim),
            "conv": arr(len(cfg.linear_layers), cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim),
            "rec": arr(len(cfg.linear_layers), cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim)}


@ray.remote
class Prefill:
    def __init__(self, arrays: dict[str, np.ndarray], page_size: int, transports: list[str]):
        self.transports = {name: make_transport(name) for name in transports}
        self.h = RequestHandover(
            request=GenerateReqInput(input_ids=[1], rid="bench"), prompt_ids=[1], output_ids=[2],
            seed=0, num_computed=1, page_size=page_size, weight_version="bench", **arrays)
        # The same bytes as one flat array, already in memory (as the handover's are).
        self.raw = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays.values()])

    def send(self, transport: str) -> tuple[float, dict]:
        t0 = time.time()
        return t0, self.transports[transport].send(self.h)

    def put_raw(self) -> tuple[float, list]:
        t0 = time.time()
        return t0, [ray.put(self.raw)]  # nested: not resolved on the way


@ray.remote
class Decode:
    def __init__(self, transports: list[str]):
        self.transports = {name: make_transport(name) for name in transports}

    async def receive(self, ticket: dict) -> tuple[float, int]:
        h = await self.transports[ticket["transport"]].receive(ticket)
        return time.time(), h.nbytes

    async def get_raw(self, refs: list) -> tuple[float, int]:
        data = await refs[0]
        return time.time(), data.nbytes


def measure(prefill, decode, trials: int, transports: list[str]) -> dict[str, list[float]]:
    """Seconds per trial, send to received, for each transport and the raw put/get."""
    kinds = ("raw", *transports)
    out = {k: [] for k in kinds}
    for i in range(trials + 1):  # the first round warms every path up
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            if kind == "raw":
                t0, sent = ray.get(prefill.put_raw.remote())
                t1, _ = ray.get(decode.get_raw.remote(sent))
            else:
                t0, sent = ray.get(prefill.send.remote(kind))
                t1, _ = ray.get(decode.receive.remote(sent))
                release(sent)  # as the ingress does once the decode replica has the state
            del sent  # the object leaves the store before the next trial
            if i:
                out[kind].append(t1 - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[500, 4000])
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="397b")
    ap.add_argument("--transports", nargs="+", choices=sorted(TRANSPORTS), default=list(TRANSPORTS),
                    help="which transports to measure beside the raw put/get (the device one "
                         "starts a transfer server in both actors, whose threads share the cores)")
    args = ap.parse_args()
    cfg_path, page_size = CONFIGS[args.config]
    env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}  # the device transport's
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=4 * 1024**3, runtime_env={"env_vars": env})
    try:
        print(f"config {args.config}, page {page_size}, bf16 KV + GDN state, {args.trials} trials")
        print(f"{'tokens':>7} {'MiB/request':>12} {'raw GB/s':>9} "
              + " ".join(f"{k + ' GB/s':>17} {'ratio':>6}" for k in args.transports))
        for tokens in args.tokens:
            arrays = handover_arrays(cfg_path, page_size, tokens)
            nbytes = sum(a.nbytes for a in arrays.values())
            prefill = Prefill.remote(arrays, page_size, args.transports)
            decode = Decode.remote(args.transports)
            times = measure(prefill, decode, args.trials, args.transports)
            bw = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            print(f"{tokens:>7} {nbytes / 2**20:>12.1f} {bw['raw']:>9.2f} "
                  + " ".join(f"{bw[k]:>17.2f} {bw[k] / bw['raw']:>6.2f}" for k in args.transports))
            for a in (prefill, decode):
                ray.kill(a)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
