"""Program efficiency of the compiled 397B DP8 x EP8 step: every op charged vs the roofline.

Compiles the Qwen3.5-397B DP x EP step for one Ironwood host (tpu7x:2x2x1, 8 TensorCores, FP8
experts, bf16 GDN state, 64 requests per DP rank at 9K-token contexts, page 256) as a decode
step (64 tokens per rank) and a prefill step (1,024 tokens per rank over the same requests),
walks each program's HLO (``planning/compiled_roofline.py``) and prints, per layer kind, the charged
FLOPs, HBM bytes, link bytes and time beside the roofline's ideal, and the program efficiency
(ideal / charged). No TPU needed (libtpu compile-only):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_compiled_roofline.py [--layers 4] [--json]
        [--steps decode,prefill]

``--layers N`` compiles the first N layers (N / 4 trips of the layer scan; 4 is one trip and
has no per-trip slicing of the stacked weights, which the full program pays).
Each program prints its serial step time (every op one after another) and its overlap-aware
one (async windows charged max(transfer, compute inside): ``planning/compiled_timeline.py``), and
``--json`` adds both. (The overlapped MoE combines this benchmark once compiled side by side
lost at every shape and are gone: README.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax.numpy as jnp

from sglang_tpu_backend.kernels.tpu_compile import topology_devices
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_executor.step_compile import StepSpec, compile_dp_step
from sglang_tpu_backend.parallel.mesh import make_mesh
from sglang_tpu_backend.planning.compiled_roofline import TPU7X
from sglang_tpu_backend.planning.program_roofline import bucket_efficiency, format_efficiency
from sglang_tpu_backend.planning.roofline import CONFIG_397B, load_config

D, R, PAGE, PAGES = 8, 64, 256, 9216 // 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="default: all 60")
    ap.add_argument("--prefill-tokens", type=int, default=1024, help="per DP rank")
    ap.add_argument("--json", action="store_true", help="also print the efficiencies as JSON")
    ap.add_argument("--steps", default="decode,prefill", help="comma-separated steps")
    ap.add_argument("--hlo-dir", default=None, help="also write each program's HLO text here")
    a = ap.parse_args()
    cfg = load_config(CONFIG_397B)
    if a.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=a.layers,
                                  layer_types=cfg.layer_types[:a.layers])
    mesh = make_mesh(D, topology_devices("tpu7x:2x2x1"))
    result, steps = {}, {}
    for name, mode, T in (("decode", ForwardMode.DECODE, R),
                          ("prefill", ForwardMode.EXTEND, a.prefill_tokens)):
        if name not in a.steps.split(","):
            continue
        spec = StepSpec(mode, T, R, R, PAGES, R * PAGES, PAGE, R)
        start = time.perf_counter()
        report = compile_dp_step(cfg, spec, mesh, fp8_experts=True, state_dtype=jnp.bfloat16)
        compile_s = time.perf_counter() - start
        if a.hlo_dir:
            Path(a.hlo_dir).mkdir(parents=True, exist_ok=True)
            Path(a.hlo_dir, f"{name}.hlo.txt").write_text(report.hlo)
        b = bucket_efficiency(name, report.hlo, cfg, tokens=T, seqs=R, kv_len=PAGES * PAGE,
                              devices=D, device=TPU7X)
        serial, overlapped = b.charged.total.seconds, b.charged.overlap_seconds
        print(f"397B DP8 x EP8 {name}, {T} tokens per rank, {cfg.num_hidden_layers} layers "
              f"(compile {compile_s:.0f} s, walk {time.perf_counter() - start - compile_s:.0f} "
              f"s), per device:\n" + format_efficiency(b), flush=True)
        result[name] = round(b.efficiency, 4)
        steps[name] = {"serial_ms": round(serial * 1e3, 3),
                       "overlap_ms": round(overlapped * 1e3, 3), "compile_s": round(compile_s, 1)}
    if a.json:
        print(json.dumps({"program_efficiency": result, "step_ms": steps}))


if __name__ == "__main__":
    main()
