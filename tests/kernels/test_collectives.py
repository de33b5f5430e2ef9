"""Tests for kernels/collectives.py: hierarchical reduce-scatter and packed all-gather.

The collectives need 8 devices as a (4, 2) ("chip", "die") mesh. Other test files in the same
pytest process may already have initialised jax with one CPU device, so every multi-device
check runs once in a subprocess (this file run as a script, with
XLA_FLAGS=--xla_force_host_platform_device_count=8) that writes its inputs and outputs to an
.npz; the tests below load it and assert with numpy. That subprocess is the ``results``
fixture (module scope, ~30 s: interpret mode is slow).

Tolerances: exact (bit-for-bit) for every integer-valued input (float32 / bfloat16 holding
small integers, int32), since every partial sum is exactly representable and the summation
order cannot matter. Random float32 normals: the hierarchical schedule adds the two dies'
rows first and then the four chips' partials in chip order, while psum_scatter adds in its
own order; float addition is not associative, so the last bits may differ -> rtol=atol=1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# Every test reads the one multi-device worker run: all of them on the jax 0.12 leg too.
# The TPU leg skips them: they run on 8 simulated CPU devices (one chip holds no mesh).
pytestmark = [pytest.mark.jax_versions,
              pytest.mark.cpu_only(reason="8 simulated CPU devices; one chip has no mesh")]

REPO = Path(__file__).resolve().parents[2]
NUM_CHIPS, NUM_DIES = 4, 2
NUM_DEVICES = NUM_CHIPS * NUM_DIES
ROWS_PER_MICROBATCH = 8  # R of the race-detector case: one (8, 128) f32 tile
HIDDEN = 128
TOPK_T, TOPK_K = 5, 4

# Exactly representable float32 bit patterns the routing weights must survive unchanged.
SPECIAL_WEIGHT_BITS = np.array(
    [
        0x7FC00000,  # quiet NaN
        0x7FC12345,  # quiet NaN with payload
        0xFFC00001,  # negative quiet NaN with payload
        0x7F800001,  # signalling NaN
        0x80000000,  # -0.0
        0x00000000,  # +0.0
        0x00000001,  # smallest denormal
        0x807FFFFF,  # largest negative denormal
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x3F800000,  # 1.0
        0x3E99999A,  # 0.3
    ],
    dtype=np.uint32,
)

# (name, dtype, M = num_microbatches, R = rows per block per micro-batch, kind); kind "int" =
# small integers (exact sums), "rand" = standard normals. Per-device x stays below 100 KiB:
# PJRT's CPU client copies bigger arrays on its thread pool, which the interpreter's 8 device
# threads blocked in semaphore waits can exhaust on a 2-core machine (the run then hangs).
RS_CASES = [
    ("f32_m1", "float32", 1, 8, "int"),
    ("f32_m2", "float32", 2, 8, "int"),
    ("f32_m3", "float32", 3, 8, "int"),
    ("f32_m4", "float32", 4, 4, "int"),
    ("i32_m1", "int32", 1, 8, "int"),
    ("i32_m3", "int32", 3, 4, "int"),
    ("i32_m4", "int32", 4, 2, "int"),
    ("bf16_m2", "bfloat16", 2, 16, "int"),
    ("f32rand_m2", "float32", 2, 8, "rand"),
]

# Start / done reduce-scatter cases (one micro-batch): (name, dtype, R, kind).
ASYNC_CASES = [
    ("f32", "float32", 8, "int"),
    ("bf16", "bfloat16", 16, "int"),
    ("f32rand", "float32", 8, "rand"),
]


# ------------------------------------------------------------------------------------------
# Worker (runs in the subprocess with 8 CPU devices)
# ------------------------------------------------------------------------------------------


def _shard_map(f, mesh, in_specs, out_specs, check_vma=True):
    import jax

    if hasattr(jax, "shard_map"):  # jax >= 0.7 (0.10.2, 0.12)
        return jax.shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )
    from jax.experimental.shard_map import shard_map

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)


def _make_input(dtype, m, rows, kind, seed):
    rng = np.random.RandomState(seed)
    n = NUM_DEVICES * m * rows
    shape = (NUM_DEVICES * n, HIDDEN)  # all devices' x stacked: device i owns rows i*n..
    if kind == "int":
        return rng.randint(-8, 9, size=shape).astype(np.float32 if dtype != "int32" else np.int32)
    return rng.standard_normal(shape).astype(np.float32)


def _worker(out_dir: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from sglang_tpu_backend.kernels import collectives as col

    assert len(jax.devices()) >= NUM_DEVICES, jax.devices()
    mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]).reshape(NUM_CHIPS, NUM_DIES), ("chip", "die"))
    spec = P(("chip", "die"))
    arrays: dict[str, np.ndarray] = {}
    info: dict[str, object] = {"jax_version": jax.__version__}

    def to_numpy(a):  # bfloat16 results as float32 (exact), the rest as they are
        return np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a)

    def run(fn, *xs, in_specs=None, out_specs=spec, check_vma=True):
        """jit(shard_map(fn)) and its inputs placed with the in_specs sharding (jax 0.12)."""
        in_specs = in_specs or (spec,) * len(xs)
        f = jax.jit(_shard_map(fn, mesh, in_specs, out_specs, check_vma))
        return f, [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, in_specs)]

    # --- hierarchical reduce-scatter ----------------------------------------------------
    for i, (name, dtype, m, rows, kind) in enumerate(RS_CASES):
        x_np = _make_input(dtype, m, rows, kind, seed=i)
        x = jnp.asarray(x_np).astype(dtype)
        arrays[f"rs_{name}_x"] = to_numpy(x)
        for impl in ("interpret", "reference"):
            f, (xs,) = run(
                lambda a, impl=impl, m=m: col.hierarchical_reduce_scatter(
                    a, num_microbatches=m, impl=impl
                ),
                x,
            )
            got = f(xs)
            arrays[f"rs_{name}_{impl}"] = to_numpy(got)
            info[f"rs_{name}_{impl}_dtype"] = str(got.dtype)
        f, (xs,) = run(lambda a: col.ref_hierarchical_reduce_scatter(a), x)
        want = f(xs)
        arrays[f"rs_{name}_want"] = to_numpy(want)
        if name == "f32_m3":  # the kernel also runs without shard_map's varying-axes checks
            f, (xs,) = run(
                lambda a: col.hierarchical_reduce_scatter(a, num_microbatches=3, impl="interpret"),
                x, check_vma=False,
            )
            arrays[f"rs_{name}_novma"] = np.asarray(f(xs))

    # --- the kernel under the interpreter's race detector ---------------------------------
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    x = jnp.asarray(_make_input("float32", 2, ROWS_PER_MICROBATCH, "int", seed=99))
    layout_args = dict(chip_axis="chip", die_axis="die")

    def racy(a):
        lo = col._check_reduce_scatter(a, NUM_CHIPS, NUM_DIES, 2)
        params = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
        return col._reduce_scatter_pallas(a, lo, interpret=params, **layout_args)

    f, (xs,) = run(racy, x)
    arrays["race_got"] = np.asarray(f(xs))
    arrays["race_x"] = np.asarray(x)
    info["races_found"] = bool(ipc.races is not None and ipc.races.races_found)
    info["race_detector_ran"] = ipc.races is not None

    _async_worker(run, arrays, to_numpy)

    # --- ValueErrors (raised at trace time, inside shard_map) ----------------------------
    errors = {}
    bad_cases = {
        "rows_not_divisible": ((NUM_DEVICES * (2 * NUM_DEVICES + NUM_DEVICES), HIDDEN), 2),
        "rows_not_divisible_m3": ((NUM_DEVICES * NUM_DEVICES * 4, HIDDEN), 3),
        "too_many_microbatches": ((NUM_DEVICES * NUM_DEVICES * 5, HIDDEN), 5),
        "zero_microbatches": ((NUM_DEVICES * NUM_DEVICES, HIDDEN), 0),
    }
    for key, (shape, m) in bad_cases.items():
        for impl in ("interpret", "reference"):
            f, (xs,) = run(
                lambda a, m=m, impl=impl: col.hierarchical_reduce_scatter(
                    a, num_microbatches=m, impl=impl
                ),
                jnp.zeros(shape, jnp.float32),
            )
            try:
                f(xs)
                errors[f"{key}_{impl}"] = None
            except ValueError as e:
                errors[f"{key}_{impl}"] = str(e)
                if hasattr(pltpu, "reset_tpu_interpret_mode_state"):
                    pltpu.reset_tpu_interpret_mode_state()
    f, (xs,) = run(lambda a: col.hierarchical_reduce_scatter(a[:, 0], impl="reference"),
                   jnp.zeros((NUM_DEVICES * 64, 2), jnp.float32))
    try:
        f(xs)
        errors["x_1d"] = None
    except ValueError as e:
        errors["x_1d"] = str(e)
    info["errors"] = errors

    # --- packed all-gather ---------------------------------------------------------------
    rng = np.random.RandomState(7)
    n_tok = NUM_DEVICES * TOPK_T
    ids = rng.randint(-3, 512, size=(n_tok, TOPK_K)).astype(np.int32)
    bits = rng.randint(0, 2**32, size=(n_tok, TOPK_K), dtype=np.uint64).astype(np.uint32)
    bits.reshape(-1)[: SPECIAL_WEIGHT_BITS.size] = SPECIAL_WEIGHT_BITS
    bits.reshape(-1)[-SPECIAL_WEIGHT_BITS.size :] = SPECIAL_WEIGHT_BITS[::-1]
    weights = bits.view(np.float32)
    arrays["ag_ids"], arrays["ag_weight_bits"] = ids, bits
    # out_specs stack every device's own copy of the gathered arrays, so the tests can check
    # that each device got the same, complete result.
    for axes_key, axis_name, in_spec, out_spec in [
        ("both", ("chip", "die"), spec, spec),
        ("die", "die", spec, spec),
    ]:
        for which, fn in (("packed", col.packed_all_gather), ("ref", col.ref_packed_all_gather)):
            def body(i, w, fn=fn, axis_name=axis_name):
                return fn(i, w, axis_name=axis_name)

            f, xs = run(
                body, ids, weights, in_specs=(in_spec, in_spec), out_specs=(out_spec, out_spec)
            )
            got_ids, got_w = f(*xs)
            arrays[f"ag_{axes_key}_{which}_ids"] = np.asarray(got_ids)
            arrays[f"ag_{axes_key}_{which}_bits"] = np.asarray(got_w).view(np.uint32)
            jaxpr = str(jax.make_jaxpr(f)(*xs))
            info[f"ag_{axes_key}_{which}_jaxpr_all_gathers"] = jaxpr.count("all_gather[")
            hlo = f.lower(*xs).compile().as_text()
            info[f"ag_{axes_key}_{which}_hlo_all_gathers"] = sum(
                1
                for line in hlo.splitlines()
                if " all-gather(" in line or " all-gather-start(" in line
            )
    try:
        col.packed_all_gather(jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 3), jnp.float32),
                              axis_name="die")
        errors["ag_shape"] = None
    except ValueError as e:
        errors["ag_shape"] = str(e)
    try:
        col.packed_all_gather(jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2), jnp.bfloat16),
                              axis_name="die")
        errors["ag_dtype"] = None
    except ValueError as e:
        errors["ag_dtype"] = str(e)

    np.savez(os.path.join(out_dir, "arrays.npz"), **arrays)
    with open(os.path.join(out_dir, "info.json"), "w") as fh:
        json.dump(info, fh)


def _async_worker(run, arrays, to_numpy) -> None:
    """The start / done reduce-scatter (one micro-batch per pair) and its fused kernel under
    the race detector; the synchronous kernel at M=1 alongside (same summation order)."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    from sglang_tpu_backend.kernels import collectives as col
    from sglang_tpu_backend.kernels import collectives_async as ca

    def pair(a, impl):
        return ca.reduce_scatter_done(ca.reduce_scatter_start(a, impl=impl), impl=impl)

    def triple(a, impl):  # start -> ici_start -> done, the three phases split
        fut = ca.reduce_scatter_ici_start(ca.reduce_scatter_start(a, impl=impl), impl=impl)
        return ca.reduce_scatter_done(fut, impl=impl)

    for i, (name, dtype, rows, kind) in enumerate(ASYNC_CASES):
        x = jnp.asarray(_make_input(dtype, 1, rows, kind, seed=50 + i)).astype(dtype)
        arrays[f"async_{name}_x"] = to_numpy(x)
        for impl in ("interpret", "reference"):
            f, (xs,) = run(lambda a, impl=impl: pair(a, impl), x)
            arrays[f"async_{name}_{impl}"] = to_numpy(f(xs))
            f, (xs,) = run(lambda a, impl=impl: triple(a, impl), x)
            arrays[f"async_{name}_{impl}_triple"] = to_numpy(f(xs))
        f, (xs,) = run(lambda a: col.hierarchical_reduce_scatter(
            a, num_microbatches=1, impl="interpret"), x)
        arrays[f"async_{name}_sync"] = to_numpy(f(xs))
        f, (xs,) = run(col.ref_hierarchical_reduce_scatter, x)
        arrays[f"async_{name}_want"] = to_numpy(f(xs))

    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    x = jnp.asarray(_make_input("float32", 1, ROWS_PER_MICROBATCH, "int", seed=98))

    def racy(a):
        fut = ca.reduce_scatter_start(a, impl="interpret")
        lo = col.ReduceScatterLayout(a.shape[0], a.shape[1], NUM_CHIPS, NUM_DIES, 1)
        params = pltpu.InterpretParams(dma_execution_mode="eager", detect_races=True)
        coords = col._peer_coords(lo, "chip", "die")
        return ca._call_fused(coords, fut.x, (NUM_CHIPS, NUM_DIES, "chip", "die"), params)

    f, (xs,) = run(racy, x)
    arrays["async_race_got"] = np.asarray(f(xs))
    arrays["async_race_x"] = np.asarray(x)
    arrays["async_race_detector_ran"] = np.asarray(ipc.races is not None)
    arrays["async_races_found"] = np.asarray(bool(ipc.races is not None
                                                  and ipc.races.races_found))


