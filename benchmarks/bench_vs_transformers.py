"""Serving throughput against transformers' own ``generate`` on the same model and prompts.

A random fp32 Qwen3.5-MoE checkpoint is made with transformers (``--config tiny``: the
embedded default's shapes; ``--config mid``: hidden 1024, 16 layers, 64 experts top-8) and
saved; both sides then run 64 random-token prompts of 64 tokens with 32 greedy output
tokens each (EOS ignored): transformers in static batches of 32, this engine with 32
concurrent clients (the engine's own loop, in process; no HTTP). Both are timed warm (one
untimed round each first), in turns (``--rounds`` of each, alternating, so the shared
machine's drift hits both alike); the median rounds' output tokens/s and their ratio are
printed.

Beside it: the workload's roofline ceiling on this machine (``roofline.ceiling`` with the
matmul peak and memory bandwidth measured in this run, fp32; a batch's prefill as one step,
then its decode steps, each max(FLOPs / peak, bytes / bandwidth)), and each side's share of it.
No implementation can pass the ceiling, so ``ceiling / transformers`` bounds the ratio any
engine can reach against transformers here.

    JAX_PLATFORMS=cpu python benchmarks/bench_vs_transformers.py --config tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "sglang_tpu_backend" / "assets" / "tiny-qwen3.5-moe"
LAYERS = lambda n: ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]  # noqa: E731
CONFIGS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, num_experts=16, num_experts_per_tok=4,
                 moe_intermediate_size=64, shared_expert_intermediate_size=128),
    "mid": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
                head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                linear_value_head_dim=64, num_experts=64, num_experts_per_tok=8,
                moe_intermediate_size=256, shared_expert_intermediate_size=1024),
}


def make_checkpoint(name: str, path: Path, vocab_size: int) -> None:
    """Random fp32 transformers model (every weight drawn, routers decisive) saved at ``path``."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    c = CONFIGS[name]
    cfg = Qwen3_5MoeTextConfig(
        **c, vocab_size=vocab_size, layer_types=LAYERS(c["num_hidden_layers"]),
        max_position_embeddings=4096, rms_norm_eps=1e-6, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.rand(p.shape) * math.log(16.0))
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape) * 0.1)
            else:
                p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    model.save_pretrained(path, safe_serialization=True)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def transformers_runner(path: Path, ps: list[list[int]], out_len: int, batch: int):
    """A function that runs every prompt through ``generate`` in static batches; returns seconds."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()

    def round_() -> float:
        t0 = time.perf_counter()
        for i in range(0, len(ps), batch):
            ids = torch.tensor(ps[i:i + batch])
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                               min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    return round_


def engine_runner(path: Path, ps: list[list[int]], out_len: int, clients: int, dp_size: int = 1):
    """(a function that runs every prompt through the engine with ``clients`` concurrent
    clients and returns seconds, the engine)."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput
    from sglang_tpu_backend.server_args import ServerArgs

    eng = Engine(ServerArgs(model_path=str(path), tokenizer_path=str(ASSETS), dtype="float32",
                            max_running_requests=clients, context_length=256, chunked_prefill_size=256,
                            disable_radix_cache=True, dp_size=dp_size, ep_size=dp_size))

    async def all_prompts():
        sem = asyncio.Semaphore(clients)

        async def one(ids):
            async with sem:
                obj = GenerateReqInput(input_ids=ids, sampling_params={
                    "max_new_tokens": out_len, "temperature": 0, "ignore_eos": True})
                return [o async for o in eng.generate_request(obj)][-1]

        outs = await asyncio.gather(*(one(p) for p in ps))
        assert all(len(o["output_ids"]) == out_len for o in outs)

    def round_() -> float:
        t0 = time.perf_counter()
        asyncio.run(all_prompts())
        return time.perf_counter() - t0

    return round_, eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of each, taken in turns")
    ap.add_argument("--dp-size", type=int, default=1,
                    help="engine data-parallel ranks (experts split over them), one CPU device each")
    args = ap.parse_args()
    if args.dp_size > 1:  # before jax starts: one host CPU device per rank, each on its own thread
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.dp_size}")
    vocab = json.loads((ASSETS / "config.json").read_text())["text_config"]["vocab_size"]
    tokens = args.num_prompts * args.output_len
    with tempfile.TemporaryDirectory(prefix="stb-bench-") as tmp:
        path = Path(tmp)
        make_checkpoint(args.config, path, vocab)
        ps = prompts(args.num_prompts, args.input_len, vocab)
        hf_round = transformers_runner(path, ps, args.output_len, args.concurrency)
        our_round, eng = engine_runner(path, ps, args.output_len, args.concurrency, args.dp_size)
        hf_round(), our_round()  # warm: one untimed round each
        hf_s, our_s = [], []
        for _ in range(args.rounds):  # in turns, so the machine's drift hits both alike
            hf_s.append(hf_round())
            our_s.append(our_round())
        eng.shutdown()
    hf, ours = tokens / statistics.median(hf_s), tokens / statistics.median(our_s)
    print(f"config={args.config} prompts={args.num_prompts} in={args.input_len} out={args.output_len} "
          f"clients/batch={args.concurrency} fp32 greedy engine dp={args.dp_size} rounds={args.rounds}")
    print(f"transformers generate: {hf:8.1f} output tok/s (median round)")
    print(f"this engine:           {ours:8.1f} output tok/s (median round)")
    print(f"engine / transformers: {ours / hf:.2f}x  (per round: "
          f"{' '.join(f'{h / o:.2f}' for h, o in zip(hf_s, our_s))})")
    cap = workload_ceiling(args.config, args.input_len, args.output_len, args.concurrency)
    print(f"roofline ceiling:      {cap:8.1f} output tok/s (transformers at {hf / cap:.1%}, "
          f"this engine at {ours / cap:.1%}; no engine can pass {cap / hf:.2f}x transformers here)")


def make_config(name: str):
    """The model config of ``CONFIGS[name]`` (what this benchmark and ``bench_cpu_roofline.py``
    run), on the tiny model's vocabulary."""
    from sglang_tpu_backend.config import model_config_from_dict
    from sglang_tpu_backend.model_loader.tiny_model import tiny_config_dict

    d = tiny_config_dict(vocab_size=1216, eos_token_id=2)
    d["text_config"].update(CONFIGS[name], layer_types=LAYERS(CONFIGS[name]["num_hidden_layers"]))
    return model_config_from_dict(d)


def workload_ceiling(config: str, input_len: int, output_len: int, batch: int) -> float:
    """Output tok/s ceiling of the benchmark's workload on this machine (fp32, measured peaks)."""
    from sglang_tpu_backend.planning import roofline

    hw = roofline.measure_cpu()
    c = roofline.ceiling(make_config(config), hw, input_len=input_len, output_len=output_len,
                         concurrency=batch, num_chips=1, dtype="f32", expert_dtype="f32",
                         kv_dtype="f32", state_dtype="f32", prefill_tokens_per_device=batch * input_len)
    return c.output_tokens_per_s_per_chip


if __name__ == "__main__":
    main()
