"""Program efficiency of the compiled 397B DP8 x EP8 step: every op charged vs the roofline.

Compiles the Qwen3.5-397B DP x EP step for one Ironwood host (tpu7x:2x2x1, 8 TensorCores, FP8
experts, bf16 GDN state, 64 requests per DP rank at 9K-token contexts, page 256) as a decode
step (64 tokens per rank) and a prefill step (1,024 tokens per rank over the same requests),
walks each program's HLO (``compiled_roofline.py``) and prints, per layer kind, the charged
FLOPs, HBM bytes, link bytes and time beside the roofline's ideal, and the program efficiency
(ideal / charged). No TPU needed (libtpu compile-only):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_compiled_roofline.py [--layers 4] [--json]

``--layers N`` compiles the first N layers (N / 4 trips of the layer scan; 4 is one trip and
has no per-trip slicing of the stacked weights, which the full program pays).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax.numpy as jnp

from kernels.tpu_compile import topology_devices
from sglang_tpu_backend.compiled_roofline import TPU7X
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.step_compile import StepSpec, compile_dp_step
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.program_roofline import bucket_efficiency, format_efficiency
from sglang_tpu_backend.roofline import CONFIG_397B, load_config

D, R, PAGE, PAGES = 8, 64, 256, 9216 // 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="default: all 60")
    ap.add_argument("--prefill-tokens", type=int, default=1024, help="per DP rank")
    ap.add_argument("--json", action="store_true", help="also print the efficiencies as JSON")
    a = ap.parse_args()
    cfg = load_config(CONFIG_397B)
    if a.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=a.layers,
                                  layer_types=cfg.layer_types[:a.layers])
    mesh = make_mesh(D, topology_devices("tpu7x:2x2x1"))
    result = {}
    for name, mode, T in (("decode", ForwardMode.DECODE, R),
                          ("prefill", ForwardMode.EXTEND, a.prefill_tokens)):
        spec = StepSpec(mode, T, R, R, PAGES, R * PAGES, PAGE, R)
        start = time.perf_counter()
        report = compile_dp_step(cfg, spec, mesh, fp8_experts=True, state_dtype=jnp.bfloat16)
        b = bucket_efficiency(name, report.hlo, cfg, tokens=T, seqs=R, kv_len=PAGES * PAGE,
                              devices=D, device=TPU7X)
        print(f"397B DP8 x EP8 {name}, {T} tokens per rank, {cfg.num_hidden_layers} layers "
              f"(compile + walk {time.perf_counter() - start:.0f} s), per device:\n"
              + format_efficiency(b), flush=True)
        result[name] = round(b.efficiency, 4)
    if a.json:
        print(json.dumps({"program_efficiency": result}))


if __name__ == "__main__":
    main()
