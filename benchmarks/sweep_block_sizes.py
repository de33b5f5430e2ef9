"""Regenerate kernels/block_tables.json for one TPU generation (issue 36).

On a TPU chip: for the chip's device kind, time each kernel's block-size candidates on
bench_kernels.py's cases at the 397B per-chip shapes (candidates given with ``--block-sizes``
semantics: fields over the shape default), check each candidate's output against the shape
default's, and write the kernel's entry with ``timed: true``, the summed ms of every
candidate, and as ``overrides`` the fastest candidate that matches -- the default ({}) unless
another is faster by more than ``--margin``:

    python benchmarks/sweep_block_sizes.py                    # every kernel
    python benchmarks/sweep_block_sizes.py --only gmm --dry-run

Without a TPU, ``--compile-only TOPOLOGY`` (e.g. v5e:2x2, v6e:2x2, tpu7x:2x2x1) compiles
each candidate's cases with libtpu for that topology and writes ``timed: false`` entries:
empty ``overrides`` (an untimed choice must not change what runs) and, per candidate, whether
every case compiled and the largest Mosaic VMEM use, as data for the chip sweep:

    JAX_PLATFORMS=cpu python benchmarks/sweep_block_sizes.py --compile-only v5e:2x2

A timed entry is never replaced by a compile sweep. ``--interpret`` runs the timed path off a
TPU in interpret mode (``--preset smoke``; a check of the script, never written).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_kernels as bench  # noqa: E402

from sglang_tpu_backend.kernels import block_tables  # noqa: E402

# Candidates per kernel, as bench_kernels --block-sizes fields over the shape default. {} is
# the shape default itself (the baseline, and the pick unless another wins by the margin); at
# the 397B shapes it is attention kv_pages_per_block 2 (page 256) and prefill_q_tokens 32 (512
# score rows at 16 q heads a kv head; prefill softmax updates per 256-key page), GDN
# k_heads_per_block gdn_geometry's pick (4 qk heads for the chunked prefill) and
# rows_per_step 8 (decode rows per grid step; the prefill case ignores it), gmm tm 128 /
# tk K (up to 4096) / tn 512, routing gather_rows 128 / reduce_tokens 32, so those are not repeated.
CANDIDATES = {
    "attention": [{}, {"kv_pages_per_block": 1}, {"kv_pages_per_block": 4},
                  {"prefill_q_tokens": 64}, {"prefill_q_tokens": 64, "kv_pages_per_block": 1},
                  {"prefill_q_tokens": 128, "kv_pages_per_block": 1},
                  {"prefill_q_tokens": 128}],
    "gdn": [{}, {"k_heads_per_block": 2}, {"k_heads_per_block": 4}, {"k_heads_per_block": 8},
            {"rows_per_step": 1}, {"rows_per_step": 2}, {"rows_per_step": 4},
            {"rows_per_step": 16}],
    "gmm": [{}, {"tk": 512}, {"tn": 256}, {"tn": 1024}, {"tm": 256}, {"tm": 256, "tn": 1024}],
    "routing": [{}, {"reduce_tokens": 64}, {"gather_rows": 256},
                {"gather_rows": 256, "reduce_tokens": 64}],
}
# The bench_kernels cases of each kernel (the K/V write has no block sizes).
CASE_PREFIX = {"attention": "attention/", "gdn": "gdn/", "gmm": "gmm/", "routing": "routing/"}
MATCH_TOL = 2e-2  # max |out - default's out| <= MATCH_TOL * max(1, max |default's out|)


def kernel_cases(p: bench.Preset, kernel: str) -> list[bench.Case]:
    return [c for c in bench.cases(p) if c.name.startswith(CASE_PREFIX[kernel])
            and not c.skip and "kv-write" not in c.name]


def _today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


# ----------------------------------------------------------------------------- compile sweep


def compile_candidate(topology: str, p: bench.Preset, kernel: str, cand: dict) -> dict:
    """Compile every case of ``kernel`` with ``cand`` for ``topology``: whether all compiled,
    the largest Mosaic VMEM use in MiB, and the first error."""
    recs = bench.compile_only(topology, p, kernel_cases(p, kernel), {kernel: cand})
    vmem = [v for r in recs for v in r.get("vmem_used", [])]
    out = {"blocks": cand, "compiled": all(r["ok"] for r in recs), "cases": len(recs),
           "max_vmem_mib": round(max(vmem, default=0) / 2**20, 2)}
    errors = [f"{r['name']}: {r['error']}" for r in recs if not r["ok"]]
    if errors:
        out["error"] = errors[0]
    return out


def compile_entry(topology: str, p: bench.Preset, kernel: str) -> dict:
    """A ``timed: false`` entry: no overrides, the candidates that compiled recorded."""
    cands = [compile_candidate(topology, p, kernel, c) for c in CANDIDATES[kernel]]
    return {"overrides": {}, "timed": False,
            "source": f"compile sweep {topology}, {p.name} preset, {_today()}",
            "note": "not timed: the shape defaults stay; candidates compiled by libtpu without "
                    "a chip (max_vmem_mib: the largest Mosaic scoped VMEM use over the cases)",
            "candidates": cands}


# ----------------------------------------------------------------------------- timed sweep


def _matches(out, ref, valid_rows) -> bool:
    if out is None or ref is None or out.shape != ref.shape:
        return False
    if valid_rows is not None:
        out, ref = out[:valid_rows], ref[:valid_rows]
    if not out.size:
        return True
    return float(np.max(np.abs(out - ref))) <= MATCH_TOL * max(1.0, float(np.max(np.abs(ref))))


def time_case(case: bench.Case, p: bench.Preset, kernel: str, args) -> list[dict]:
    """Each candidate's median ms on ``case`` and whether its output matches the default's."""
    rows, ref = [], None
    impl = "interpret" if args.interpret else "pallas"
    for cand in CANDIDATES[kernel]:
        row = {"blocks": cand}
        try:
            s = case.build(p, impl, {kernel: cand})
            t = bench.time_call(s.ours, args.warmup, args.iters, args.budget_s)
            ms, out = t.ms, t.first
            if ref is None and not cand:
                ref = out
            row.update(ms=ms, matches=_matches(out, ref, s.valid_rows))
            del s, out
        except Exception as e:  # a candidate that does not compile or run: recorded
            row["error"] = bench._first_line(e)
        rows.append(row)
        gc.collect()
    return rows


def choose(candidates: list[dict], margin: float) -> dict:
    """The overrides to keep: the fastest candidate that ran and matched on every case, if it
    beats the default ({}, the first) by more than ``margin``; else {}."""
    ok = [c for c in candidates if c.get("ms") is not None and c.get("matches")]
    default = next((c for c in ok if not c["blocks"]), None)
    if not ok or default is None:
        return {}
    best = min(ok, key=lambda c: c["ms"])
    return dict(best["blocks"]) if best["ms"] < (1 - margin) * default["ms"] else {}


def timed_entry(p: bench.Preset, kernel: str, args, device_kind: str) -> dict:
    """A ``timed: true`` entry: each candidate's ms summed over the kernel's cases."""
    per_case = {}
    for case in kernel_cases(p, kernel):
        print(f"... {case.name}", file=sys.stderr, flush=True)
        per_case[case.name] = time_case(case, p, kernel, args)
    cands = []
    for i, cand in enumerate(CANDIDATES[kernel]):
        rows = [r[i] for r in per_case.values()]
        c = {"blocks": cand, "matches": all(r.get("matches") for r in rows)}
        if all("ms" in r for r in rows):
            c["ms"] = round(sum(r["ms"] for r in rows), 4)
            c["case_ms"] = {name: round(r[i]["ms"], 4) for name, r in per_case.items()}
        else:
            c["error"] = next(r["error"] for r in rows if "error" in r)
        cands.append(c)
    return {"overrides": choose(cands, args.margin), "timed": True,
            "source": (f"benchmarks/sweep_block_sizes.py on {device_kind}, {p.name} preset, "
                       f"{_today()}, jax {jax.__version__}"),
            "note": f"ms: median per case summed over {len(per_case)} cases (each in "
                    f"case_ms); matches: output within {MATCH_TOL} (relative) of the shape "
                    f"default's",
            "candidates": cands}


# ----------------------------------------------------------------------------- main


def write_entries(path: Path, device_kind: str, entries: dict) -> None:
    """Set ``entries`` (kernel -> entry) for ``device_kind`` in the table at ``path``, keeping
    a timed entry that an untimed one would replace."""
    table = json.loads(path.read_text())
    kinds = table.setdefault("device_kinds", {})
    mine = kinds.setdefault(device_kind, {})
    for kernel, e in entries.items():
        if not e["timed"] and mine.get(kernel, {}).get("timed"):
            print(f"{device_kind} {kernel}: keeping the timed entry", file=sys.stderr)
            continue
        mine[kernel] = e
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=sorted(CANDIDATES), default=[],
                    help="sweep only this kernel (repeatable)")
    ap.add_argument("--compile-only", metavar="TOPOLOGY",
                    help="no chip: compile the candidates for e.g. v5e:2x2 with libtpu")
    ap.add_argument("--dry-run", action="store_true", help="print the entries, write nothing")
    ap.add_argument("--table", type=Path, default=block_tables.TABLE_PATH)
    ap.add_argument("--preset", default="397b", choices=["397b", "tiny", "smoke"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=10.0)
    ap.add_argument("--margin", type=float, default=0.02,
                    help="a candidate replaces the default only when this much faster")
    ap.add_argument("--interpret", action="store_true",
                    help="off a TPU: run the timed sweep in interpret mode to check the script "
                         "(times mean nothing; implies --dry-run)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    p = bench.preset(args.preset)
    kernels = args.only or sorted(CANDIDATES)
    if args.compile_only:
        from sglang_tpu_backend.kernels import tpu_compile
        kind = tpu_compile.topology_devices(args.compile_only)[0].device_kind
        make = lambda k: compile_entry(args.compile_only, p, k)  # noqa: E731
    else:
        dev = jax.devices()[0]
        args.dry_run |= args.interpret
        if dev.platform != "tpu" and not args.interpret:
            sys.exit("sweep_block_sizes.py times kernels on a TPU chip; this process has none "
                     f"({dev.platform}). Without one, use --compile-only TOPOLOGY (e.g. v5e:2x2).")
        kind = dev.device_kind
        make = lambda k: timed_entry(p, k, args, kind)  # noqa: E731
    with block_tables.disabled():  # the baseline is the shape default, not the old table
        entries = {k: make(k) for k in kernels}
    print(json.dumps({kind: entries}, indent=1))
    if not args.dry_run:
        write_entries(args.table, kind, entries)
        print(f"wrote {', '.join(kernels)} for {kind} into {args.table}", file=sys.stderr)
    return {"device_kind": kind, "entries": entries}


if __name__ == "__main__":
    main()