# ------------------------------------------------------------------------------------------
# Fixture: run the worker once
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("collectives")
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    arrays = dict(np.load(out_dir / "arrays.npz"))
    info = json.loads((out_dir / "info.json").read_text())
    return arrays, info


def _naive_reduce_scatter(x_all: np.ndarray) -> np.ndarray:
    """Plain numpy loop: device j gets sum over devices i of block j of x_i (stacked by j)."""
    x_all = x_all.astype(np.float64)
    n = x_all.shape[0] // NUM_DEVICES
    block = n // NUM_DEVICES
    out = np.zeros((NUM_DEVICES * block, x_all.shape[1]))
    for j in range(NUM_DEVICES):  # receiving device, linear index chip * 2 + die
        for i in range(NUM_DEVICES):  # sending device
            x_i = x_all[i * n : (i + 1) * n]
            out[j * block : (j + 1) * block] += x_i[j * block : (j + 1) * block]
    return out


# ------------------------------------------------------------------------------------------
# Hierarchical reduce-scatter
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype,m,rows,kind", [c for c in RS_CASES if c[4] == "int"])
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_reduce_scatter_bit_exact(results, name, dtype, m, rows, kind, impl):
    arrays, info = results
    got, want = arrays[f"rs_{name}_{impl}"], arrays[f"rs_{name}_want"]
    assert info[f"rs_{name}_{impl}_dtype"] == dtype
    assert got.shape == want.shape == (NUM_DEVICES * m * rows, HIDDEN)
    # the reference itself against a numpy loop (sums of small integers are exact)
    naive = _naive_reduce_scatter(arrays[f"rs_{name}_x"])
    np.testing.assert_array_equal(want.astype(np.float64), naive)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes(), (
        f"{impl} differs from psum_scatter in {np.sum(got != want)} elements"
    )


