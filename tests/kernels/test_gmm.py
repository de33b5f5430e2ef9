"""Grouped matmul: Pallas kernel (TPU interpret mode) vs reference vs a per-group numpy loop.

Tolerances (max abs error relative to max |expected|):
  fp32 in/out, fp32 or fp8-dequantised-to-fp32 weights: 1e-5 (same fp32 products, sum order
  differs);
  bf16 in or out: 1e-2 (one bf16 rounding of the output);
  FP8 weights with bf16 activations (or quantize_lhs): 1e-2 (the kernel rounds the dequantised
  128x128 weight block to bf16 for the MXU, relative error <= 2^-9 per weight).
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_backend.kernels import gmm as G

B = G.GmmBlockSizes


@pytest.fixture(autouse=True)
def _reset_interpret_state():
    yield
    if hasattr(pltpu, "reset_tpu_interpret_mode_state"):
        pltpu.reset_tpu_interpret_mode_state()


def _np_gmm(x, w, group_sizes):
    """Per-group numpy loop in float64: x [M, K], w [G, N, K] (each group's [out, in])."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + int(size), x.shape[0])
        out[start:end] = x[start:end] @ w[g].T
        start = end
    return out


def _np_swiglu(h):
    n = h.shape[1] // 2
    gate, up = h[:, :n], h[:, n:]
    return gate / (1.0 + np.exp(-gate)) * up


def _np_quantize_lhs(x, rel=0.0):
    """Numpy simulation of quantize_lhs: e4m3 per row per 512-wide K chunk, scale amax/448.

    Rounds ``x * (1 / scale)`` in float32 exactly as documented in kernels/gmm.py and returns
    the dequantised values (multiplied in f32) as f64[M, K]. With ``rel`` > 0, returns the pair of dequantisations of
    ``x * (1 / scale) * (1 -+ rel)``: the values a device whose reciprocal or product is off by
    up to ``rel`` (relative) may produce; they differ only at near-ties of the e4m3 rounding.
    """
    x = np.asarray(x, np.float32)
    outs = [np.zeros(x.shape, np.float64) for _ in (-rel, rel)]
    for c0 in range(0, x.shape[1], 512):
        chunk = x[:, c0 : c0 + 512]
        amax = np.abs(chunk).max(axis=1, keepdims=True)
        scale = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1.0)).astype(np.float32)
        inv = (np.float32(1.0) / scale).astype(np.float32)  # the documented x * (1 / scale)
        y = (chunk * inv).astype(np.float64)  # the f32 product, exactly
        for out, r in zip(outs, (-rel, rel)):
            q = np.clip(y * (1 + r), -448, 448).astype(ml_dtypes.float8_e4m3fn)
            out[:, c0 : c0 + 512] = q.astype(np.float32) * scale  # f32, as the reference
    return outs if rel else outs[0]


# The TPU's f32 reciprocal is not correctly rounded (a Newton step on an estimate): 1 / scale
# may be an ulp or two off IEEE's, which moves an e4m3 rounding only where x / scale lies
# within a few f32 ulps of a midpoint between two e4m3 values.
TPU_RECIPROCAL_REL = 2.0**-20


def _np_dequant(q, s):
    q = np.asarray(q.astype(jnp.float32), np.float64)
    s = np.repeat(np.repeat(np.asarray(s, np.float64), 128, axis=1), 128, axis=2)
    return q * s[:, : q.shape[1], : q.shape[2]]


def _inputs(m, k, n, group_sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(group_sizes), n, k)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(group_sizes, jnp.int32)


def _check(actual, expected, tol):
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = max(np.abs(expected).max(), 1e-6)
    err = np.abs(actual - expected).max() / scale
    assert err <= tol, f"max relative error {err:.3g} > {tol}"


# ----------------------------------------------------------------------------- reference


