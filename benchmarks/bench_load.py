"""Weight loading against a raw read of the same files: GB/s and peak host memory.

    JAX_PLATFORMS=cpu python benchmarks/bench_load.py [--layers 4] [--experts 128] [--devices 1]
        [--platform cpu|tpu] [--in-flight 2,4]

Writes a synthetic checkpoint in the shipped Qwen3.5-397B naming and format: full-width layers
(hidden 4096, expert width 1024, vocab 248320: the 397B config's), routed experts one tensor
per expert in FP8 e4m3 with 128x128 ``weight_scale_inv`` blocks, bf16 elsewhere, one file per
layer plus one for the embeddings and head, and the index json. ``--layers`` (default one
layer period: 3 GDN + 1 attention) and ``--experts`` per layer (default 128 of the 512) keep
it within this machine: on CPU the "devices" are host memory too, and they hold the loaded
weights (replicated ones once per device, hence ``--devices 1``). Then, each in a fresh
subprocess with ``--devices`` CPU devices (or TPU chips, ``--platform tpu``), in the order
raw, load, load (once per ``--in-flight`` value), raw, fresh, touch, put:

  raw   read every file start to end in 64 MiB reads into one reused buffer (the disk's
        sequential figure);
  load  ``sharded_loader.load_sharded`` with the DP x EP shardings over the devices, FP8
        experts kept as on TPU (routed experts split over the devices, the rest replicated);
        the first with an empty persistent compilation cache, the next ones with the one the
        first filled (the engine keeps one by default), so they pay no compiles of the
        loader's write programs; ``--in-flight 2,4``: the filled-cache load once per value of
        the loader's leaves in flight (``$STB_LOAD_IN_FLIGHT``, default ``IN_FLIGHT``), the
        first value also the empty-cache load's;
  fresh raw reads of every file into its own fresh huge-page-advised buffer, all kept: the
        memory's first touches included, as a load's;
  touch no reads: fresh memory of the checkpoint's size faulted in, the cost of the memory
        that ends up holding the weights (on a VM whose host backs guest memory on first
        touch, this, not the disk, can bound a load);
  put   no reads: the load's leaves (its steps' shapes, dtypes and shardings; the same bytes)
        as host arrays already in memory (one pre-faulted buffer per shape and dtype, reused)
        moved to the devices with ``jax.device_put``, ``block_until_ready`` on the transfer
        N steps back before the next, as the load waits: ``put`` one leaf at a time (N = 1),
        ``put xN`` for N in 4 and the ``--in-flight`` values. The host-to-device ceiling a
        load cannot beat (on CPU devices a put may alias the host array: no copy measured).

Each run starts cold for the checkpoint: its files' pages are dropped from the page cache
first (``posix_fadvise(DONTNEED)``, no root needed). Prints bytes, seconds and GB/s per run,
the means and ratio (target: load >= 70% of raw), each load against the best put (the
ceiling) and the put with as many in flight, how long the load waited for reads
(``LoadReport.read_seconds``) and its host-side read rate per reading thread (reading and
assembling leaves, over ``reader_seconds``; on CPU devices the devices' copies and
transposes share the same cores),
and the load's host memory: peak RSS (VmHWM) beyond
the resident set after the load (which holds the loaded weights, on CPU devices) against the
largest layer's bytes (target <= 1.5x). The checkpoint is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIG_397B = REPO / "sglang_tpu_backend" / "assets" / "configs" / "qwen3.5-397b-a17b.json"
PREFIX = "model.language_model."
CHUNK = 64 << 20


def bench_config(layers: int, experts: int) -> dict:
    """The 397B config dict with ``layers`` layers and ``experts`` routed experts."""
    config = json.loads(CONFIG_397B.read_text())
    text = config["text_config"]
    interval = text["full_attention_interval"]
    text.update(num_hidden_layers=layers, num_experts=experts,
                layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                             for i in range(layers)])
    return config


def _random(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Finite random values of ``dtype`` drawn as bits (fast at GB sizes): bf16 of magnitude
    around 2^-7, FP8 e4m3 with exponent bit 3 clear (no NaN codes), f32 scales around 1e-2."""
    import ml_dtypes

    n = int(np.prod(shape))
    if dtype == "fp8":
        bits = rng.integers(0, 256, n, dtype=np.uint8) & np.uint8(0xBF)
        return bits.view(ml_dtypes.float8_e4m3fn).reshape(shape)
    if dtype == "f32":
        return rng.uniform(0.005, 0.015, shape).astype(np.float32)
    bits = (rng.integers(0, 1 << 16, n, dtype=np.uint16) & np.uint16(0x807F)) | np.uint16(0x3C00)
    return bits.view(ml_dtypes.bfloat16).reshape(shape)