def test_reduce_scatter_without_check_vma(results):
    arrays, _ = results
    assert arrays["rs_f32_m3_novma"].tobytes() == arrays["rs_f32_m3_want"].tobytes()


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_reduce_scatter_random_floats(results, impl):
    # Not bit-exact in general: the two-stage schedule sums (die pair) then chips 0..3 in
    # order, psum_scatter in XLA's order; float addition is not associative.
    arrays, _ = results
    got, want = arrays[f"rs_f32rand_m2_{impl}"], arrays["rs_f32rand_m2_want"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    naive = _naive_reduce_scatter(arrays["rs_f32rand_m2_x"])
    np.testing.assert_allclose(got, naive, rtol=1e-5, atol=1e-5)


def test_reduce_scatter_kernel_has_no_races(results):
    arrays, info = results
    assert info["race_detector_ran"]
    assert not info["races_found"]
    np.testing.assert_array_equal(arrays["race_got"], _naive_reduce_scatter(arrays["race_x"]))


@pytest.mark.parametrize("name,dtype,rows,kind", ASYNC_CASES, ids=[c[0] for c in ASYNC_CASES])
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_async_reduce_scatter_equals_sync_and_reference(results, name, dtype, rows, kind, impl):
    arrays, _ = results
    got, want = arrays[f"async_{name}_{impl}"], arrays[f"async_{name}_want"]
    assert got.shape == want.shape == (NUM_DEVICES * rows, HIDDEN)
    naive = _naive_reduce_scatter(arrays[f"async_{name}_x"])
    if kind == "int":  # exact sums: every order gives the same bits
        assert got.tobytes() == want.tobytes()
        np.testing.assert_array_equal(got.astype(np.float64), naive)
    else:
        np.testing.assert_allclose(got, naive, rtol=1e-5, atol=1e-5)
    if impl == "interpret":  # the synchronous kernel at M=1 sums in the same order
        assert got.tobytes() == arrays[f"async_{name}_sync"].tobytes()
    # The three-kernel calls (start, ici_start, done) give the same bits as start + done.
    assert arrays[f"async_{name}_{impl}_triple"].tobytes() == got.tobytes()


def test_async_reduce_scatter_kernel_has_no_races(results):
    arrays, _ = results
    assert bool(arrays["async_race_detector_ran"])
    assert not bool(arrays["async_races_found"])
    np.testing.assert_array_equal(arrays["async_race_got"],
                                  _naive_reduce_scatter(arrays["async_race_x"]))


ERROR_KEYS = [
    f"{case}_{impl}"
    for case in (
        "rows_not_divisible", "rows_not_divisible_m3", "too_many_microbatches", "zero_microbatches"
    )
    for impl in ("interpret", "reference")
] + ["x_1d"]


@pytest.mark.parametrize("key", ERROR_KEYS)
def test_reduce_scatter_value_errors(results, key):
    _, info = results
    msg = info["errors"][key]
    assert msg is not None, f"{key}: no ValueError raised"
    if key.startswith("rows"):
        assert "divisible" in msg and "x shape" in msg
    elif "microbatches" in key:
        assert "num_microbatches" in msg
    else:
        assert "[N, H]" in msg


# ------------------------------------------------------------------------------------------
# Packed all-gather
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axes", ["both", "die"])
def test_packed_all_gather_bit_exact(results, axes):
    arrays, _ = results
    for part in ("ids", "bits"):
        got, want = arrays[f"ag_{axes}_packed_{part}"], arrays[f"ag_{axes}_ref_{part}"]
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    # what each device must hold: all devices' rows, or those of its chip's two dies
    ids, bits = arrays["ag_ids"], arrays["ag_weight_bits"]
    groups = 1 if axes == "both" else NUM_CHIPS
    per_device = NUM_DEVICES * TOPK_T // groups
    got_ids = arrays[f"ag_{axes}_packed_ids"].reshape(NUM_DEVICES, per_device, TOPK_K)
    got_bits = arrays[f"ag_{axes}_packed_bits"].reshape(NUM_DEVICES, per_device, TOPK_K)
    for dev in range(NUM_DEVICES):
        g = dev // (NUM_DEVICES // groups)  # chip of the device when gathering over "die"
        np.testing.assert_array_equal(got_ids[dev], ids.reshape(groups, per_device, TOPK_K)[g])
        np.testing.assert_array_equal(got_bits[dev], bits.reshape(groups, per_device, TOPK_K)[g])
    flat = got_bits[0].reshape(-1)
    np.testing.assert_array_equal(flat[: SPECIAL_WEIGHT_BITS.size], SPECIAL_WEIGHT_BITS)


@pytest.mark.parametrize("axes", ["both", "die"])
def test_packed_all_gather_is_one_collective(results, axes):
    _, info = results
    assert info[f"ag_{axes}_packed_jaxpr_all_gathers"] == 1
    assert info[f"ag_{axes}_ref_jaxpr_all_gathers"] == 2  # the counter can see two
    assert info[f"ag_{axes}_packed_hlo_all_gathers"] == 1
    assert info[f"ag_{axes}_ref_hlo_all_gathers"] >= 1


@pytest.mark.parametrize("key", ["ag_shape", "ag_dtype"])
def test_packed_all_gather_value_errors(results, key):
    _, info = results
    assert info["errors"][key] is not None, f"{key}: no ValueError raised"


# ------------------------------------------------------------------------------------------
# Cost models (no devices needed)
# ------------------------------------------------------------------------------------------


def test_costs():
    from sglang_tpu_backend.kernels import collectives as col

    n, h = 64, 128
    cost = col.hierarchical_reduce_scatter_cost(n, h, num_chips=4, num_dies=2, num_microbatches=2)
    # stage 1 adds the other die's half: 32 rows; stage 2 adds 3 partials of an 8-row block.
    assert cost.flops == 32 * h + 3 * 8 * h
    assert cost.remote_bytes == (32 + 3 * 8) * h * 4  # sent: the other die's half, 3 blocks
    assert cost.bytes_accessed > n * h * 4  # reads its whole input at least once
    bf16 = col.hierarchical_reduce_scatter_cost(n, h, dtype="bfloat16")
    assert bf16.bytes_accessed * 2 == cost.bytes_accessed
    from sglang_tpu_backend.kernels import collectives_async as ca

    dims = dict(dtype="float32", num_chips=4, num_dies=2)
    start = ca.reduce_scatter_start_cost(n, h, **dims)
    ici = ca.reduce_scatter_ici_start_cost(n, h, **dims)
    done = ca.reduce_scatter_done_cost(n, h, **dims)
    assert start.remote_bytes == 32 * h * 4 and start.flops == 0  # the other die's half
    assert start + ici + done == col.hierarchical_reduce_scatter_cost(n, h, **dims)
    assert ici.remote_bytes == 3 * 8 * h * 4 and ici.flops == 32 * h  # 3 blocks; stage-1 adds
    assert done.remote_bytes == 0 and done.flops == 3 * 8 * h and done.bytes_accessed > 0
    ag = col.packed_all_gather_cost(num_tokens=16, top_k=8, num_devices=8)
    assert ag.flops == 0 and ag.bytes_accessed >= 8 * 16 * 8 * 2 * 4


if __name__ == "__main__":  # the multi-device worker, started by the `results` fixture
    sys.path.insert(0, str(REPO))
    _worker(sys.argv[1])
