"""Routing metadata, gather_rows and gather_reduce (TPU interpret mode), and the composed MoE.

Tolerances: gathers are copies (exact). gather_reduce: fp32 1e-6 relative, bf16 output 1e-2
(one bf16 rounding). Composed fp32 MoE vs dense float64 numpy: 1e-4 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_backend.kernels import gmm as G
from sglang_tpu_backend.kernels import routing as R

# Several grid steps at the smallest blocks legal on a TPU (Mosaic's SMEM block rules: a
# rank-1 block a power of two >= 128, a [tokens, k] block a multiple of 8 rows).
BLOCKS = R.RoutingBlockSizes(gather_rows=128, reduce_tokens=8)


@pytest.fixture(autouse=True)
def _reset_interpret_state():
    yield
    if hasattr(pltpu, "reset_tpu_interpret_mode_state"):
        pltpu.reset_tpu_interpret_mode_state()


def _check(actual, expected, tol):
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-6)
    assert err <= tol, f"max relative error {err:.3g} > {tol}"


# ----------------------------------------------------------------------------- metadata


def test_route_metadata_hand_checked():
    ids = jnp.array([[1, 0], [1, 2], [0, 1]], jnp.int32)
    token_idx, gs, rows = R.route_metadata(ids, 3)
    np.testing.assert_array_equal(token_idx, [0, 2, 0, 1, 2, 1])
    np.testing.assert_array_equal(gs, [2, 3, 1])
    np.testing.assert_array_equal(rows, [[2, 0], [3, 5], [1, 4]])
    # only global expert 1 is local
    token_idx, gs, rows = R.route_metadata(ids, 1, expert_offset=1)
    np.testing.assert_array_equal(token_idx, [0, 1, 2, -1, -1, -1])
    np.testing.assert_array_equal(gs, [3])
    np.testing.assert_array_equal(rows, [[0, -1], [1, -1], [-1, 2]])


def test_route_metadata_consistent_under_jit():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 16, (40, 4)), jnp.int32)
    fn = jax.jit(R.route_metadata, static_argnums=1)
    token_idx, gs, rows = fn(ids, 6, expert_offset=jnp.int32(5))  # traced offset
    token_idx, gs, rows = map(np.asarray, (token_idx, gs, rows))
    ids = np.asarray(ids)
    local = (ids >= 5) & (ids < 11)
    np.testing.assert_array_equal(gs, [(ids == 5 + e).sum() for e in range(6)])
    assert (rows >= 0).sum() == local.sum() == gs.sum()
    np.testing.assert_array_equal(rows >= 0, local)
    for t, j in zip(*np.nonzero(local)):  # each local assignment sits in its expert's group
        r = rows[t, j]
        assert token_idx[r] == t
        assert np.cumsum(gs)[ids[t, j] - 5] > r >= np.cumsum(gs)[ids[t, j] - 5] - gs[ids[t, j] - 5]
    assert np.all(token_idx[gs.sum():] == -1)


# ----------------------------------------------------------------------------- kernels


@pytest.mark.jax_versions
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_rows_kernel(dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((23, 256)), dtype)
    idx = rng.integers(-1, 23, 300).astype(np.int32)  # repeats, -1 entries, 300 % 128 != 0
    idx[:3] = [-1, 22, 0]
    out = R.gather_rows(x, jnp.asarray(idx), impl="interpret", block_sizes=BLOCKS)
    expected = np.where(idx[:, None] >= 0, np.asarray(x, np.float32)[np.maximum(idx, 0)], 0)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
    np.testing.assert_array_equal(np.asarray(R.ref_gather_rows(x, jnp.asarray(idx)), np.float32), expected)


@pytest.mark.jax_versions
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_gather_reduce_kernel(dtype, tol):
    rng = np.random.default_rng(2)
    t, k, m, h = 37, 3, 60, 128
    y = jnp.asarray(rng.standard_normal((m, h)), dtype)
    rows = rng.integers(-1, m, (t, k)).astype(np.int32)
    rows[0] = -1  # a token with no local assignment -> zeros
    w = rng.random((t, k)).astype(np.float32)
    out = R.gather_reduce(y, jnp.asarray(rows), jnp.asarray(w), impl="interpret", block_sizes=BLOCKS)
    yn = np.asarray(y, np.float64)
    expected = np.zeros((t, h))
    for ti in range(t):  # naive loop
        for j in range(k):
            if rows[ti, j] >= 0:
                expected[ti] += w[ti, j] * yn[rows[ti, j]]
    assert out.dtype == dtype and out.shape == (t, h)
    _check(out, expected, tol)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)
    _check(R.ref_gather_reduce(y, jnp.asarray(rows), jnp.asarray(w)), expected, tol)


@pytest.mark.parametrize("num_rows", [0, 128, 200, 300])
def test_gather_rows_num_rows_writes_the_leading_rows(num_rows):
    """With num_rows the rows before it are gathered as usual (later ones are unspecified)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((23, 256)), jnp.float32)
    idx = rng.integers(-1, 23, 300).astype(np.int32)
    out = R.gather_rows(x, jnp.asarray(idx), num_rows=jnp.int32(num_rows), cost_rows=7,
                        impl="interpret", block_sizes=BLOCKS)
    expected = np.where(idx[:, None] >= 0, np.asarray(x)[np.maximum(idx, 0)], 0)
    assert out.shape == (300, 256)
    np.testing.assert_array_equal(np.asarray(out)[:num_rows], expected[:num_rows])