def test_reference_hand_checked():
    """rhs is [G, N, K]: output column n of a row x is x . rhs[g, n]."""
    lhs = jnp.arange(12, dtype=jnp.float32).reshape(6, 2)  # rows 0..5, K = 2
    eye = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # N = 3: [x0, x1, 0]
    rhs = jnp.stack([eye, 2 * eye, jnp.array([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])])
    out = G.ref_gmm(lhs, rhs, jnp.array([2, 0, 3], jnp.int32))  # rows 0-1 g0, 2-4 g2, 5 none
    expected = np.array([[0, 1, 0], [2, 3, 0], [5, 4, 9], [7, 6, 13], [9, 8, 17], [0, 0, 0]],
                        np.float32)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("group_sizes", [[0, 37, 0, 50, 20, 0], [64, 0, 70, 66]])
def test_reference_matches_numpy_loop(group_sizes):
    lhs, rhs, gs = _inputs(200, 64, 48, group_sizes, jnp.float32)
    _check(G.ref_gmm(lhs, rhs, gs), _np_gmm(lhs, rhs, gs), 1e-5)
    h = _np_gmm(lhs, rhs, gs)
    _check(G.ref_gmm_swiglu(lhs, rhs, gs), _np_swiglu(h), 1e-5)


def test_quantize_fp8_blockwise_roundtrip():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((2, 200, 300)), jnp.float32)
    w = w.at[1, :128, :128].set(0.0)  # an all-zero block
    q, s = G.quantize_fp8_blockwise(w)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (2, 2, 3) and s.dtype == jnp.float32
    deq = _np_dequant(q, s)
    np.testing.assert_array_equal(deq[1, :128, :128], 0.0)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of the value, plus the
    # subnormal spacing 2^-9 * scale (scale <= 5 / 448 here) near zero
    np.testing.assert_allclose(deq, np.asarray(w), rtol=2**-4, atol=1e-4)


def test_kernel_reads_every_fp8_bit_pattern_as_its_value():
    """The kernel converts FP8 weights by reading e4m3fn bits as e4m3b11fnuz (value / 16):
    every finite pattern (subnormals, both zeros; not the NaNs 0x7f / 0xff) must come out as
    its e4m3fn value. One-hot rows pick each weight: out[r, n] = w[n, r] (scale 2^-3)."""
    codes = np.arange(128 * 128) % 256
    codes = np.where((codes & 0x7F) == 0x7F, 0, codes).astype(np.uint8).reshape(1, 128, 128)
    rhs = jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))
    scale = jnp.full((1, 1, 1), 0.125, jnp.float32)
    lhs = jnp.eye(128, dtype=jnp.bfloat16)
    out = G.gmm(lhs, rhs, jnp.array([128], jnp.int32), rhs_scale=scale, impl="interpret",
                block_sizes=B(128, 128, 128), out_dtype=jnp.float32)
    want = codes[0].view(ml_dtypes.float8_e4m3fn).astype(np.float32).T * 0.125
    np.testing.assert_array_equal(np.asarray(out), want)
    assert (codes == 0x80).any() and (codes[0] < 8).any()  # -0 and subnormals were in it


def test_vmem_limit_is_raised_only_for_tiles_past_the_default():
    mib = 1 << 20
    bf16 = dict(lhs_bytes=2, rhs_bytes=2, out_bytes=2, dequant_tile=False)
    # the old 128 x 512 x 512 tiles: 2 x (128 KiB + 2 x 512 KiB + 128 KiB) + 2 x 2 x 256 KiB
    small = G.gmm_vmem_bytes(B(128, 512, 512), halves=2, **bf16)
    assert small == 2 * (128 + 2 * 512 + 128) * 1024 + 2 * 2 * 256 * 1024
    assert G.gmm_vmem_limit(small) is None  # the compiler's default scoped limit suffices
    # the 397B gate_up default (tk = K = 4096): two 4 MiB weight tiles, double buffered
    t = G.default_block_sizes(640, 4096, 1024)
    assert (t.tm, t.tk, t.tn) == (128, 4096, 512)
    big = G.gmm_vmem_bytes(t, halves=2, **bf16)
    assert 16 * mib < big < 24 * mib and G.gmm_vmem_limit(big) == int(1.25 * big)
    assert G.gmm_vmem_limit(100 * mib) == 60 * mib  # capped under a TPU7x core's 64 MiB