def write_checkpoint(out: Path, layers: int, experts: int) -> tuple[int, int]:
    """The synthetic checkpoint in ``out``; returns (total tensor bytes, largest layer's)."""
    from sglang_tpu_backend.model_loader.checkpoint_io import FP8_BLOCK, write_safetensors
    from sglang_tpu_backend.config import model_config_from_dict
    from sglang_tpu_backend.model_loader.loader import expected_shapes

    config = bench_config(layers, experts)
    cfg = model_config_from_dict(config)
    shapes = expected_shapes(cfg, PREFIX, {})
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files: dict[str, list[str]] = {}
    for name in shapes:
        part = name.split(".")[3] if name.startswith(PREFIX + "layers.") else "top"
        files.setdefault(part, []).append(name)
    rng = np.random.default_rng(0)
    weight_map, total, largest = {}, 0, 0
    for k, (part, names) in enumerate(files.items()):
        tensors = {}
        for name in names:
            shape = shapes[name]
            expert = ".mlp.experts." in name
            tensors[name] = _random(shape, "fp8" if expert else
                                    "f32" if name.endswith(("A_log", "dt_bias")) else "bf16", rng)
            if expert:
                blocks = tuple(-(-d // FP8_BLOCK) for d in shape)
                tensors[name + "_scale_inv"] = _random(blocks, "f32", rng)
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        write_safetensors(out / fname, tensors)
        nbytes = sum(t.nbytes for t in tensors.values())
        total += nbytes
        largest = max(largest, nbytes) if part != "top" else largest
        weight_map.update({n: fname for n in tensors})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")
    return total, largest


def drop_from_page_cache(ckpt: Path) -> None:
    for path in ckpt.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _status_kb(field: str) -> int:
    """Bytes of a /proc/self/status field; where a sandbox's /proc lacks it (the TPU host has no
    VmHWM), the peak from getrusage for VmHWM, the current RSS from statm for VmRSS."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    if field == "VmHWM":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# Subprocess bodies ----------------------------------------------------------------------
def run_raw(ckpt: Path) -> dict:
    buf = bytearray(CHUNK)
    t0, n = time.perf_counter(), 0
    for path in sorted(ckpt.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return {"bytes": n, "seconds": time.perf_counter() - t0}


def run_fresh(ckpt: Path) -> dict:
    """Raw reads into fresh memory: each file read start to end straight into its own new
    huge-page-advised buffer (``host_load.host_empty``), as the load reads into its buffers."""
    from sglang_tpu_backend.model_loader.host_load import host_empty

    t0, n, keep = time.perf_counter(), 0, []
    for path in sorted(ckpt.glob("*.safetensors")):
        buf, done = host_empty((path.stat().st_size,), np.uint8), 0
        with open(path, "rb", buffering=0) as f:
            while k := f.readinto(memoryview(buf)[done:done + CHUNK]):
                done += k
        n += done
        keep.append(buf)  # all of it stays resident, as loaded weights do
    return {"bytes": n, "seconds": time.perf_counter() - t0}


def run_touch(ckpt: Path) -> dict:
    """No reads: fresh huge-page-advised memory of the checkpoint's size faulted in
    (``MADV_POPULATE_WRITE``, the load's ``Populator``), the cost of the memory alone. Where
    the kernel lacks that call (the Populator then does nothing), by a write to every page."""
    import mmap

    from sglang_tpu_backend.model_loader.host_load import Populator, host_empty

    n = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    t0 = time.perf_counter()
    buf = host_empty((n,), np.uint8)
    populator = Populator([buf])
    populator.stop_when_done()
    if not populator.supported:
        buf[::mmap.PAGESIZE] = 1
    return {"bytes": n, "seconds": time.perf_counter() - t0,
            "populate": populator.supported}


def _placement(ckpt: Path, devices: int) -> tuple:
    """The checkpoint's config and the DP x EP shardings of its params over ``devices``."""
    import jax.numpy as jnp

    from sglang_tpu_backend.config import load_model_config
    from sglang_tpu_backend.parallel.dp_forward import DPForward
    from sglang_tpu_backend.parallel.mesh import make_mesh
    from sglang_tpu_backend.models.param_shapes import param_shapes

    cfg = load_model_config(ckpt)
    dp = DPForward(cfg, make_mesh(devices))
    return cfg, dp.param_shardings(param_shapes(cfg, jnp.bfloat16, fp8_experts=True))


def _put_seconds(items: list, n: int) -> float:
    """Seconds to ``device_put`` every ``(host array, sharding)`` of ``items`` in order, at
    most ``n`` transfers in flight: the one ``n`` back waited for before the next starts."""
    import collections

    import jax

    flight: collections.deque = collections.deque()
    t0 = time.perf_counter()
    for buf, sharding in items:
        while len(flight) >= n:
            flight.popleft().block_until_ready().delete()
        flight.append(jax.device_put(buf, sharding))
    for x in flight:
        x.block_until_ready()
    seconds = time.perf_counter() - t0
    for x in flight:
        x.delete()
    return seconds


def run_put(ckpt: Path, devices: int, counts: list[int]) -> dict:
    """The load's leaves from host memory to the devices, ``counts`` in flight (module doc):
    {"bytes": the steps' bytes, "seconds": {n: seconds}}."""
    import jax
    import jax.numpy as jnp

    from sglang_tpu_backend.model_loader import sharded_loader as sl
    from sglang_tpu_backend.model_loader.host_load import host_empty
    from sglang_tpu_backend.model_loader.loader import CheckpointLeaves
    from sglang_tpu_backend.models.param_shapes import param_shapes

    cfg, shardings = _placement(ckpt, devices)
    shapes = param_shapes(cfg, jnp.bfloat16, fp8_experts=True)
    leaves = CheckpointLeaves(ckpt, cfg, dtype=jnp.bfloat16, keep_fp8_experts=True)
    steps = sl._plan(leaves, cfg, shapes, sl.with_native_layouts(shapes, shardings))
    bufs: dict = {}  # (shape, dtype) -> one pre-faulted host buffer, reused by every step
    for st in steps:
        if (st.shape, st.s.dtype) not in bufs:
            bufs[st.shape, st.s.dtype] = buf = host_empty(st.shape, st.s.dtype)
            buf.view(np.uint8).fill(0x11)  # faulted in, and finite in bf16, f32 and e4m3
    items = [(bufs[st.shape, st.s.dtype], st.as_read) for st in steps]
    jax.block_until_ready(jax.device_put(*max(items, key=lambda i: i[0].nbytes))).delete()
    return {"bytes": sum(sum(sl._job_bytes(st)) for st in steps),
            "seconds": {n: _put_seconds(items, n) for n in counts}}


def run_load(ckpt: Path, devices: int) -> dict:
    import jax
    import jax.numpy as jnp

    from sglang_tpu_backend.models.param_shapes import num_param_bytes
    from sglang_tpu_backend.model_loader.sharded_loader import in_flight, load_sharded

    cfg, shardings = _placement(ckpt, devices)
    if os.environ.get("BENCH_LOAD_COMPILE_CACHE"):  # the engine's default: a persistent cache
        from sglang_tpu_backend.model_executor.compile_cache import enable_persistent_cache

        enable_persistent_cache(os.environ["BENCH_LOAD_COMPILE_CACHE"])
    jax.block_until_ready(jax.jit(lambda: jnp.zeros(8))())  # backend up before the baseline
    compiles = []  # seconds of each backend compile during the load (any thread)
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **kw: compiles.append(d) if e.endswith("backend_compile_duration") else None)
    rss0 = _status_kb("VmRSS")
    params, report = load_sharded(ckpt, cfg, shardings, dtype=jnp.bfloat16,
                                  keep_fp8_experts=True, backend="tpu")
    rss1, hwm = _status_kb("VmRSS"), _status_kb("VmHWM")
    return {"bytes": report.bytes_read, "seconds": report.seconds,
            "read_seconds": report.read_seconds, "reader_seconds": report.reader_seconds,
            "compiles": len(compiles), "compile_seconds": sum(compiles),
            "phases": report.phases, "host_buffers": report.host_buffers, "rss_before": rss0,
            "rss_after": rss1, "hwm": hwm, "param_bytes": num_param_bytes(params),
            "in_flight": in_flight()}


# Driver ---------------------------------------------------------------------------------
def _child(kind: str, ckpt: Path, devices: int, platform: str, cache: Path,
           in_flight: str = "") -> dict:
    """One run in a fresh subprocess: ``in_flight`` is the load's ``$STB_LOAD_IN_FLIGHT``, or
    the put's transfers in flight (comma-separated)."""
    # Transparent huge pages for malloc's large blocks (glibc >= 2.35; ignored by older ones):
    # where THP is madvise-only, first touches of fresh 4 KiB pages ran at ~0.35 GB/s on this
    # VM and dominated the load (every leaf lands in fresh host-memory "device" buffers).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, JAX_PLATFORMS=platform, PYTHONPATH=path,  # keep where jax lives
               GLIBC_TUNABLES="glibc.malloc.hugetlb=1", BENCH_LOAD_COMPILE_CACHE=str(cache))
    if platform == "cpu":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if kind == "load" and in_flight:
        env["STB_LOAD_IN_FLIGHT"] = in_flight
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--dir", str(ckpt),
                          "--devices", str(devices), "--in-flight", in_flight],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 1e9:6.2f} GB in {seconds:6.2f} s = {nbytes / seconds / 1e9:5.2f} GB/s"


