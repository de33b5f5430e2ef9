"""Tests for kernels/gdn_verify.py: GDN verify mode (k+1 tokens per request; o, the conv windows
and the gate inputs) and ``commit_states`` (the accepted positions run again into the slots).

Exactness claims, float32: the XLA path's o and conv windows, and the states its commit leaves
after a accepted positions, equal bit for bit what ``gated_delta_net(decode=True)`` on the XLA
path gives and leaves in the slot after a decode steps; the Pallas kernels (interpret mode)
likewise against the Pallas decode kernel. Against the reference (transformers' order) they
agree to F32_TOL (a different association order of the same math).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from sglang_tpu_backend.kernels import gdn, gdn_verify  # noqa: E402
from tests.kernels.test_gdn import BF16_TOL, F32_TOL, assert_close, make_case  # noqa: E402

N = 4  # k = 3 drafts + the last token
verify = jax.jit(gdn_verify.gated_delta_net_verify,
                 static_argnames=("num_k_heads", "impl", "block_sizes"))
decode = jax.jit(gdn.gated_delta_net, static_argnames=("num_k_heads", "decode", "impl"))
commit = jax.jit(gdn_verify.commit_states,
                 static_argnames=("num_k_heads", "impl", "block_sizes"))
OUTS = ("o", "windows", "a", "b")


def verify_case(seed, *, d=16, dtype=jnp.float32, state_dtype=jnp.float32, num_layers=1):
    """3 real requests (continuing, fresh, continuing) of N tokens + 1 padding request (slot 0)."""
    case, hk = make_case(seed, [N] * 3, num_reqs=4, num_tokens=4 * N, context=[5, 0, 2],
                         slots=[3, 1, 6], dk=d, dv=d, dtype=dtype, state_dtype=state_dtype,
                         num_layers=num_layers)
    del case["cu_q_lens"]
    return case, hk


def run_verify(case, hk, impl, **kw):
    try:
        return verify(**case, num_k_heads=hk, impl=impl, **kw)
    except Exception:
        if impl == "interpret" and hasattr(pltpu, "reset_tpu_interpret_mode_state"):
            pltpu.reset_tpu_interpret_mode_state()
        raise


def decode_steps(case, hk, impl, steps):
    """The slots' (conv, rec) states and o after each of ``steps`` decode steps, token p of
    every request at step p (the non-speculative run of the same tokens)."""
    R = case["kv_lens"].shape[0]
    cs, rs = case["conv_state"], case["rec_state"]
    context = case["kv_lens"] - N
    out = []
    for p in range(steps):
        tok = lambda x: x.reshape(R, N, -1)[:, p]  # noqa: E731
        o, cs, rs = decode(tok(case["mixed_qkv"]), tok(case["a"]), tok(case["b"]),
                           case["conv_weight"], case["A_log"], case["dt_bias"], cs, rs,
                           jnp.arange(R + 1, dtype=jnp.int32), context + p + 1,
                           case["state_slots"], case["num_seqs"], num_k_heads=hk, decode=True,
                           impl=impl)
        out.append((cs, rs, o))
    return out


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_verify_matches_reference(impl):
    case, hk = verify_case(1)
    want = run_verify(case, hk, "reference")
    got = run_verify(case, hk, impl)
    for g, w, name in zip(got, want, OUTS):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert_close(g, w, F32_TOL, name)
    assert np.all(np.asarray(got[0])[3 * N:] == 0), "padding request's o"
    assert np.all(np.asarray(got[2])[3] == 0) and np.all(np.asarray(got[3])[3] == 0), "padding"
    np.testing.assert_array_equal(np.asarray(got[2][:3]),
                                  np.asarray(case["a"]).reshape(4, N, -1)[:3])
    # The windows start with the slot's K-1 rows (zeros for the fresh request 1).
    np.testing.assert_array_equal(np.asarray(got[1][0, :3]), np.asarray(case["conv_state"][0, 3, :3]))
    assert np.all(np.asarray(got[1][1, :3]) == 0)


@pytest.mark.parametrize("impl", ["xla", pytest.param("interpret", marks=pytest.mark.jax_versions)])
def test_verify_outputs_equal_decode_steps_bit_for_bit(impl):
    case, hk = verify_case(2)
    o_v, win, _, _ = run_verify(case, hk, impl)
    o_v = np.asarray(o_v).reshape(4, N, *o_v.shape[1:])
    K1 = case["conv_weight"].shape[1] - 1
    for p, (cs, _, o) in enumerate(decode_steps(case, hk, impl, N)):
        for r, slot in enumerate(np.asarray(case["state_slots"])[:3]):
            np.testing.assert_array_equal(np.asarray(win[r, p + 1:p + 1 + K1]),
                                          np.asarray(cs[0, slot, :K1]),
                                          f"conv state of request {r} after {p + 1} tokens")
            np.testing.assert_array_equal(o_v[r, p], np.asarray(o[r]), f"o of request {r}")


@pytest.mark.parametrize("dtype,state_dtype,d,k_heads_per_block", [
    (jnp.bfloat16, jnp.bfloat16, 32, None),
    (jnp.float32, jnp.float32, 128, 1),  # two lane-aligned head blocks
])
def test_pallas_verify_matches_xla(dtype, state_dtype, d, k_heads_per_block):
    case, hk = verify_case(3, d=d, dtype=dtype, state_dtype=state_dtype)
    tol = F32_TOL if dtype == state_dtype == jnp.float32 else BF16_TOL
    got = run_verify(case, hk, "interpret",
                     block_sizes=gdn.GdnBlockSizes(k_heads_per_block=k_heads_per_block))
    want = run_verify(case, hk, "xla")
    for g, w, name in zip(got, want, OUTS):
        assert g.dtype == w.dtype, name
        assert_close(g, w, tol, name)


def test_verify_reads_its_layer():
    # Lyr = 2, layer 1 as a traced scalar: the same as the single-layer call on layer 1.
    case, hk = verify_case(4, num_layers=2)
    single = dict(case, conv_state=case["conv_state"][1:], rec_state=case["rec_state"][1:])
    for impl in ("xla", "interpret"):
        got = run_verify(case, hk, impl, layer=jnp.int32(1))
        for g, w in zip(got, run_verify(single, hk, impl)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def run_commit(case, hk, impl, accepted, num_layers=2, block_sizes=None):
    """Verify every layer on ``impl``, then commit ``accepted`` positions on ``impl``."""
    per_layer = [run_verify(case, hk, impl, layer=layer, block_sizes=block_sizes)
                 for layer in range(num_layers)]
    windows, a, b = (jnp.stack([out[i] for out in per_layer]) for i in (1, 2, 3))
    fresh = case["kv_lens"] <= N
    stacked = lambda x: jnp.stack([x] * num_layers)  # noqa: E731 the case's layers share params
    return commit(case["conv_state"], case["rec_state"], windows, a, b, fresh,
                  stacked(case["conv_weight"]), stacked(case["A_log"]), stacked(case["dt_bias"]),
                  case["state_slots"], jnp.asarray(accepted, jnp.int32), num_k_heads=hk,
                  impl=impl, block_sizes=block_sizes)


# Requests accept 2, N and 1 positions (request 1 is fresh); the padding request 0 (as the
# caller must pass for it). Slots 0, 2, 4, 5, 7 belong to no real request.
ACCEPTED = [2, N, 1, 0]


@pytest.mark.parametrize("impl", ["xla", pytest.param("interpret", marks=pytest.mark.jax_versions)])
def test_commit_equals_decode_steps_bit_for_bit(impl):
    case, hk = verify_case(5, num_layers=2)
    cs, rs = run_commit(case, hk, impl, ACCEPTED)
    after = {layer: decode_steps(dict(case, conv_state=case["conv_state"][layer:layer + 1],
                                      rec_state=case["rec_state"][layer:layer + 1]),
                                 hk, impl, N) for layer in range(2)}
    for layer in range(2):
        for r, slot in enumerate(np.asarray(case["state_slots"])[:3]):
            want_cs, want_rs, _ = after[layer][ACCEPTED[r] - 1]
            np.testing.assert_array_equal(np.asarray(cs[layer, slot]),
                                          np.asarray(want_cs[0, slot]), f"conv {layer}, {r}")
            np.testing.assert_array_equal(np.asarray(rs[layer, slot]),
                                          np.asarray(want_rs[0, slot]), f"rec {layer}, {r}")
    for slot in (0, 2, 4, 5, 7):
        for got, before in ((cs, case["conv_state"]), (rs, case["rec_state"])):
            np.testing.assert_array_equal(np.asarray(got[:, slot]), np.asarray(before[:, slot]))


@pytest.mark.parametrize("dtype,state_dtype,d,k_heads_per_block", [
    (jnp.bfloat16, jnp.bfloat16, 32, None),
    (jnp.float32, jnp.float32, 128, 1),  # two lane-aligned head blocks
])
def test_pallas_commit_matches_xla(dtype, state_dtype, d, k_heads_per_block):
    case, hk = verify_case(8, d=d, dtype=dtype, state_dtype=state_dtype)
    tol = F32_TOL if dtype == state_dtype == jnp.float32 else BF16_TOL
    blocks = gdn.GdnBlockSizes(k_heads_per_block=k_heads_per_block)
    got = run_commit(case, hk, "interpret", ACCEPTED, num_layers=1, block_sizes=blocks)
    want = run_commit(case, hk, "xla", ACCEPTED, num_layers=1)
    for g, w, name in zip(got, want, ("conv_state", "rec_state")):
        assert g.dtype == w.dtype, name
        assert_close(g, w, tol, name)


def test_commit_matches_reference_and_zero_accepted_leaves_slots():
    case, hk = verify_case(7, num_layers=2)
    got = run_commit(case, hk, "xla", [3, 2, 0, 0])
    want = run_commit(case, hk, "reference", [3, 2, 0, 0])
    for g, w, name in zip(got, want, ("conv_state", "rec_state")):
        assert_close(g, w, F32_TOL, name)
    slot = int(case["state_slots"][2])  # accepted 0: untouched
    np.testing.assert_array_equal(np.asarray(got[1][:, slot]),
                                  np.asarray(case["rec_state"][:, slot]))
    assert not np.array_equal(np.asarray(got[1][:, 3]), np.asarray(case["rec_state"][:, 3]))


def test_commit_bad_shapes_raise():
    case, hk = verify_case(6)
    win, a, b = (x[None] for x in run_verify(case, hk, "xla")[1:])
    one = lambda x: x[None]  # noqa: E731
    with pytest.raises(ValueError, match="conv_weight must be"):
        gdn_verify.commit_states(case["conv_state"], case["rec_state"], win, a, b,
                                 case["kv_lens"] <= N, case["conv_weight"], one(case["A_log"]),
                                 one(case["dt_bias"]), case["state_slots"],
                                 jnp.ones((4,), jnp.int32), num_k_heads=hk, impl="xla")


def test_verify_bad_layout_raises():
    case, hk = verify_case(6)
    with pytest.raises(ValueError, match="R \\* n"):
        gdn_verify.gated_delta_net_verify(**dict(case, mixed_qkv=case["mixed_qkv"][:-1],
                                                 a=case["a"][:-1], b=case["b"][:-1]),
                                          num_k_heads=hk, impl="xla")
    with pytest.raises(ValueError, match="C must equal"):
        gdn_verify.gated_delta_net_verify(**dict(case, mixed_qkv=case["mixed_qkv"][:, :-1]),
                                          num_k_heads=hk, impl="xla")


def test_verify_cost_reads_each_state_once_and_writes_none():
    R, n, per_state = 64, 4, 64 * 128 * 128 * 2  # 397B heads, bf16 state
    cost = gdn_verify.gated_delta_net_verify_cost(R, n, 16, 64, 128, 128, state_bytes=2)
    steps = gdn.gated_delta_net_cost(R * n, R * n, 16, 64, 128, 128, decode=True, state_bytes=2)
    assert R * per_state < cost.bytes_accessed < R * (n + 1) * per_state
    assert cost.flops == steps.flops
    commit_cost = gdn_verify.gated_delta_net_commit_cost(R, n, 16, 64, 128, 128, state_bytes=2)
    assert 2 * R * per_state < commit_cost.bytes_accessed < 3 * R * per_state
    assert commit_cost.flops == steps.flops