def test_group_metadata_visits():
    gs = jnp.array([0, 37, 0, 50, 20, 0], jnp.int32)  # 107 rows in groups, M = 150
    meta, used = G.make_group_metadata(gs, 150, 32)
    tile, group, lo, hi, first = np.asarray(meta)
    assert len(tile) == 5 + 6 - 1
    # tiles 0-4 overlap groups {1}, {1, 3}, {3, 4}, {4}, {} (one zeroing visit): 7 in use,
    # the visits past them repeat the last one and do nothing
    assert int(used) == 7 and np.all(hi[7:] == lo[7:]) and first[7:].sum() == 0
    ends = np.cumsum(np.asarray(gs))
    starts = ends - np.asarray(gs)
    seen = set()
    for v in range(len(tile)):
        if hi[v] > lo[v]:
            g = group[v]
            assert (lo[v], hi[v]) == (starts[g], ends[g]) and gs[g] > 0
            assert lo[v] < (tile[v] + 1) * 32 and hi[v] > tile[v] * 32
            seen.add((tile[v], g))
    want = {(t, g) for t in range(5) for g in range(6)
            if gs[g] > 0 and starts[g] < (t + 1) * 32 and ends[g] > t * 32}
    assert seen == want
    assert np.all(np.diff(tile) >= 0)  # a tile's visits are consecutive
    assert sorted(tile[first == 1]) == list(range(5))  # every tile starts exactly once


def test_group_metadata_skip_tail_visits_no_tile_past_the_groups():
    gs = jnp.array([0, 37, 0, 50, 20, 0], jnp.int32)  # rows 0-106 in groups: tiles 0-3 of 32
    full = np.asarray(G.make_group_metadata(gs, 150, 32)[0])
    meta, used = G.make_group_metadata(gs, 150, 32, skip_tail=True)
    tile, group, lo, hi, first = np.asarray(meta)
    assert set(tile) == {0, 1, 2, 3}  # tile 4 (rows 128-149) is never visited
    assert int(used) == 6  # the grid runs these only (the zeroing visit of tile 4 is gone)
    assert sorted(tile[first == 1]) == [0, 1, 2, 3]
    live = hi > lo  # the computing visits are the same as without skip_tail
    full_live = full[3] > full[2]
    assert sorted(zip(tile[live], group[live])) == sorted(zip(full[0][full_live], full[1][full_live]))
    assert np.all(np.diff(tile) >= 0)
    # no rows in any group: one zeroing visit of tile 0, nothing else
    meta, used = G.make_group_metadata(jnp.zeros(6, jnp.int32), 150, 32, skip_tail=True)
    tile, _, lo, hi, first = np.asarray(meta)
    assert set(tile) == {0} and first[0] == 1 and first[1:].sum() == 0 and np.all(hi == lo)
    assert int(used) == 1


def test_next_groups_name_each_visits_next_run():
    """The weight pipeline's lookahead: the group of the next run of visits in use, -1 for
    the last run; visits past the ones in use never start a run."""
    from sglang_tpu_backend.kernels.gmm_weight_pipeline import next_groups

    group = jnp.asarray([1, 1, 3, 4, 4, 4, 2, 2, 2], jnp.int32)
    assert next_groups(group, 9).tolist() == [3, 3, 4, 2, 2, 2, -1, -1, -1]
    assert next_groups(group, 5).tolist() == [3, 3, 4, -1, -1, -1, -1, -1, -1]
    # the visit list of a layout: runs follow the groups that have rows
    meta, used = G.make_group_metadata(jnp.asarray([0, 37, 0, 50, 20, 0]), 150, 32)
    nxt = np.asarray(next_groups(meta[1], used))[: int(used)]
    groups = np.asarray(meta[1])[: int(used)]
    for v in range(int(used)):
        later = [g for g in groups[v + 1:] if g != groups[v]]
        assert nxt[v] == (later[0] if later else -1)


