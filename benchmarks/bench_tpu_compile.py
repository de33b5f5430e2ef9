"""Compile time of the model step for TPU7x against depth (no TPU needed: libtpu compile-only).

Compiles the decode step of Qwen3.5-397B as one TensorCore of a DP8/EP8 host sees it (64 of
512 experts in FP8, bf16 attention and GDN weights, page 256, 8K contexts, 64 running
requests) at several depths, and prints compile seconds, memory_analysis() and the ratio to
the shallowest. Needs the ``tpu`` extra (libtpu):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_tpu_compile.py --layers 8 60
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from sglang_tpu_backend.config import model_config_from_dict
from sglang_tpu_backend.kernels.tpu_compile import core_mesh
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.step_compile import StepSpec, compile_step

CONFIG_397B = (Path(__file__).resolve().parents[1] / "sglang_tpu_backend" / "assets" / "configs"
               / "qwen3.5-397b-a17b.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 60])
    ap.add_argument("--experts", type=int, default=64, help="experts on the TensorCore")
    ap.add_argument("--mode", choices=["decode", "mixed"], default="decode")
    args = ap.parse_args()
    base = model_config_from_dict(json.loads(CONFIG_397B.read_text()))
    mesh = core_mesh()
    mode, T = (ForwardMode.DECODE, 64) if args.mode == "decode" else (ForwardMode.MIXED, 1024)
    spec = StepSpec(mode, T, 64, 64, pages_per_seq=32, num_pages=64 * 32, page_size=256,
                    num_state_slots=64)
    first = None
    for n in args.layers:
        kinds = base.layer_types[:base.layer_period]
        cfg = dataclasses.replace(base, num_hidden_layers=n, num_experts=args.experts,
                                  layer_types=tuple(kinds[i % len(kinds)] for i in range(n)))
        try:
            r = compile_step(cfg, spec, mesh, fp8_experts=True, state_dtype=jnp.bfloat16)
        except Exception as e:  # XLA:TPU refuses a program that does not fit in HBM
            print(f"{n:3d} layers {args.mode}: {str(e).splitlines()[0]}", flush=True)
            continue
        first = first or r.seconds
        print(f"{n:3d} layers {args.mode}: compile {r.seconds:6.1f} s ({r.seconds / first:.2f}x); "
              f"{r.summary().split('; ', 1)[1].split('; ')[0]}", flush=True)


if __name__ == "__main__":
    main()