def test_gather_reduce_takes_the_row_split_view():
    """y as [M, P, H/P] (what gmm(row_split=P) writes) gives the same sums as y [M, H]."""
    rng = np.random.default_rng(4)
    t, k, m, h = 19, 3, 40, 4096
    y = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    rows = jnp.asarray(rng.integers(-1, m, (t, k)), jnp.int32)
    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    p = R.row_split(h, jnp.bfloat16)
    for impl in ("interpret", "reference"):
        flat = R.gather_reduce(y, rows, w, impl=impl, block_sizes=BLOCKS)
        split = R.gather_reduce(y.reshape(m, p, h // p), rows, w, cost_reads=10, impl=impl,
                                block_sizes=BLOCKS)
        np.testing.assert_array_equal(np.asarray(split, np.float32), np.asarray(flat, np.float32))
    with pytest.raises(ValueError, match="row_split"):
        R.gather_reduce(y.reshape(m, 2 * p, h // (2 * p)), rows, w, impl="interpret")


def test_row_split():
    # largest power of two <= the dtype's tile rows with H % (128 P) == 0, else 1
    assert R.row_split(4096, jnp.bfloat16) == 16 and R.row_split(4096, jnp.float32) == 8
    assert R.row_split(4096, jnp.float8_e4m3fn) == 32 and R.row_split(4096, jnp.int8) == 32
    assert R.row_split(128, jnp.bfloat16) == 1 and R.row_split(384, jnp.float32) == 1
    assert R.row_split(512, jnp.bfloat16) == 4 and R.row_split(2560, jnp.bfloat16) == 4
    assert R.row_split(200, jnp.float32) == 1  # not a lane multiple: one unsplit row


# (dtype, H): every row-split P of the [rows, P, H/P] view -- 1 (H = 128, 384 = 3 * 128,
# 200 not a lane multiple), 2, 8 (f32 full tile), 16 (bf16 full tile), 32 (int8 full tile).
LAYOUT_CASES = [
    (jnp.float32, 128), (jnp.bfloat16, 128), (jnp.float32, 384), (jnp.float32, 200),
    (jnp.bfloat16, 256), (jnp.float32, 1024), (jnp.bfloat16, 2048), (jnp.int8, 4096),
]


@pytest.mark.parametrize("dtype,h", LAYOUT_CASES)
def test_gather_rows_layouts(dtype, h):
    rng = np.random.default_rng(5)
    t, m = 9, 37
    x = jnp.asarray(rng.integers(-100, 100, (t, h)), dtype)  # exact in every dtype
    idx = rng.integers(-2, t + 3, m).astype(np.int32)  # negatives and out-of-range (>= T)
    idx[:4] = [t, -1, t - 1, 0]
    out = R.gather_rows(x, jnp.asarray(idx), impl="interpret", block_sizes=BLOCKS)
    valid = (idx >= 0) & (idx < t)
    expected = np.where(valid[:, None], np.asarray(x, np.float32)[np.where(valid, idx, 0)], 0)
    assert out.dtype == dtype and out.shape == (m, h)
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)


@pytest.mark.parametrize("dtype,h", [(jnp.float32, 1024), (jnp.bfloat16, 2048), (jnp.bfloat16, 256),
                                     (jnp.float32, 200)])
def test_gather_reduce_layouts(dtype, h):
    rng = np.random.default_rng(6)
    t, k, m = 11, 3, 20
    y = jnp.asarray(rng.standard_normal((m, h)), dtype)
    rows = rng.integers(-1, m + 4, (t, k)).astype(np.int32)  # -1 and out-of-range (>= M) skipped
    rows[0] = [m, -1, m + 1]  # nothing valid -> zeros
    w = rng.random((t, k)).astype(np.float32)
    w[rows < 0] = np.nan  # weights of skipped slots never reach the sum
    out = R.gather_reduce(y, jnp.asarray(rows), jnp.asarray(w), impl="interpret", block_sizes=BLOCKS)
    valid = (rows >= 0) & (rows < m)
    yn = np.asarray(y, np.float64)
    expected = np.einsum("tk,tkh->th", np.where(valid, w, 0), yn[np.where(valid, rows, 0)])
    assert out.dtype == dtype and out.shape == (t, h)
    _check(out, expected, 1e-6 if dtype == jnp.float32 else 1e-2)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)


def test_illegal_tpu_block_sizes_are_named():
    """A block size Mosaic would reject raises first, naming the field; one block covering
    every row is legal at any size."""
    x = jnp.zeros((23, 256), jnp.float32)
    idx = jnp.zeros((300,), jnp.int32)
    with pytest.raises(ValueError, match="RoutingBlockSizes.gather_rows=16"):
        R.gather_rows(x, idx, impl="interpret", block_sizes=R.RoutingBlockSizes(gather_rows=16))
    with pytest.raises(ValueError, match="RoutingBlockSizes.gather_rows=96"):
        R.gather_rows(x, idx, impl="interpret", block_sizes=R.RoutingBlockSizes(gather_rows=96))
    rows, w = jnp.zeros((37, 3), jnp.int32), jnp.zeros((37, 3), jnp.float32)
    with pytest.raises(ValueError, match="RoutingBlockSizes.reduce_tokens=4"):
        R.gather_reduce(jnp.zeros((60, 128)), rows, w, impl="interpret",
                        block_sizes=R.RoutingBlockSizes(reduce_tokens=4))
    small = R.gather_rows(x, idx[:10], impl="interpret",  # 16 rows, one block: legal
                          block_sizes=R.RoutingBlockSizes(gather_rows=16))
    assert small.shape == (10, 256)


def test_gather_default_blocks_single_and_many_steps():
    # default blocks: M < 128 is one whole-array SMEM block; M = 300 is three 128-row steps
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    for m in (24, 300):
        idx = rng.integers(-1, 40, m).astype(np.int32)
        out = R.gather_rows(x, jnp.asarray(idx), impl="interpret")
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(R.ref_gather_rows(x, jnp.asarray(idx)), np.float32))
    rows = rng.integers(-1, 300, (70, 4)).astype(np.int32)  # 70 tokens: three 32-token steps
    w = rng.random((70, 4)).astype(np.float32)
    y = jnp.asarray(rng.standard_normal((300, 256)), jnp.float32)
    out = R.gather_reduce(y, jnp.asarray(rows), jnp.asarray(w), impl="interpret")
    _check(out, R.ref_gather_reduce(y, jnp.asarray(rows), jnp.asarray(w)), 1e-6)