# ----------------------------------------------------------------------------- kernel

CASES = [
    # (M, K, N, group_sizes, dtype, blocks): empty first/middle/last groups, rows past the sum
    pytest.param(150, 256, 256, [0, 37, 0, 50, 20, 0], jnp.float32, B(32, 128, 128),
                 marks=pytest.mark.jax_versions),  # gmm and gmm_swiglu on jax 0.12 too
    # sizes not multiples of the tile, default tiles (tm=128, one visit per group boundary)
    (200, 128, 256, [64, 0, 70, 66], jnp.bfloat16, None),
    # K, N not multiples of 128 (padded), every row in a group past the first 60 -> zeros
    (64, 200, 130, [10, 20, 0, 30], jnp.float32, None),
    # one K tile, so the weights are fetched a run ahead (gmm_weight_pipeline): 2 N tiles,
    # runs of 1-3 visits, empty groups between them
    (150, 128, 256, [0, 37, 0, 50, 20, 0], jnp.float32, B(32, 128, 128)),
]


@pytest.mark.parametrize("m,k,n,group_sizes,dtype,blocks", CASES)
def test_gmm_kernel(m, k, n, group_sizes, dtype, blocks):
    lhs, rhs, gs = _inputs(m, k, n, group_sizes, dtype)
    out = G.gmm(lhs, rhs, gs, impl="interpret", block_sizes=blocks)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    _check(out, G.ref_gmm(lhs, rhs, gs), tol)
    _check(out, _np_gmm(lhs, rhs, gs), tol)
    np.testing.assert_array_equal(np.asarray(out[int(np.sum(group_sizes)):], np.float32), 0.0)


@pytest.mark.parametrize("m,k,n,group_sizes,dtype,blocks", [CASES[0], CASES[1], CASES[3]])
def test_gmm_swiglu_kernel(m, k, n, group_sizes, dtype, blocks):
    lhs, rhs, gs = _inputs(m, k, 2 * n, group_sizes, dtype, seed=3)
    out = G.gmm_swiglu(lhs, rhs, gs, impl="interpret", block_sizes=blocks, out_dtype=jnp.float32)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    _check(out, G.ref_gmm_swiglu(lhs, rhs, gs), tol)
    _check(out, _np_swiglu(_np_gmm(lhs, rhs, gs)), tol)


