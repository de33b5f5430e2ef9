"""Tests for kernels/gdn.py: fused causal conv1d + Gated DeltaNet (recurrent and chunked).

Tolerances (max abs error; inputs are O(1), outputs O(0.1-1)):
  fp32 everywhere: 2e-5 between the chunked, recurrent and rearranged-decode forms (same math,
    different summation order; 5e-5 on a TPU, see F32_TOL), 1e-4 against the float64 numpy
    loop and transformers.
  bf16 inputs/outputs or bf16 state: 1.6e-2 (2 bf16 ulps of the state values in [1, 2); the
    kernel and the reference can round an fp32 value to neighbouring bf16 values). Measured
    errors are far below: ~1e-5.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from sglang_tpu_backend.kernels import dispatch, gdn, gdn_geometry, gdn_kernels  # noqa: E402
from sglang_tpu_backend.kernels.gdn_common import conv_state_rows  # noqa: E402

# On a TPU (the TPU leg) f32 exp / log1p / rsqrt are not correctly rounded and HIGHEST
# products go through bf16 passes: the chunked and recurrent forms, which exponentiate the
# cumulative gates in different orders, measured 2.2e-5 to 3.8e-5 apart on a v5e.
F32_TOL = 5e-5 if jax.default_backend() == "tpu" else 2e-5
F64_TOL = 1e-4
BF16_TOL = 1.6e-2

ref_chunked = jax.jit(gdn.ref_gated_delta_net, static_argnames=("num_k_heads", "decode", "chunk_size"))
ref_recurrent = jax.jit(gdn.ref_recurrent_gdn, static_argnames=("num_k_heads",))
kernel = jax.jit(gdn.gated_delta_net,
                 static_argnames=("num_k_heads", "decode", "chunk_size", "impl", "block_sizes"))


def conv_states(rng, num_layers, num_slots, k, c):
    """Random f32[Lyr, S, conv_state_rows(k), C]: K-1 random rows per slot, then zero padding."""
    cs = np.zeros((num_layers, num_slots, conv_state_rows(k), c))
    cs[:, :, : k - 1] = rng.normal(size=(num_layers, num_slots, k - 1, c))
    return cs


def make_case(seed, lens, *, hk=2, hv=4, dk=16, dv=16, k=4, num_slots=8, num_layers=1,
              num_tokens=None, num_reqs=None, context=None, slots=None, dtype=jnp.float32,
              state_dtype=jnp.float32):
    """Random inputs for requests with q lengths `lens`; context[r] > 0 continues a request.

    States are stacked over `num_layers` GDN layers: conv [Lyr, S, rows, C] (rows K-1.. are
    zero padding), rec [Lyr, S, Hv, Dk, Dv].
    """
    rng = np.random.default_rng(seed)
    n_real = len(lens)
    T = num_tokens or max(1, sum(lens))
    R = num_reqs or n_real
    c = 2 * hk * dk + hv * dv
    context = [0] * n_real if context is None else context
    slots = list(range(1, n_real + 1)) if slots is None else slots
    cu = np.zeros(R + 1, np.int32)
    cu[1 : n_real + 1] = np.cumsum(lens)
    cu[n_real + 1 :] = cu[n_real]
    kv = np.zeros(R, np.int32)
    kv[:n_real] = np.asarray(lens) + np.asarray(context)
    st = np.zeros(R, np.int32)  # padding rows point at slot 0 on purpose
    st[:n_real] = slots
    A = np.concatenate([rng.uniform(0.01, 0.2, hv - hv // 2), rng.uniform(1.0, 16.0, hv // 2)])
    return dict(
        mixed_qkv=jnp.asarray(rng.normal(size=(T, c)), dtype),
        a=jnp.asarray(rng.normal(size=(T, hv)), dtype),
        b=jnp.asarray(rng.normal(size=(T, hv)), dtype),
        conv_weight=jnp.asarray(rng.normal(size=(c, k)) * 0.5, dtype),
        A_log=jnp.asarray(np.log(A), jnp.float32),
        dt_bias=jnp.asarray(rng.normal(size=hv) - 1.0, jnp.float32),
        conv_state=jnp.asarray(conv_states(rng, num_layers, num_slots, k, c), dtype),
        rec_state=jnp.asarray(rng.normal(size=(num_layers, num_slots, hv, dk, dv)) * 0.3,
                              state_dtype),
        cu_q_lens=jnp.asarray(cu),
        kv_lens=jnp.asarray(kv),
        state_slots=jnp.asarray(st),
        num_seqs=jnp.asarray([n_real], jnp.int32),
    ), hk


def run(fn, case, hk, **kw):
    return fn(**case, num_k_heads=hk, **kw)


def assert_close(got, want, tol, what=""):
    got, want = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (got, want))
    assert got.shape == want.shape, what
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol}"


def assert_results_close(got, want, tol):
    for g, w, name in zip(got, want, ("o", "conv_state", "rec_state")):
        assert_close(g, w, tol, name)


# ----------------------------------------------------------------------------- reference


def numpy_gdn(case, hk, layer=0):
    """Naive float64 per-request, per-token, per-head loop of the transformers math."""
    c = {k: np.asarray(jnp.asarray(v, jnp.float32), np.float64) if jnp.issubdtype(v.dtype, jnp.floating)
         else np.asarray(v) for k, v in case.items()}
    x, w = c["mixed_qkv"], c["conv_weight"]
    cs_all, rs_all = c["conv_state"].copy(), c["rec_state"].copy()
    cs, rs = cs_all[layer], rs_all[layer]  # views: [S, rows, C], [S, Hv, Dk, Dv]
    k1 = w.shape[1] - 1
    T, C = x.shape
    _, hv, dk, dv = rs.shape
    o = np.zeros((T, hv, dv))
    cu, kv, slots = c["cu_q_lens"], c["kv_lens"], c["state_slots"]
    for r in range(int(c["num_seqs"][0])):
        lo, hi = int(cu[r]), int(cu[r + 1])
        if hi == lo:
            continue
        fresh = kv[r] == hi - lo
        hist = np.zeros_like(cs[0, :k1].T) if fresh else cs[slots[r], :k1].T.copy()  # [C, K-1]
        s = np.zeros_like(rs[0]) if fresh else rs[slots[r]].copy()
        for t in range(lo, hi):
            win = np.concatenate([hist, x[t][:, None]], axis=1)
            hist = win[:, 1:]
            y = (win * w).sum(1)
            y = y / (1 + np.exp(-y))
            q = y[: hk * dk].reshape(hk, dk)
            k = y[hk * dk : 2 * hk * dk].reshape(hk, dk)
            v = y[2 * hk * dk :].reshape(hv, dv)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
            for h in range(hv):
                j = h // (hv // hk)
                beta = 1 / (1 + np.exp(-c["b"][t, h]))
                g = -np.exp(c["A_log"][h]) * np.log1p(np.exp(c["a"][t, h] + c["dt_bias"][h]))
                s[h] *= np.exp(g)
                d = beta * (v[h] - s[h].T @ k[j])
                s[h] += np.outer(k[j], d)
                o[t, h] = s[h].T @ q[j]
        cs[slots[r], :k1] = hist.T
        rs[slots[r]] = s
    return o, cs_all, rs_all


@pytest.mark.jax_versions
def test_reference_matches_numpy_loop():
    # a fresh prompt, a continuing chunk, a continuing decode row, a 2-token fresh request,
    # and a padding request row; chunk 4 so the 9-token prompt spans 3 chunks.
    case, hk = make_case(0, [9, 2, 1, 2], hk=1, hv=2, dk=4, dv=4, num_tokens=16, num_reqs=5,
                         context=[0, 6, 3, 0], slots=[3, 1, 4, 2])
    want = numpy_gdn(case, hk)
    assert_results_close(run(ref_recurrent, case, hk), want, F64_TOL)
    assert_results_close(run(ref_chunked, case, hk, chunk_size=4), want, F64_TOL)
    assert np.all(np.asarray(run(ref_chunked, case, hk, chunk_size=4)[0])[14:] == 0)


@pytest.mark.jax_versions
def test_decode_reference_matches_numpy_loop():
    case, hk = make_case(1, [1, 1, 1], hk=1, hv=2, dk=4, dv=4, num_reqs=4, context=[5, 0, 2],
                         num_tokens=4, slots=[2, 5, 1])
    case["cu_q_lens"] = jnp.asarray([0, 1, 2, 3, 3], jnp.int32)
    want = numpy_gdn(case, hk)
    assert_results_close(run(ref_chunked, case, hk, decode=True), want, F64_TOL)


def test_matches_transformers():
    """A fresh 11-token prefill, then 3 cached decode steps, through transformers' own functions."""
    torch = pytest.importorskip("torch")
    mod = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    hk, hv, dk, dv, k = 1, 2, 8, 8, 4
    case, _ = make_case(2, [11], hk=hk, hv=hv, dk=dk, dv=dv, num_tokens=11)
    tt = lambda x: torch.from_numpy(np.array(x, np.float32))  # noqa: E731
    w = tt(case["conv_weight"])
    A_log, dt_bias = tt(case["A_log"]), tt(case["dt_bias"])

    def torch_step(x, a, b, conv_state, rec_state, prefill):
        xt = x.T[None]  # [1, C, T]
        if prefill:
            y = mod.causal_conv1d_fn(xt, w, None, activation="silu")
            conv_state = torch.nn.functional.pad(xt, (k - xt.shape[-1], 0))  # last K inputs
        else:
            y = mod.causal_conv1d_update(xt, conv_state, w, None, "silu")
        y = y[0].T[None]  # [1, T, C]
        q, kk, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, kk, v = q.reshape(1, -1, hk, dk), kk.reshape(1, -1, hk, dk), v.reshape(1, -1, hv, dv)
        beta = b.sigmoid()[None]
        g = (-A_log.exp() * torch.nn.functional.softplus(a + dt_bias))[None]
        fn = mod.torch_chunk_gated_delta_rule if prefill else mod.torch_recurrent_gated_delta_rule
        extra = dict(chunk_size=4) if prefill else {}
        o, rec_state = fn(q, kk, v, g=g, beta=beta, initial_state=rec_state,
                          output_final_state=True, use_qk_l2norm_in_kernel=True, **extra)
        return o[0], conv_state, rec_state

    o_t, cs_t, rs_t = torch_step(tt(case["mixed_qkv"]), tt(case["a"]), tt(case["b"]), None,
                                 None, True)
    o, cs, rs = run(ref_chunked, case, hk, chunk_size=4)
    assert_close(o, o_t.numpy(), F64_TOL, "prefill o")
    assert_close(cs[0, 1, :3], cs_t[0, :, 1:].numpy().T, 0.0, "conv state")
    assert not np.asarray(cs[0, 1, 3:]).any()  # padding rows stay zero
    assert_close(rs[0, 1], rs_t[0].numpy(), F64_TOL, "rec state")
    for step in range(3):
        dcase, _ = make_case(10 + step, [1], hk=hk, hv=hv, dk=dk, dv=dv, context=[11 + step])
        dcase.update(conv_state=cs, rec_state=rs, conv_weight=case["conv_weight"],
                     A_log=case["A_log"], dt_bias=case["dt_bias"])
        o_t, cs_t, rs_t = torch_step(tt(dcase["mixed_qkv"]), tt(dcase["a"]), tt(dcase["b"]),
                                     cs_t, rs_t, False)
        o, cs, rs = run(ref_chunked, dcase, hk, decode=True)
        assert_close(o, o_t.numpy(), F64_TOL, f"decode o {step}")
        assert_close(rs[0, 1], rs_t[0].numpy(), F64_TOL, f"decode rec state {step}")