def _print_run(kind: str, r: dict, first_load: bool, largest: int) -> None:
    """A run's lines: bytes, seconds, GB/s; a load's compiles, reads, memory and phases."""
    if kind == "put":
        for n, sec in r["seconds"].items():
            label = "put" if int(n) == 1 else f"put x{n}"
            print(f"{label:9s} {_rate(r['bytes'], sec)}  ({n} in flight)", flush=True)
        return
    line = f"{kind:9s} {_rate(r['bytes'], r['seconds'])}"
    if kind == "touch" and not r["populate"]:
        line += ("  (no MADV_POPULATE_WRITE in this kernel: faulted by writes, and the load's "
                 "Populator faults nothing ahead of the reads)")
    if kind == "load":
        line += (f"  ({r['in_flight']} in flight)"
                 + (" with an empty" if first_load else " with a filled")
                 + " persistent compilation cache")
        extra = r["hwm"] - r["rss_after"]
        line += (f" ({r['compiles']} programs compiled, {r['compile_seconds']:.2f} s "
                 f"summed over threads; reading waited for {r['read_seconds']:.2f} s; host reads "
                 f"{r['bytes'] / r['reader_seconds'] / 1e9:.2f} GB/s per reading thread)"
                 f"; peak RSS {r['hwm'] / 1e9:.2f} GB, after {r['rss_after'] / 1e9:.2f} GB "
                 f"(weights {r['param_bytes'] / 1e9:.2f} GB): peak beyond the loaded "
                 f"weights {extra / 1e9:.2f} GB = {extra / largest:.2f}x the largest layer")
    print(line, flush=True)
    if r.get("phases"):
        print("      main thread (s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["phases"].items()), flush=True)
    if r.get("host_buffers"):
        print("      host buffers: " + ", ".join(
            f"{k} {v}" for k, v in r["host_buffers"].items()), flush=True)


def _print_summary(runs: dict, largest: int) -> None:
    """Means (GB/s), each load against raw and the put ceiling, peak host memory."""
    speed = {k: statistics.mean(r["bytes"] / r["seconds"] for r in v) / 1e9
             for k, v in runs.items() if k != "put"}
    put = {int(n): runs["put"][0]["bytes"] / sec / 1e9
           for n, sec in runs["put"][0]["seconds"].items()}
    ceiling = max(put.values())
    worst = max(r["hwm"] - r["rss_after"] for r in runs["load"])
    loads = []
    for k, r in enumerate(runs["load"]):
        gbs, n = r["bytes"] / r["seconds"] / 1e9, r["in_flight"]
        loads.append(f"{'empty' if k == 0 else 'filled'} cache, {n} in flight {gbs:.2f} GB/s = "
                     f"{gbs / speed['raw']:.0%} of raw, {gbs / ceiling:.0%} of the put ceiling"
                     + (f", {gbs / put[n]:.0%} of put x{n}" if n in put else ""))
    print(f"mean: raw {speed['raw']:.2f} GB/s, load {speed['load']:.2f} GB/s = "
          f"{speed['load'] / speed['raw']:.0%} of raw (target >= 70%); put ceiling "
          f"{ceiling:.2f} GB/s (" + ", ".join(f"x{n} {v:.2f}" for n, v in put.items())
          + f") = {ceiling / speed['raw']:.0%} of raw; fresh memory faulted in at "
          f"{speed['touch']:.2f} GB/s, read into at {speed['fresh']:.2f} GB/s (the load "
          f"is {speed['load'] / speed['fresh']:.0%} of that); peak host memory beyond the "
          f"weights {worst / largest:.2f}x the largest layer (target <= 1.5x)")
    for line in loads:
        print("      load: " + line)


def main() -> None:
    from sglang_tpu_backend.model_loader.sharded_loader import IN_FLIGHT

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--devices", type=int, default=1,
                    help="CPU devices (replicated weights are copied to each, in host memory)")
    ap.add_argument("--dir", type=str, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--platform", choices=("cpu", "tpu"), default="cpu",
                    help="where the load child puts the weights: CPU devices, or the TPU chips "
                         "of this host (then --devices is how many of them)")
    ap.add_argument("--in-flight", default=str(IN_FLIGHT),
                    help="comma-separated leaves in flight: a filled-cache load per value")
    ap.add_argument("--child", choices=("raw", "fresh", "touch", "load", "put"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        ckpt = Path(a.dir)
        counts = [int(n) for n in a.in_flight.split(",") if n]
        res = run_load(ckpt, a.devices) if a.child == "load" else \
            run_put(ckpt, a.devices, counts) if a.child == "put" else \
            {"raw": run_raw, "fresh": run_fresh, "touch": run_touch}[a.child](ckpt)
        print(json.dumps(res))
        return
    values = [int(n) for n in a.in_flight.split(",")]
    counts = ",".join(str(n) for n in sorted({1, 4, *values}))
    root = Path(tempfile.mkdtemp(prefix="bench_load-", dir=a.dir))
    try:
        ckpt = root / "ckpt"
        t0 = time.perf_counter()
        total, largest = write_checkpoint(ckpt, a.layers, a.experts)
        print(f"wrote {total / 1e9:.2f} GB ({a.layers} layers x {a.experts} FP8 experts, "
              f"397B widths) in {time.perf_counter() - t0:.0f} s; largest layer "
              f"{largest / 1e9:.2f} GB")
        runs = {"raw": [], "load": [], "fresh": [], "touch": [], "put": []}
        order = [("raw", ""), ("load", str(values[0]))] + [("load", str(v)) for v in values]
        for kind, n in order + [("raw", ""), ("fresh", ""), ("touch", ""), ("put", counts)]:
            drop_from_page_cache(ckpt)
            r = _child(kind, ckpt, a.devices, a.platform, root / "compile-cache", n)
            runs[kind].append(r)
            _print_run(kind, r, len(runs["load"]) == 1, largest)
        _print_summary(runs, largest)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