# ----------------------------------------------------------------------------- composed MoE


def _moe_problem(t=24, h=128, inter=128, e=8, k=2, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h)).astype(np.float32)
    router = rng.standard_normal((h, e)).astype(np.float32) / np.sqrt(h)
    w_gate_up = (rng.standard_normal((e, 2 * inter, h)) / np.sqrt(h)).astype(np.float32)
    w_down = (rng.standard_normal((e, h, inter)) / np.sqrt(inter)).astype(np.float32)
    logits = x @ router
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    ids = np.argsort(-probs, axis=1)[:, :k].astype(np.int32)  # top-k
    weights = np.take_along_axis(probs, ids, 1)
    weights = (weights / weights.sum(1, keepdims=True)).astype(np.float32)
    return x, w_gate_up, w_down, ids, weights


def _dense_moe(x, w_gate_up, w_down, ids, weights, experts):
    """Per-token float64 loop over its top-k experts, restricted to ``experts``; weights
    [E, out, in] (gate_up [E, 2I, H], down [E, H, I])."""
    inter = w_down.shape[2]
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            if e not in experts:
                continue
            hgu = x[t].astype(np.float64) @ w_gate_up[e].T
            gate, up = hgu[:inter], hgu[inter:]
            out[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e].T)
    return out


def _moe_device(x, w_gate_up, w_down, ids, weights, offset, num_local):
    token_idx, gs, rows = R.route_metadata(jnp.asarray(ids), num_local, expert_offset=offset)
    xs = R.gather_rows(jnp.asarray(x), token_idx, impl="interpret")  # [T*k, H]
    local = slice(offset, offset + num_local)
    hs = G.gmm_swiglu(xs, jnp.asarray(w_gate_up[local]), gs, impl="interpret")  # [T*k, I]
    ys = G.gmm(hs, jnp.asarray(w_down[local]), gs, impl="interpret")  # [T*k, H]
    return R.gather_reduce(ys, rows, jnp.asarray(weights), impl="interpret")  # [T, H]