# ----------------------------------------------------------------------------- chunked == recurrent


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_chunked_equals_recurrent(chunk_size):
    # lengths below K-1, equal to the chunk, not multiples of it, decode rows; mixed fresh and
    # continuing; 3 padding tokens and one padding request row.
    lens = [1, 2, 3, 16, 17, 5, 1, 40]
    case, hk = make_case(3, lens, num_tokens=sum(lens) + 3, num_reqs=len(lens) + 1, num_slots=10,
                         context=[4, 0, 7, 0, 1, 2, 0, 9])
    want = run(ref_recurrent, case, hk)
    got = run(ref_chunked, case, hk, chunk_size=chunk_size)
    assert_results_close(got, want, F32_TOL)
    assert float(jnp.max(jnp.abs(want[0]))) > 0.05  # the comparison is not vacuous


def _xla_path_case():
    assert gdn.XLA_CHUNK_SIZE != gdn.CHUNK_SIZE
    lens = [1, 40, 33, 2, 70]  # chunks of both sizes end in different places
    return make_case(9, lens, num_tokens=sum(lens) + 2, num_reqs=6, num_slots=10,
                     context=[3, 0, 5, 0, 0])


def test_xla_path_matches_the_recurrence():
    """impl="xla" (auto off-TPU; forced on a TPU) gives the recurrence's results."""
    case, hk = _xla_path_case()
    assert_results_close(run(kernel, case, hk, impl="xla"), run(ref_recurrent, case, hk),
                         F32_TOL)