@pytest.mark.parametrize("swiglu", [False, True])
def test_gmm_skip_tail_rows_in_groups_match(swiglu):
    """skip_tail leaves rows past the groups unspecified; the rows in groups are unchanged."""
    m, k, n, sizes = 150, 256, 256, [0, 37, 0, 50, 20, 0]
    lhs, rhs, gs = _inputs(m, k, 2 * n if swiglu else n, sizes, jnp.float32, seed=11)
    f, ref = (G.gmm_swiglu, G.ref_gmm_swiglu) if swiglu else (G.gmm, G.ref_gmm)
    out = f(lhs, rhs, gs, impl="interpret", block_sizes=B(32, 128, 128), skip_tail=True,
            cost_rows=60)
    used = sum(sizes)
    _check(out[:used], ref(lhs, rhs, gs)[:used], 1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_gmm_row_split_output(fp8):
    """row_split=P returns [M, P, N/P]: the [M, N] result, each row cut into P pieces."""
    m, k, n, sizes = 96, 256, 512, [30, 0, 41, 25]
    lhs, rhs, gs = _inputs(m, k, n, sizes, jnp.bfloat16, seed=13)
    scale = None
    if fp8:
        rhs, scale = G.quantize_fp8_blockwise(rhs)
    want = G.gmm(lhs, rhs, gs, rhs_scale=scale, impl="interpret", out_dtype=jnp.float32)
    for impl in ("interpret", "xla", "reference"):
        out = G.gmm(lhs, rhs, gs, rhs_scale=scale, impl=impl, out_dtype=jnp.float32,
                    row_split=2, skip_tail=True)
        assert out.shape == (m, 2, 256)
        _check(out.reshape(m, n)[: sum(sizes)], want[: sum(sizes)], 1e-2)
    with pytest.raises(ValueError, match="row_split"):
        G.gmm(lhs, rhs, gs, rhs_scale=scale, row_split=8, impl="interpret")  # N % (128 * 8) != 0


def test_gmm_under_jit():
    lhs, rhs, gs = _inputs(96, 128, 128, [30, 0, 50], jnp.float32, seed=5)
    f = jax.jit(functools.partial(G.gmm, impl="interpret"))
    _check(f(lhs, rhs, gs), _np_gmm(lhs, rhs, gs), 1e-5)


# The kernel multiplies FP8 weights unscaled (exact in bf16) and scales the f32 products, so a
# bf16 lhs is as close to the float64 result as an f32 one (it rounded weight x scale to bf16
# before: ~2e-3 off).
@pytest.mark.parametrize(
    "dtype,swiglu,tol",
    [(jnp.float32, False, 1e-5), (jnp.bfloat16, False, 1e-5),
     pytest.param(jnp.bfloat16, True, 1e-5, marks=pytest.mark.jax_versions)],
)
def test_gmm_fp8_rhs(dtype, swiglu, tol):
    m, k, n, sizes = 120, 256, 256, [0, 40, 0, 45, 20]
    lhs, w, gs = _inputs(m, k, 2 * n if swiglu else n, sizes, dtype, seed=7)
    q, s = G.quantize_fp8_blockwise(w)
    f, ref = (G.gmm_swiglu, G.ref_gmm_swiglu) if swiglu else (G.gmm, G.ref_gmm)
    out = f(lhs, q, gs, rhs_scale=s, impl="interpret", out_dtype=jnp.float32,
            block_sizes=B(32, 128, 128))
    _check(out, ref(lhs, q, gs, rhs_scale=s, out_dtype=jnp.float32), tol)
    h = _np_gmm(lhs, _np_dequant(q, s), gs)  # vs the dequantised weights in float64
    _check(out, _np_swiglu(h) if swiglu else h, tol)


@pytest.mark.parametrize("tm", [16, 32, 128])
def test_gmm_fp8_masks_other_rows_out_of_the_product(tm):
    """FP8 tiles mask rows of other groups in the product, not the lhs: rows past the groups
    hold inf here, and must neither reach their own output (zeros) nor any other row."""
    m, k, n, sizes = 120, 256, 256, [0, 40, 0, 45, 20]  # rows from 105 on: past the groups
    lhs, w, gs = _inputs(m, k, n, sizes, jnp.bfloat16, seed=5)
    lhs = lhs.at[105:].set(jnp.inf)
    q, s = G.quantize_fp8_blockwise(w)
    out = np.asarray(G.gmm(lhs, q, gs, rhs_scale=s, impl="interpret", out_dtype=jnp.float32,
                           block_sizes=B(tm, 128, 128)))
    assert np.all(out[105:] == 0)
    _check(out[:105], _np_gmm(lhs[:105], _np_dequant(q, s), gs)[:105], 1e-5)


@pytest.mark.parametrize("fp8,swiglu,padded", [(False, False, False), (False, True, True),
                                               pytest.param(True, True, False,
                                                            marks=pytest.mark.jax_versions),
                                               (True, False, False)])
def test_stacked_weights_read_at_layer(fp8, swiglu, padded):
    """rhs [Lyr, G, N, K] with a traced layer equals rhs[layer] passed alone (kernel and ref)."""
    m, k, n, sizes = 96, 256, 192 if padded else 256, [30, 0, 41, 25]
    width = 2 * n if swiglu else n
    stack = [_inputs(m, k, width, sizes, jnp.float32, seed=20 + i) for i in range(3)]
    lhs, gs = stack[0][0], stack[0][2]
    rhs = jnp.stack([w for _, w, _ in stack])  # [3, G, N, K]
    scale = None
    if fp8:
        qs = [G.quantize_fp8_blockwise(w) for w in rhs]
        rhs, scale = jnp.stack([q for q, _ in qs]), jnp.stack([sc for _, sc in qs])
    f = G.gmm_swiglu if swiglu else G.gmm
    for impl in ("interpret", "reference"):
        run = jax.jit(lambda l: f(lhs, rhs, gs, rhs_scale=scale, impl=impl, layer=l,
                                  block_sizes=B(32, 128, 128)))
        alone = f(lhs, rhs[1], gs, rhs_scale=None if scale is None else scale[1], impl=impl,
                  block_sizes=B(32, 128, 128))
        np.testing.assert_array_equal(np.asarray(run(jnp.int32(1))), np.asarray(alone))
    with pytest.raises(ValueError, match="stacked"):
        f(lhs, rhs[0], gs, rhs_scale=None if scale is None else scale[0], layer=0)


@pytest.mark.parametrize(
    "k,dtype,swiglu", [pytest.param(256, jnp.bfloat16, False, marks=pytest.mark.jax_versions),
                       (640, jnp.float32, False), (256, jnp.float32, True)]
)
def test_gmm_quantize_lhs_vs_numpy_simulation(k, dtype, swiglu):
    m, n, sizes = 72, 128, [20, 0, 40, 5]
    lhs, w, gs = _inputs(m, k, 2 * n if swiglu else n, sizes, dtype, seed=11)
    lhs = lhs * jnp.asarray(np.random.default_rng(2).uniform(0.1, 10.0, (m, 1)), dtype)  # row ranges
    q, s = G.quantize_fp8_blockwise(w)
    # the reference's quantised activations are the simulation's: bit for bit on IEEE
    # arithmetic, and on a TPU off by one e4m3 step only at near-ties (TPU_RECIPROCAL_REL)
    x_ref = np.asarray(G.quantize_lhs_reference(lhs), np.float64)
    x_sim = _np_quantize_lhs(lhs)
    if jax.default_backend() == "tpu":
        lo, hi = _np_quantize_lhs(lhs, TPU_RECIPROCAL_REL)
        off = x_ref != x_sim
        assert np.all((x_ref == lo) | (x_ref == hi)), "a difference that is not a near-tie"
        assert off.mean() < 1e-2, f"{off.sum()} of {off.size} differ: more than near-ties"
    else:
        np.testing.assert_array_equal(x_ref, x_sim)
    f = G.gmm_swiglu if swiglu else G.gmm
    out = f(lhs, q, gs, rhs_scale=s, quantize_lhs=True, impl="interpret", out_dtype=jnp.float32)
    h = _np_gmm(x_ref, _np_dequant(q, s), gs)  # on the device's own quantisation
    expected = _np_swiglu(h) if swiglu else h
    _check(out, expected, 1e-2)
    ref = (G.ref_gmm_swiglu if swiglu else G.ref_gmm)(
        lhs, q, gs, rhs_scale=s, quantize_lhs=True, out_dtype=jnp.float32)
    _check(ref, expected, 1e-5)  # the reference multiplies what it quantised, in f32
    # quantising the activations must matter at all (the checks above are not vacuous)
    assert np.abs(_np_gmm(lhs, _np_dequant(q, s), gs) - h).max() > 1e-4


# ----------------------------------------------------------------------------- errors


def _bad_calls():
    lhs, rhs, gs = _inputs(16, 128, 128, [8, 8], jnp.float32)
    q, s = G.quantize_fp8_blockwise(rhs)
    return [
        lambda: G.gmm(lhs, rhs[:, :, :64], gs),  # K mismatch
        lambda: G.gmm(lhs, rhs, gs[:1]),  # group count mismatch
        lambda: G.gmm(lhs[0], rhs, gs),  # lhs not 2-D
        lambda: G.gmm(lhs, rhs, gs.astype(jnp.float32)),  # non-integer group sizes
        lambda: G.gmm_swiglu(lhs, rhs[:, :127], gs),  # odd 2N
        lambda: G.gmm(lhs, q, gs),  # fp8 without scale
        lambda: G.gmm(lhs, rhs, gs, rhs_scale=s),  # scale without fp8
        lambda: G.gmm(lhs, q, gs, rhs_scale=s[:, :, :0]),  # wrong scale shape
        lambda: G.gmm(lhs, rhs, gs, quantize_lhs=True),  # quantize_lhs needs fp8
        lambda: G.gmm(lhs, rhs, gs, impl="interpret", block_sizes=B(10, 128, 128)),
        lambda: G.gmm(lhs, q, gs, rhs_scale=s, quantize_lhs=True, impl="interpret",
                      block_sizes=B(16, 256, 128)),  # tk != one sub-channel
        lambda: G.gmm(lhs, rhs, gs, impl="bogus"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_invalid_inputs_raise(case):
    with pytest.raises(ValueError):
        _bad_calls()[case]()


def test_cost_model():
    c = G.gmm_cost(256, 4096, 1024, 64, lhs_itemsize=2, rhs_itemsize=1, out_itemsize=2)
    assert c.flops == 2 * 256 * 4096 * 1024
    assert c.bytes_accessed == 256 * 4096 * 2 + 64 * 4096 * 1024 + 4 * 64 * 32 * 8 + 256 * 1024 * 2
    cs = G.gmm_swiglu_cost(256, 4096, 1024, 64)
    assert cs.flops > 2 * 256 * 4096 * 2048 and cs.transcendentals == 256 * 1024


# ----------------------------------------------------------------------------- XLA path


def test_xla_tile_plan_covers_each_row_once():
    gs = jnp.array([0, 5, 0, 17, 8, 0, 1], jnp.int32)  # 31 rows in groups, M = 40, tm = 8
    plan = jax.jit(G.xla_tile_plan, static_argnums=(1, 2))
    group, rows, slot = (np.asarray(a) for a in plan(gs, 40, 8))
    assert len(group) == min(5 + 7, (40 + 7 * 7) // 8)
    ends = np.cumsum(np.asarray(gs))
    flat = rows.reshape(-1)
    for r in range(40):
        hits = np.flatnonzero(flat == r)
        if r < 31:
            assert list(hits) == [slot[r]]  # exactly one slot, and row_slot points at it
            g = group[slot[r] // 8]
            assert (ends[g] - gs[g]) <= r < ends[g]
        else:
            assert len(hits) == 0 and slot[r] == -1
    assert np.all(flat[flat != 40] < 31)


XLA_CASES = [
    # (M, K, N, group_sizes, swiglu): empty first/middle/last groups, sum < M, sizes not
    # multiples of the tile rows, a group spanning several tiles, a group of one row, no rows
    (150, 64, 48, [0, 37, 0, 50, 20, 0], False),
    pytest.param(40, 256, 128, [1, 0, 17, 0, 9, 3], True, marks=pytest.mark.jax_versions),
    (9, 32, 16, [0, 0, 0], True),
]


@pytest.mark.parametrize("m,k,n,group_sizes,swiglu", XLA_CASES)
def test_xla_equals_reference(m, k, n, group_sizes, swiglu):
    lhs, rhs, gs = _inputs(m, k, 2 * n if swiglu else n, group_sizes, jnp.float32, seed=31)
    f, ref = (G.gmm_swiglu, G.ref_gmm_swiglu) if swiglu else (G.gmm, G.ref_gmm)
    lb, rb = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)

    @jax.jit
    def both(lhs, rhs, lb, rb, gs):
        return (f(lhs, rhs, gs, impl="xla"), ref(lhs, rhs, gs),
                f(lb, rb, gs, impl="xla"), ref(lb, rb, gs, out_dtype=jnp.float32))

    out, want, out_bf16, want_bf16 = both(lhs, rhs, lb, rb, gs)
    assert out.shape == (m, n) and out.dtype == jnp.float32 and out_bf16.dtype == jnp.bfloat16
    _check(out, want, 1e-5)
    np.testing.assert_array_equal(np.asarray(out[int(np.sum(group_sizes)):]), 0.0)
    _check(out_bf16, want_bf16, 1e-2)  # one bf16 rounding of the output


def test_xla_tile_rows_and_small_tiles():
    """Tile rows follow the mean group (clamped); a small tile forces several tiles per group
    and the loop over them still equals the reference."""
    assert G.xla_tile_rows(512, 64) == G.XLA_TILE_ROWS  # decode: 8 rows per expert -> floor
    assert G.xla_tile_rows(2048, 64) == 32
    assert G.xla_tile_rows(10**6, 64) == G.XLA_MAX_TILE_ROWS
    m, k, n, sizes = 150, 64, 48, [0, 37, 0, 50, 20, 0]
    lhs, rhs, gs = _inputs(m, k, n, sizes, jnp.float32, seed=32)
    out = jax.jit(lambda a, b, g: G.xla_gmm_impl(a, b[None], g, None, 0, False, jnp.float32,
                                                 False, tm=8))(lhs, rhs, gs)
    _check(out, G.ref_gmm(lhs, rhs, gs), 1e-5)
    np.testing.assert_array_equal(np.asarray(out[sum(sizes):]), 0.0)


def test_auto_resolves_to_xla_off_tpu():
    from sglang_tpu_backend.kernels import dispatch

    if jax.default_backend() == "tpu":
        pytest.skip("auto is Pallas on a TPU")
    assert dispatch.resolve("auto", has_xla=True) == "xla"
    assert dispatch.resolve("auto") == "reference"  # ops without a separate XLA path
    assert dispatch.resolve("xla") == "reference"
    assert dispatch.resolve("reference", has_xla=True) == "reference"


@pytest.mark.parametrize("swiglu,quantize", [(False, False), (True, True)])
def test_xla_fp8_stacked_layer_equals_reference(swiglu, quantize):
    """FP8 block scales (and quantised activations) with stacked [Lyr, G, N, K] weights read
    at a traced layer."""
    m, k, n, sizes = 50, 256, 128 if swiglu else 192, [7, 0, 20, 1, 9]
    width = 2 * n if swiglu else n
    ws = [_inputs(m, k, width, sizes, jnp.float32, seed=40 + i)[1] for i in range(3)]
    lhs, _, gs = _inputs(m, k, width, sizes, jnp.float32, seed=40)
    qs = [G.quantize_fp8_blockwise(w) for w in ws]
    rhs, scale = jnp.stack([q for q, _ in qs]), jnp.stack([s for _, s in qs])  # [3, G, ...]
    f, ref = (G.gmm_swiglu, G.ref_gmm_swiglu) if swiglu else (G.gmm, G.ref_gmm)

    @jax.jit
    def both(layer):
        return (f(lhs, rhs, gs, rhs_scale=scale, quantize_lhs=quantize, impl="xla", layer=layer),
                ref(lhs, rhs[2], gs, rhs_scale=scale[2], quantize_lhs=quantize))

    out, want = both(jnp.int32(2))
    _check(out, want, 1e-5)
    np.testing.assert_array_equal(np.asarray(out[37:]), 0.0)