def test_composed_moe_all_local():
    x, wgu, wd, ids, w = _moe_problem()
    out = _moe_device(x, wgu, wd, ids, w, 0, 8)
    _check(out, _dense_moe(x, wgu, wd, ids, w, range(8)), 1e-4)


def test_composed_moe_partial_local_ranges():
    x, wgu, wd, ids, w = _moe_problem(seed=4)
    dense = _dense_moe(x, wgu, wd, ids, w, range(8))
    parts = []
    for offset in (0, 5):  # two "devices": experts 0-4 and 5-7
        num_local = 5 if offset == 0 else 3
        part = _moe_device(x, wgu, wd, ids, w, offset, num_local)
        _check(part, _dense_moe(x, wgu, wd, ids, w, range(offset, offset + num_local)), 1e-4)
        parts.append(np.asarray(part, np.float64))
    _check(parts[0] + parts[1], dense, 1e-4)  # what the reduce-scatter would sum


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call",
    [
        lambda: R.route_metadata(jnp.zeros((4,), jnp.int32), 2),
        lambda: R.route_metadata(jnp.zeros((4, 2), jnp.int32), 0),
        lambda: R.gather_rows(jnp.zeros((4,)), jnp.zeros((3,), jnp.int32)),
        lambda: R.gather_rows(jnp.zeros((4, 8)), jnp.zeros((3, 1), jnp.int32)),
        lambda: R.gather_rows(jnp.zeros((4, 8)), jnp.zeros((3,), jnp.float32)),
        lambda: R.gather_reduce(jnp.zeros((4, 8)), jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 3))),
        lambda: R.gather_reduce(jnp.zeros((4,)), jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2))),
        lambda: R.gather_reduce(jnp.zeros((4, 8)), jnp.zeros((2, 2)), jnp.zeros((2, 2))),
        lambda: R.gather_rows(jnp.zeros((4, 8)), jnp.zeros((3,), jnp.int32), impl="gpu"),
    ],
)
def test_invalid_inputs_raise(call):
    with pytest.raises(ValueError):
        call()


def test_cost_models():
    assert R.gather_rows_cost(100, 4096, itemsize=2).bytes_accessed == 2 * 100 * 4096 * 2 + 400
    c = R.gather_reduce_cost(10, 4, 64, itemsize=4)
    assert c.flops == 2 * 10 * 4 * 64 and c.bytes_accessed == 50 * 64 * 4 + 8 * 40