@pytest.mark.jax_versions
@pytest.mark.cpu_only("bit-equality of two XLA:CPU programs; XLA:TPU fuses them differently "
                      "(1e-6 apart on a v5e) and auto is the Pallas kernel there")
def test_xla_path_is_the_reference_with_its_own_chunk():
    """impl="xla" (auto off-TPU) runs the chunked reference with XLA_CHUNK_SIZE-token chunks:
    exactly the reference at that chunk size."""
    case, hk = _xla_path_case()
    got = run(kernel, case, hk, impl="xla")
    same = run(ref_chunked, case, hk, chunk_size=gdn.XLA_CHUNK_SIZE)
    for g, w in zip(got, same):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    for g, w in zip(run(kernel, case, hk, impl="auto"), got):  # off-TPU, auto is this path
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_decode_equals_recurrent():
    case, hk = make_case(4, [1] * 5, num_reqs=7, num_tokens=7, context=[3, 0, 1, 8, 2])
    case["cu_q_lens"] = jnp.asarray([0, 1, 2, 3, 4, 5, 5, 5], jnp.int32)
    want = run(ref_recurrent, case, hk)
    got = run(ref_chunked, case, hk, decode=True)
    assert_results_close(got, want, F32_TOL)
    assert np.all(np.asarray(got[0])[5:] == 0)


def test_split_prompt_equals_one_shot():
    pieces, width = [3, 20, 1, 21], 24  # every piece padded to 24 rows: one compilation
    full, hk = make_case(5, [sum(pieces)])
    o_full, cs_full, rs_full = run(ref_chunked, full, hk, chunk_size=8)
    conv_state, rec_state, outs, done = full["conv_state"], full["rec_state"], [], 0
    for n in pieces:
        rows = lambda x: jnp.zeros((width,) + x.shape[1:], x.dtype).at[:n].set(x[done : done + n])  # noqa: E731
        part = dict(full, mixed_qkv=rows(full["mixed_qkv"]), a=rows(full["a"]), b=rows(full["b"]),
                    conv_state=conv_state, rec_state=rec_state,
                    cu_q_lens=jnp.asarray([0, n], jnp.int32), kv_lens=jnp.asarray([done + n], jnp.int32))
        o, conv_state, rec_state = run(ref_chunked, part, hk, chunk_size=8)
        outs.append(o[:n])
        done += n
    assert_results_close((jnp.concatenate(outs), conv_state, rec_state), (o_full, cs_full, rs_full),
                         F32_TOL)


def test_ragged_batch_equals_each_alone():
    lens, context, slots = [7, 1, 20, 1, 3], [0, 5, 2, 0, 9], [6, 2, 4, 1, 7]
    T, R = 40, 7
    case, hk = make_case(6, lens, num_tokens=T, num_reqs=R, context=context, slots=slots)
    o, cs, rs = run(ref_chunked, case, hk, chunk_size=8)
    cu = np.asarray(case["cu_q_lens"])
    for r, n in enumerate(lens):
        rows = slice(int(cu[r]), int(cu[r + 1]))
        pad = lambda x: jnp.zeros((T,) + x.shape[1:], x.dtype).at[:n].set(x[rows])  # noqa: E731
        alone = dict(case, mixed_qkv=pad(case["mixed_qkv"]), a=pad(case["a"]), b=pad(case["b"]),
                     cu_q_lens=jnp.asarray([0] + [n] * R, jnp.int32),
                     kv_lens=case["kv_lens"].at[0].set(n + context[r]),
                     state_slots=case["state_slots"].at[0].set(slots[r]),
                     num_seqs=jnp.asarray([1], jnp.int32))
        o1, cs1, rs1 = run(ref_chunked, alone, hk, chunk_size=8)
        assert_close(o[rows], o1[:n], F32_TOL, f"o of request {r}")
        assert_close(cs[0, slots[r]], cs1[0, slots[r]], 0.0, f"conv state of request {r}")
        assert_close(rs[0, slots[r]], rs1[0, slots[r]], F32_TOL, f"rec state of request {r}")
    assert np.all(np.asarray(o)[int(cu[len(lens)]) :] == 0), "padding rows must be zero"
    untouched = [s for s in range(case["conv_state"].shape[1]) if s not in slots]  # incl. slot 0
    for s in untouched:  # padding request rows point at slot 0
        assert np.array_equal(np.asarray(cs[0, s]), np.asarray(case["conv_state"][0, s]))
        assert np.array_equal(np.asarray(rs[0, s]), np.asarray(case["rec_state"][0, s]))


