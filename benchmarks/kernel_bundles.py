"""Static issue cost of a kernel's grid step, from libtpu's compile, without a chip.

    JAX_PLATFORMS=cpu python benchmarks/kernel_bundles.py --topology v5e:2x2 \\
        --only gmm/gate_up-fp8-decode-gathered [--only ...] [--block-sizes JSON] [--json-out F]

For each ``bench_kernels.py`` case named (exactly), compiles it for ``--topology`` in a child
process whose libtpu dumps its final VLIW bundles (``--xla_jf_dump_to``; the flag is read
once, when libtpu starts, hence one child per case), and prints, for every Mosaic kernel of
the program: its bundles (instruction words, each issued in one cycle when nothing stalls;
a loop's body counted once) and its ten commonest vector ops.

What it is for: a kernel whose step issues more bundles than its DMAs take cycles is bound
by the VPU, not HBM. On a v5e (~1.5 GHz, ~525 GB/s measured HBM reads) a 4 MiB weight tile
takes ~12k cycles to arrive; the FP8 gate_up step issued 14.8k bundles when Mosaic converted
e4m3fn, 10.1k after (``gmm_quant.e4m3_as_b11``), the bf16 step 7.9k. Compare kernels
against each other on one libtpu; the counts are the compiler's, not timings.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_BUNDLE_LINE = re.compile(r"^\s*(?:0x[0-9a-f]+|\d+)\s.*\{")
_VECTOR_OP = re.compile(r"= (v[a-z][\w.]*)")


def count_bundles(text: str) -> tuple[int, dict[str, int]]:
    """(bundles, vector-op counts) of one ``final_bundles`` dump."""
    lines = [ln for ln in text.splitlines() if _BUNDLE_LINE.match(ln)]
    ops = collections.Counter(op for ln in lines for op in _VECTOR_OP.findall(ln))
    return len(lines), dict(ops)


def _child(case_name: str, topology: str, blocks: dict, dump: Path) -> list[dict]:
    """In the child (libtpu dumping to ``dump``): compile the case, read its kernels' dumps."""
    import bench_kernels as bk
    from sglang_tpu_backend.kernels import tpu_compile

    p = bk.preset("397b")
    matches = [c for c in bk.cases(p) if c.name == case_name and not c.skip]
    if not matches:
        raise SystemExit(f"no case named {case_name!r} (bench_kernels.py --list)")
    rep = bk.compile_case(matches[0], p, tpu_compile.core_mesh(topology), blocks)
    out = []
    for name in (k.instruction for k in rep.kernels):
        files = sorted(dump.glob(f"*-{name}-*-final_bundles.txt"))
        if not files:
            raise SystemExit(f"libtpu wrote no final bundles for kernel {name} in {dump}")
        bundles, ops = count_bundles(files[-1].read_text())
        out.append({"case": case_name, "kernel": name, "bundles": bundles, "ops": ops})
    return out


def measure(case_name: str, topology: str, blocks: dict | None = None) -> list[dict]:
    """One child process per case: [{case, kernel, bundles, ops}] per Mosaic kernel."""
    with tempfile.TemporaryDirectory(prefix="bundles-") as dump:
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   LIBTPU_INIT_ARGS=(os.environ.get("LIBTPU_INIT_ARGS", "")
                                     + f" --xla_jf_dump_to={dump}").strip())
        cmd = [sys.executable, __file__, "--child", case_name, "--topology", topology,
               "--block-sizes", json.dumps(blocks or {}), "--dump", dump]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{case_name}: compile child failed:\n{res.stderr[-2000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5e:2x2", help="libtpu topology, e.g. tpu7x:2x2x1")
    ap.add_argument("--only", action="append", default=[], help="a case's exact name")
    ap.add_argument("--block-sizes", type=json.loads, default={})
    ap.add_argument("--json-out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.topology, a.block_sizes, Path(a.dump))))
        return []
    rows = []
    for name in a.only:
        for r in measure(name, a.topology, a.block_sizes):
            top = sorted(r["ops"].items(), key=lambda kv: -kv[1])[:10]
            print(f"{r['case']} [{r['kernel']}]: {r['bundles']} bundles; "
                  + ", ".join(f"{op} {n}" for op, n in top), flush=True)
            rows.append(r)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