# ----------------------------------------------------------------------------- bf16 state drift


# bf16 state vs fp32 state, same inputs, 1,000 decode steps, 3 requests, 4 value heads (two
# with slow decay, A in [0.01, 0.2], memory of ~20-300 steps; two fast). Measured
# max |o_bf16 - o_fp32| over all steps: 2.5e-3 for this seed (max |o| ~0.66, mean drift
# 6e-5); over 10 seeds 1.8e-3 .. 8.2e-3, the worst on a slow-decay head. Each step rounds
# the state to bf16 (relative 2^-9); decay and the delta rule's rewrite of the k direction
# damp old errors, so the drift levels off at a few bf16 ulps of o instead of growing with
# the step count (per-100-step maxima stay within ~2x of the first window). Bound 2.5e-2:
# 10x this seed's value, 3x the worst seed seen; a per-step accumulation (~1e-3 per step)
# or a state stored in a wrong dtype/slot would exceed it.
DRIFT_BOUND = 2.5e-2


def test_bf16_state_drift_over_1000_decode_steps():
    steps, R = 1000, 3
    case, hk = make_case(7, [1] * R, context=[0] * R, num_slots=R + 1)
    rng = np.random.default_rng(8)
    xs = jnp.asarray(rng.normal(size=(steps, R, case["mixed_qkv"].shape[1])), jnp.float32)
    av = jnp.asarray(rng.normal(size=(steps, R, case["a"].shape[1])), jnp.float32)
    bv = jnp.asarray(rng.normal(size=(steps, R, case["a"].shape[1])), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def decode_loop(state_dtype, conv_state, rec_state):
        def body(carry, inp):
            cs, rs, i = carry
            x, a, b = inp
            c = dict(case, mixed_qkv=x, a=a, b=b, conv_state=cs, rec_state=rs,
                     kv_lens=jnp.full((R,), i + 1, jnp.int32))
            o, cs, rs = gdn.ref_gated_delta_net(**c, num_k_heads=hk, decode=True)
            return (cs, rs, i + 1), o

        init = (conv_state, rec_state.astype(state_dtype), jnp.int32(0))
        return jax.lax.scan(body, init, (xs, av, bv))[1]

    o32 = decode_loop(jnp.float32, case["conv_state"], case["rec_state"])
    o16 = decode_loop(jnp.bfloat16, case["conv_state"], case["rec_state"])
    drift = float(jnp.max(jnp.abs(o16 - o32)))
    assert float(jnp.max(jnp.abs(o32))) > 0.1
    assert 0.0 < drift < DRIFT_BOUND, f"bf16-state drift {drift:.3g}"


# ----------------------------------------------------------------------------- Pallas (interpret)


def _interpret(case, hk, **kw):
    try:
        return run(kernel, case, hk, impl="interpret", **kw)
    except Exception:
        if hasattr(pltpu, "reset_tpu_interpret_mode_state"):
            pltpu.reset_tpu_interpret_mode_state()
        raise


def _assert_slots_untouched(got, case, slots, layer=0):
    for s in slots:
        assert np.array_equal(np.asarray(got[1][layer, s]), np.asarray(case["conv_state"][layer, s]))
        assert np.array_equal(np.asarray(got[2][layer, s]), np.asarray(case["rec_state"][layer, s]))


@pytest.mark.parametrize("dtype,state_dtype,d,k_heads_per_block", [
    (jnp.float32, jnp.float32, 32, None),  # one head block (Dk < 128)
    (jnp.bfloat16, jnp.bfloat16, 32, None),
    pytest.param(jnp.float32, jnp.bfloat16, 128, 1,  # two lane-aligned head blocks
                 marks=pytest.mark.jax_versions),
])
def test_pallas_decode_matches_reference(dtype, state_dtype, d, k_heads_per_block):
    # 4 real rows (fresh and continuing), 2 padding rows pointing at slot 0.
    case, hk = make_case(9, [1] * 4, dk=d, dv=d, num_reqs=6, num_tokens=6, context=[3, 0, 1, 6],
                         slots=[3, 1, 4, 2], dtype=dtype, state_dtype=state_dtype)
    case["cu_q_lens"] = jnp.asarray([0, 1, 2, 3, 4, 4, 4], jnp.int32)
    tol = F32_TOL if dtype == state_dtype == jnp.float32 else BF16_TOL
    got = _interpret(case, hk, decode=True,
                     block_sizes=gdn.GdnBlockSizes(k_heads_per_block=k_heads_per_block))
    assert_results_close(got, run(ref_chunked, case, hk, decode=True), tol)
    assert np.all(np.asarray(got[0], np.float32)[4:] == 0)
    _assert_slots_untouched(got, case, (0, 5, 6, 7))  # slots of no real request


# The decode kernel runs rb = rows_per_step rows per grid step (the wrapper pads the rows to a
# multiple of rb) and software-pipelines its state DMAs across steps (the rb fetches of step
# i+1 in flight while step i computes, write-backs drained one step later or at the last step;
# kernels/gdn_decode_pipeline.py). Patterns of rows: F fresh, C continuing (fetched), .
# padding. The op itself only pads at the end (rows >= num_seqs: the trailing dots); the
# padding rows inside are made by masking the kernel's row flags, so every neighbour pattern
# of the pipeline occurs: first row fresh, fresh and padding rows between fetches, runs of
# padding rows, the last rows padding; "37-idle" has rows 8..15 padding, a grid step of only
# padding rows at rb = 8 (and at rb = 3, rows 9..14); 37 and 5 are multiples of neither 3 nor 8.
PIPELINE_ROWS = {
    "37": "FC.CCF..CFCC...CFFC.C.FCCCF.CC.FC.F..",
    "37-idle": "FC.CF..C........CFCC.FC.CCF.C..FCFC..",
    "5": "CF.C.",
}
PIPELINE_PARAMS = {  # interpret-mode DMA semantics the pipeline must be right under
    "on_wait": dict(),  # a copy moves its data when waited: catches late or missing waits
    "eager_races": dict(dma_execution_mode="eager", detect_races=True),
    "two_cores": dict(num_cores_or_threads=2),  # megacore: head blocks split over cores
}
NUM_SLOTS = 48


def _masked_rows_case(pattern, state_dtype):
    """A decode batch following ``pattern`` (hk=4, Dk=64: two lane-aligned head blocks of
    kb=2), states stacked over 3 layers, layer 1 used. Returns (case, hk, real, slots)."""
    n = len(pattern)
    real = np.array([c != "." for c in pattern])
    rng = np.random.default_rng(21)
    slots = rng.permutation(np.arange(1, NUM_SLOTS))[:n]  # distinct slots of the real rows
    pad_rows = np.flatnonzero(~real)
    slots[pad_rows] = slots[rng.choice(np.flatnonzero(real), len(pad_rows))]  # not written
    context = [0 if c == "F" else int(rng.integers(1, 9)) for c in pattern]
    case, hk = make_case(20, [1] * n, hk=4, hv=8, dk=64, dv=64, num_slots=NUM_SLOTS,
                         context=context, slots=list(slots), state_dtype=state_dtype)
    case["num_seqs"] = jnp.asarray([len(pattern.rstrip("."))], jnp.int32)  # the op's padding
    return _stack_layers(case, 1, 3, seed=22), hk, real, slots


def _run_masked_rows(monkeypatch, case, hk, real, rows_per_step, params="on_wait"):
    """The decode kernel (interpret mode, ``PIPELINE_PARAMS[params]``) with the row flags of
    the rows where ``real`` is False masked to padding."""
    mask = jnp.asarray(real)
    decode_rows = gdn_kernels.decode_rows
    monkeypatch.setattr(gdn_kernels, "decode_rows", lambda *a: (
        lambda slot, kvl, ok: (slot, kvl, ok & mask))(*decode_rows(*a)))
    monkeypatch.setattr(gdn.dispatch, "interpret_params",  # (on the TPU leg: compiled)
                        lambda resolved: pltpu.InterpretParams(**PIPELINE_PARAMS[params])
                        if resolved == "interpret" else False)
    # A new function object per call: jit caches traces by the traced function, and a trace
    # cached for another row mask (same shapes) would skip this one's patches.
    fresh_jit = jax.jit(lambda **kw: gdn.gated_delta_net(**kw),
                        static_argnames=("num_k_heads", "decode", "impl", "block_sizes"))
    got = run(fresh_jit, case, hk, decode=True, layer=jnp.int32(1), impl="interpret",
              block_sizes=gdn.GdnBlockSizes(k_heads_per_block=2, rows_per_step=rows_per_step))
    # Dispatching JAX ops while the interpreter's callbacks still run can deadlock: wait.
    got = jax.block_until_ready(got)
    if PIPELINE_PARAMS[params].get("detect_races"):  # (private state; checked where present)
        try:
            from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        except ImportError:
            ipc = None
        races = getattr(ipc, "races", None)
        assert not getattr(races, "races_found", False), "the interpreter found a data race"
    return got


def _check_masked_rows(got, case, hk, real, slots, state_dtype):
    """The real rows match the reference run on them alone; padding rows output zeros; every
    slot of other layers and of no real row is bit-identical."""
    idx = np.flatnonzero(real)  # the reference runs the real rows only
    sub = dict(case, mixed_qkv=case["mixed_qkv"][idx], a=case["a"][idx], b=case["b"][idx],
               cu_q_lens=jnp.arange(len(idx) + 1, dtype=jnp.int32),
               kv_lens=case["kv_lens"][idx], state_slots=case["state_slots"][idx],
               num_seqs=jnp.asarray([len(idx)], jnp.int32))
    want = run(ref_chunked, sub, hk, decode=True, layer=1)
    tol = F32_TOL if state_dtype == jnp.float32 else BF16_TOL
    assert got[0].shape == case["mixed_qkv"].shape[:1] + (8, 64)
    assert_close(got[0][idx], want[0], tol, "o of real rows")
    assert np.all(np.asarray(got[0])[~real] == 0), "o of padding rows"
    assert_close(got[1], want[1], tol, "conv state")
    assert_close(got[2], want[2], tol, "rec state")
    untouched = sorted(set(range(NUM_SLOTS)) - set(slots[idx].tolist()))
    for layer in (0, 2):  # other layers: every slot
        _assert_slots_untouched(got, case, range(NUM_SLOTS), layer)
    _assert_slots_untouched(got, case, untouched, layer=1)  # incl. the padding rows' slots


@pytest.mark.parametrize("rows_per_step", [1, 3, 8])
@pytest.mark.parametrize("params", list(PIPELINE_PARAMS))
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_decode_pipeline_many_rows(monkeypatch, params, state_dtype, rows_per_step):
    case, hk, real, slots = _masked_rows_case(PIPELINE_ROWS["37"], state_dtype)
    got = _run_masked_rows(monkeypatch, case, hk, real, rows_per_step, params)
    _check_masked_rows(got, case, hk, real, slots, state_dtype)


@pytest.mark.parametrize("rows_per_step", [1, 3, 8])
@pytest.mark.parametrize("pattern", ["5", "37-idle"])
def test_pallas_decode_rows_per_step(monkeypatch, pattern, rows_per_step):
    case, hk, real, slots = _masked_rows_case(PIPELINE_ROWS[pattern], jnp.float32)
    got = _run_masked_rows(monkeypatch, case, hk, real, rows_per_step)
    _check_masked_rows(got, case, hk, real, slots, jnp.float32)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_decode_rows_per_step_bit_equal(monkeypatch, state_dtype):
    # The same rows, 8 per grid step or 1: the same per-row math, so the same bits (outputs,
    # both states, every slot of every layer -- the untouched ones included).
    case, hk, real, _ = _masked_rows_case(PIPELINE_ROWS["37-idle"], state_dtype)
    one = _run_masked_rows(monkeypatch, case, hk, real, 1)
    eight = _run_masked_rows(monkeypatch, case, hk, real, 8)
    for a, b, name in zip(one, eight, ("o", "conv_state", "rec_state")):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


def test_default_rows_per_step():
    # 8 rows per step unless VMEM caps it (halved until the estimate fits 12 MiB), at most T.
    def geom(kb):  # 397B heads
        return gdn_kernels.Geometry(Hk=16, Hv=64, Dk=128, Dv=128, K=4, kb=kb, L=1)

    assert gdn_geometry.default_rows_per_step(geom(1), 64, 2, 2) == 8
    assert gdn_geometry.default_rows_per_step(geom(1), 64, 4, 2) == 8
    assert gdn_geometry.default_rows_per_step(geom(1), 5, 4, 2) == 5
    assert gdn_geometry.default_rows_per_step(geom(8), 64, 4, 2) < 8  # 32 heads: 4 MiB a row
    for kb in (1, 2, 4, 8, 16):
        rb = gdn_geometry.default_rows_per_step(geom(kb), 64, 4, 2)
        assert gdn_geometry.decode_vmem_bytes(geom(kb), rb, 4, 2) <= 12 << 20 or rb == 1


@pytest.mark.parametrize("dtype,state_dtype,d,k_heads_per_block", [
    (jnp.float32, jnp.float32, 32, None),  # one head block (Dk < 128)
    pytest.param(jnp.float32, jnp.bfloat16, 32, 2, marks=pytest.mark.jax_versions),
    (jnp.bfloat16, jnp.bfloat16, 32, None),
    (jnp.float32, jnp.float32, 128, 1),  # two lane-aligned head blocks: columns read direct
    (jnp.bfloat16, jnp.float32, 128, 1),  # the same with bf16 matmul operands, f32 state
])
def test_pallas_chunked_matches_reference(dtype, state_dtype, d, k_heads_per_block):
    # chunk 16: a 37-token prompt (3 chunks, continuing), lengths below K-1, a decode row,
    # exactly one chunk; 4 padding tokens and a padding request row pointing at slot 0.
    lens, context = [37, 2, 1, 16, 3], [5, 0, 4, 0, 1]
    case, hk = make_case(10, lens, dk=d, dv=d, num_tokens=sum(lens) + 4, num_reqs=6,
                         context=context, slots=[3, 1, 6, 2, 5], dtype=dtype,
                         state_dtype=state_dtype)
    tol = F32_TOL * 5 if dtype == state_dtype == jnp.float32 else BF16_TOL
    got = _interpret(case, hk, chunk_size=16,
                     block_sizes=gdn.GdnBlockSizes(k_heads_per_block=k_heads_per_block))
    assert_results_close(got, run(ref_chunked, case, hk, chunk_size=16), tol)
    assert np.all(np.asarray(got[0], np.float32)[sum(lens) :] == 0)
    _assert_slots_untouched(got, case, (0, 4, 7))


# ----------------------------------------------------------------------------- unit-lower inverse


def _stressed_n(seed, L, heads=4, dk=128, spread=0.05, beta=0.99, g=-1e-3):
    """f64[heads, L, L] strictly lower ``beta k_i.k_j exp(gam_i - gam_j)`` (the chunk's n) of
    nearly parallel unit keys with beta and decay near 1: |n| ~ 1 everywhere below the
    diagonal, the worst case for error growth (n's powers reach binomial sizes, C(63, 31) ~
    1e18 at L = 64, while the inverse stays O(1))."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(heads, 1, dk)) + spread * rng.normal(size=(heads, L, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    gam = np.cumsum(np.full((heads, L), g), axis=-1)
    decay = np.exp(gam[:, :, None] - gam[:, None, :])
    return np.tril(beta * np.einsum("hid,hjd->hij", k, k) * decay, -1)


@pytest.mark.parametrize("L", [64, 48, 16, 8])
def test_kernel_unit_lower_inverse_under_stress(L):
    # The kernel's doubling inverse against float64 numpy and the reference's substitution:
    # measured at L=64 (CPU): max error / max |inverse| 1.9e-7 (substitution 6.4e-7; the
    # product (I - n)(I + n^2)(I + n^4)... 5e10).
    n = _stressed_n(L, L)
    want = np.linalg.inv(np.eye(L) + n)

    def rel_err(fn):
        got = np.asarray(jax.jit(fn)(jnp.asarray(n, jnp.float32)), np.float64)
        return np.max(np.abs(got - want)) / np.max(np.abs(want))

    new, old = rel_err(gdn_kernels.unit_lower_inverse), rel_err(gdn._unit_lower_inverse)
    assert new <= max(4 * old, 2e-6), (new, old)
    assert new <= 1e-5, new


def _in_a_kernel(fn):
    """fn (an array -> the same shape) run inside a Pallas kernel, the whole array one block:
    in interpret mode on the CPU, compiled by Mosaic on the TPU leg."""
    impl = dispatch.resolve("interpret")

    def call(x):
        def body(x_ref, o_ref):
            o_ref[...] = fn(x_ref[...])

        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=dispatch.interpret_params(impl))(x)

    return call


@pytest.mark.parametrize("where", ["xla", "kernel"])
@pytest.mark.parametrize("L", [64, 16])
def test_kernel_unit_lower_inverse_three_pass_under_stress(L, where):
    # The bf16-activation kernel's inverse: every product as three one-pass bf16 products.
    # Measured at L=64 (CPU, whose bf16 dot matches the MXU's: exact products, f32 sums):
    # 2.6e-5 of max |inverse| (all-f32: 1.5e-7; one bf16 pass per product: 5.6e-3). Under XLA
    # too: on a v5e, XLA:TPU's compile of an f32 -> bf16 -> f32 split measured 6.9e-3 (one pass).
    n = jnp.asarray(_stressed_n(L, L), jnp.float32)
    want = np.linalg.inv(np.eye(L) + np.asarray(n, np.float64))
    inverse = functools.partial(gdn_kernels.unit_lower_inverse, three_pass=True)
    got = np.asarray(jax.jit(inverse if where == "xla" else _in_a_kernel(inverse))(n))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) <= 1e-4


def test_kernel_unit_lower_inverse_matches_reference():
    rng = np.random.default_rng(13)
    n = jnp.asarray(np.tril(rng.normal(size=(3, 64, 64)) * 0.1, -1), jnp.float32)
    assert_close(jax.jit(gdn_kernels.unit_lower_inverse)(n), jax.jit(gdn._unit_lower_inverse)(n),
                 1e-5, "inverse")


# ----------------------------------------------------------------------------- stacked layers


def _stack_layers(case, layer, num_layers, seed):
    """The case's single-layer states placed at `layer` of `num_layers` random layers."""
    rng = np.random.default_rng(seed)
    stacked = {}
    for name in ("conv_state", "rec_state"):
        x = case[name]
        others = jnp.asarray(rng.normal(size=(num_layers,) + x.shape[1:]), x.dtype)
        stacked[name] = others.at[layer].set(x[0])
    return dict(case, **stacked)


LAYER_CASES = {  # name: (make_case kwargs, run kwargs)
    "chunked": (dict(lens=[9, 1, 3], context=[0, 4, 2], num_tokens=16, num_reqs=4),
                dict(chunk_size=8)),
    "decode": (dict(lens=[1, 1, 1], context=[0, 4, 2], num_tokens=4, num_reqs=4),
               dict(decode=True)),
}


@pytest.mark.parametrize("path,impl", [("chunked", "reference"), ("chunked", "recurrent"),
                                       ("chunked", "interpret"), ("decode", "reference"),
                                       pytest.param("decode", "interpret",
                                                    marks=pytest.mark.jax_versions)])
def test_layer_index_updates_only_its_layer(path, impl):
    # Lyr=3, layer 1 passed as a traced scalar: the result equals the single-layer call and
    # layers 0 and 2 come back bit-identical.
    kw_case, kw_run = LAYER_CASES[path]
    case, hk = make_case(13, dk=32, dv=32, **kw_case)
    if path == "decode":
        case["cu_q_lens"] = jnp.asarray([0, 1, 2, 3, 3], jnp.int32)
    stacked = _stack_layers(case, 1, 3, seed=14)
    if impl == "recurrent":
        fn = lambda c, **kw: run(ref_recurrent, c, hk, **kw)  # noqa: E731
    elif impl == "reference":
        fn = lambda c, **kw: run(ref_chunked, c, hk, **kw_run, **kw)  # noqa: E731
    else:
        fn = lambda c, **kw: _interpret(c, hk, **kw_run, **kw)  # noqa: E731
    want = fn(case)
    got = fn(stacked, layer=jnp.int32(1))
    assert_close(got[0], want[0], F32_TOL, "o")
    assert_close(got[1][1], want[1][0], F32_TOL, "conv state of layer 1")
    assert_close(got[2][1], want[2][0], F32_TOL, "rec state of layer 1")
    for other in (0, 2):
        assert np.array_equal(np.asarray(got[1][other]), np.asarray(stacked["conv_state"][other]))
        assert np.array_equal(np.asarray(got[2][other]), np.asarray(stacked["rec_state"][other]))


def test_layer_index_in_scan_matches_loop():
    # The model runs GDN layers in a lax.scan: the traced layer index of each iteration.
    case, hk = make_case(15, [5, 1], context=[0, 3], num_tokens=8, num_reqs=3, num_layers=2)

    @jax.jit
    def scanned(conv_state, rec_state):
        def body(carry, layer):
            o, cs, rs = gdn.ref_gated_delta_net(**dict(case, conv_state=carry[0],
                                                       rec_state=carry[1]),
                                                num_k_heads=hk, chunk_size=4, layer=layer)
            return (cs, rs), o
        return jax.lax.scan(body, (conv_state, rec_state), jnp.arange(2))

    (cs, rs), o = scanned(case["conv_state"], case["rec_state"])
    for layer in range(2):
        want = run(ref_chunked, case, hk, chunk_size=4, layer=layer)
        assert_close(o[layer], want[0], F32_TOL, f"o of layer {layer}")
        assert_close(cs[layer], want[1][layer], 0.0, f"conv state of layer {layer}")
        assert_close(rs[layer], want[2][layer], F32_TOL, f"rec state of layer {layer}")


# ----------------------------------------------------------------------------- invalid inputs


def _bad(case, **changes):
    return dict(case, **changes)


@pytest.mark.parametrize("mutate,match", [
    (lambda c: _bad(c, mixed_qkv=c["mixed_qkv"][:, :-1]), "C must equal"),
    (lambda c: _bad(c, a=c["a"][:, :-1]), "a and b"),
    (lambda c: _bad(c, conv_state=c["conv_state"][..., :-1]), "conv_state"),
    (lambda c: _bad(c, conv_state=c["conv_state"][:, :, :3]), "conv_state"),  # unpadded rows
    (lambda c: _bad(c, rec_state=c["rec_state"][:, :, :3]), "num_k_heads|C must equal"),
    (lambda c: _bad(c, rec_state=c["rec_state"][0]), "rec_state must be"),
    (lambda c: _bad(c, conv_state=jnp.concatenate([c["conv_state"]] * 2)), "conv_state"),
    (lambda c: _bad(c, kv_lens=c["kv_lens"][:-1]), "kv_lens"),
    (lambda c: _bad(c, cu_q_lens=c["cu_q_lens"].astype(jnp.float32)), "integer"),
    (lambda c: _bad(c, num_seqs=jnp.asarray([1, 1], jnp.int32)), "num_seqs"),
    (lambda c: _bad(c, A_log=c["A_log"][:-1]), "A_log"),
])
def test_bad_shapes_raise(mutate, match):
    case, hk = make_case(11, [3, 2])
    with pytest.raises(ValueError, match=match):
        gdn.gated_delta_net(**mutate(case), num_k_heads=hk, impl="reference")
    with pytest.raises(ValueError, match=match):
        gdn.ref_recurrent_gdn(**mutate(case), num_k_heads=hk)


def test_bad_heads_and_blocks_raise():
    case, _ = make_case(12, [3])
    with pytest.raises(ValueError, match="num_k_heads"):
        gdn.gated_delta_net(**case, num_k_heads=3, impl="reference")
    with pytest.raises(ValueError, match="k_heads_per_block"):
        gdn.gated_delta_net(**case, num_k_heads=2, impl="interpret",
                            block_sizes=gdn.GdnBlockSizes(k_heads_per_block=3))
    with pytest.raises(ValueError, match="multiples of 128"):  # Dk=16: 1 qk head is 16 lanes
        gdn.gated_delta_net(**case, num_k_heads=2, impl="interpret",
                            block_sizes=gdn.GdnBlockSizes(k_heads_per_block=1))
    for rb in (0, -1, 2.0):
        with pytest.raises(ValueError, match="rows_per_step"):
            gdn.gated_delta_net(**case, num_k_heads=2, decode=True, impl="interpret",
                                block_sizes=gdn.GdnBlockSizes(rows_per_step=rb))
    with pytest.raises(ValueError, match="chunk_size"):
        gdn.gated_delta_net(**case, num_k_heads=2, chunk_size=0, impl="reference")
    for layer in (-1, 1):  # Lyr = 1
        with pytest.raises(ValueError, match="layer"):
            gdn.gated_delta_net(**case, num_k_heads=2, layer=layer, impl="reference")
    with pytest.raises(ValueError, match="layer"):
        gdn.gated_delta_net(**case, num_k_heads=2, layer=jnp.zeros((1,), jnp.int32),
                            impl="reference")


def test_cost_counts_scale():
    dec = gdn.gated_delta_net_cost(64, 64, 16, 64, 128, 128, decode=True, state_bytes=2)
    pre = gdn.gated_delta_net_cost(1024, 4, 16, 64, 128, 128, chunk_size=64)
    assert dec.bytes_accessed > 64 * 64 * 128 * 128 * 2 * 2  # bf16 state read + written
    assert pre.flops > 1024 * 64 * 4 * 128 * 128  # the state matmuls dominate
    assert pre.arithmetic_intensity() > dec.arithmetic_intensity()


def test_decode_head_block_holds_256_kib_of_state_by_default(monkeypatch):
    """At 397B shapes the decode kernel's default head block is 2 qk heads with a bf16 state
    and 1 with f32 (a 256 KiB state block each); the chunked kernel's is 4 qk heads (16 value
    heads) whatever the state, and a caller's kb wins."""
    from sglang_tpu_backend.kernels import block_tables

    monkeypatch.setattr(block_tables, "pick", lambda kernel, default, legal: default)
    shape = dict(T=64, Hk=16, Hv=64, Dk=128, Dv=128, K=4, x_bytes=2)
    kb = lambda state_bytes, decode, given=gdn.GdnBlockSizes(): gdn._block_sizes(  # noqa: E731
        given, state_bytes=state_bytes, decode=decode, **shape)[0]
    assert (kb(2, True), kb(4, True)) == (2, 1)
    assert (kb(2, False), kb(4, False)) == (4, 4)
    assert kb(2, True, gdn.GdnBlockSizes(k_heads_per_block=1)) == 1
    # D < 128: the only lane-aligned block is all heads, whatever the state
    assert gdn_geometry.default_decode_k_heads_per_block(2, 4, 32, 32, 2) == 2
    assert gdn_geometry.default_chunk_k_heads_per_block(2, 4, 32, 32) == 2
    # 16 value heads a block: 8 qk heads at 2 value heads each (Qwen3-Next's 16 / 32)
    assert gdn_geometry.default_chunk_k_heads_per_block(16, 32, 128, 128) == 8
