"""Ragged paged attention: Pallas (TPU interpret mode) vs reference, reference vs numpy loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from sglang_tpu_backend.kernels import ragged_paged_attention as rpa

# Max abs error allowed against the reference / numpy loop, per dtype.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float8_e4m3fn: 2e-2}


@dataclasses.dataclass
class Case:
    q_lens: list[int]  # per real request
    ctx_lens: list[int]  # tokens already in the cache before this step
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 128
    page_size: int = 16
    pad_rows: int = 0  # padding request rows after the real ones
    pad_tokens: int = 0  # padding tokens after the real ones
    dtype: type = jnp.float32  # q (and the cache unless kv_dtype is given)
    seed: int = 0
    kv_dtype: type | None = None  # cache and new K/V dtype when it differs from q's
    num_layers: int = 1  # layers of the stacked cache
    layer: int = 0  # the layer this call reads and writes
    traced_layer: bool = False  # pass the layer as a traced jit argument
    scaled: bool = False  # an FP8 cache with per-row scales (kv_scales); new K/V in q's dtype


def make_inputs(c: Case):
    """Random q, pages, and metadata for a case (pages of the requests in random order)."""
    rng = np.random.default_rng(c.seed)
    ns = len(c.q_lens)
    num_rows = ns + c.pad_rows
    kv_lens = [cl + ql for cl, ql in zip(c.ctx_lens, c.q_lens)]
    pages_needed = [max(1, -(-kl // c.page_size)) for kl in kv_lens]
    pages_per_seq = max(pages_needed) + 1
    num_pages = sum(pages_needed) + 3
    perm = rng.permutation(num_pages)
    # Entries past a request's pages hold an out-of-range id: neither path may read them.
    page_indices = np.full((num_rows, pages_per_seq), num_pages + 7)
    used = 0
    for r, n in enumerate(pages_needed):
        page_indices[r, :n] = perm[used:used + n]
        used += n
    cu = np.zeros(num_rows + 1, np.int64)
    cu[1:ns + 1] = np.cumsum(c.q_lens)
    cu[ns + 1:] = cu[ns]
    num_tokens = int(cu[ns]) + c.pad_tokens
    kv = np.zeros(num_rows, np.int64)
    kv[:ns] = kv_lens
    kv[ns:] = rng.integers(0, 40, c.pad_rows)  # garbage in padding rows
    shape = (c.num_layers, num_pages, 2 * c.num_kv_heads, c.page_size, c.head_dim)
    kv_dtype = c.kv_dtype or c.dtype
    arr = lambda *s, dt=kv_dtype: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dt)
    extra = {}
    if c.scaled:  # cached rows of scales 1e-2 .. 1e2; new rows of magnitudes 1e-2 .. 1e2
        extra["kv_scales"] = jnp.asarray(10.0 ** rng.uniform(-2, 2, shape[:4]), jnp.float32)
        mag = lambda: jnp.asarray(10.0 ** rng.uniform(-2, 2, (num_tokens, c.num_kv_heads, 1)),
                                  jnp.float32)
        new = lambda: (arr(num_tokens, c.num_kv_heads, c.head_dim, dt=jnp.float32)
                       * mag()).astype(c.dtype)
        extra.update(new_k=new(), new_v=new())
    return dict(
        **extra,
        q=arr(num_tokens, c.num_q_heads, c.head_dim, dt=c.dtype), kv_pages=arr(*shape),
        kv_lens=jnp.asarray(kv, jnp.int32), page_indices=jnp.asarray(page_indices, jnp.int32),
        cu_q_lens=jnp.asarray(cu, jnp.int32), num_seqs=jnp.asarray([ns], jnp.int32),
        **{n: arr(num_tokens, c.num_kv_heads, c.head_dim)
           for n in ("new_k", "new_v") if n not in extra},
        layer=c.layer, traced_layer=c.traced_layer)


ARGS = ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")


def numpy_write(x):
    """New K/V scattered into a copy of the cache (layer x["layer"]) by a plain loop."""
    kv_pages = np.asarray(x["kv_pages"], np.float32).copy()
    kv = kv_pages[x["layer"]]  # view: [N, 2*Hkv, S, D]
    cu, kl, pi = (np.asarray(x[n]) for n in ("cu_q_lens", "kv_lens", "page_indices"))
    ps, hkv = kv.shape[2], kv.shape[1] // 2
    for r in range(int(x["num_seqs"][0])):
        q_len = cu[r + 1] - cu[r]
        for i in range(q_len):
            pos = kl[r] - q_len + i
            for h in range(hkv):
                kv[pi[r, pos // ps], 2 * h, pos % ps] = np.asarray(x["new_k"][cu[r] + i, h],
                                                                   np.float32)
                kv[pi[r, pos // ps], 2 * h + 1, pos % ps] = np.asarray(x["new_v"][cu[r] + i, h],
                                                                       np.float32)
    return kv_pages


def numpy_attention(x, kv_pages, sm_scale):
    """Naive float64 loop over requests, tokens and heads (layer x["layer"] of kv_pages)."""
    q = np.asarray(x["q"], np.float64)
    kv = np.asarray(kv_pages, np.float64)[x["layer"]]  # [N, 2*Hkv, S, D]
    cu, kl, pi = (np.asarray(x[n]) for n in ("cu_q_lens", "kv_lens", "page_indices"))
    ps, hkv = kv.shape[2], kv.shape[1] // 2
    group = q.shape[1] // hkv
    out = np.zeros_like(q)
    for r in range(int(x["num_seqs"][0])):
        q_len = cu[r + 1] - cu[r]
        for i in range(q_len):
            t = cu[r] + i
            last = kl[r] - q_len + i
            for h in range(q.shape[1]):
                g = h // group
                keys = np.stack([kv[pi[r, p // ps], 2 * g, p % ps] for p in range(last + 1)])
                vals = np.stack([kv[pi[r, p // ps], 2 * g + 1, p % ps] for p in range(last + 1)])
                s = keys @ q[t, h] * sm_scale
                w = np.exp(s - s.max())
                out[t, h] = (w / w.sum()) @ vals
    return out


def run(x, impl, with_write, block_sizes=None):
    """Call the reference or the kernel under jit; the layer is static or a traced argument."""
    sm_scale = x["q"].shape[-1] ** -0.5
    extra = {"new_k": x["new_k"], "new_v": x["new_v"]} if with_write else {}
    if "kv_scales" in x:
        extra["kv_scales"] = x["kv_scales"]
    if impl == "ref":
        op = lambda *a, **kw: rpa.ref_ragged_paged_attention(*a, sm_scale=sm_scale, **kw)
    else:
        op = lambda *a, **kw: rpa.ragged_paged_attention(
            *a, sm_scale=sm_scale, impl=impl, block_sizes=block_sizes, **kw)
    if x["traced_layer"]:
        fn = lambda layer, *a, **kw: op(*a, layer=layer, **kw)
        args = (jnp.asarray(x["layer"], jnp.int32), *(x[n] for n in ARGS))
    else:
        fn = lambda *a, **kw: op(*a, layer=x["layer"], **kw)
        args = tuple(x[n] for n in ARGS)
    try:
        return jax.jit(fn)(*args, **extra)
    except Exception:
        if hasattr(pltpu, "reset_tpu_interpret_mode_state"):
            pltpu.reset_tpu_interpret_mode_state()
        raise


def jax_versions_cases(cases: dict, *marked: str) -> list:
    """The names of ``cases`` as parameters, those in ``marked`` also run on the jax 0.12 leg."""
    assert set(marked) <= set(cases), set(marked) - set(cases)
    return [pytest.param(n, marks=pytest.mark.jax_versions) if n in marked else n for n in cases]


def close(a, b, dtype):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])


# --- reference vs numpy loop --------------------------------------------------------------

REF_CASES = {
    "decode_gqa1": Case([1, 1, 1], [5, 0, 33], num_q_heads=2, num_kv_heads=2),
    "prefill_gqa2": Case([9, 16], [0, 0], num_q_heads=4, num_kv_heads=2),
    "mixed_gqa16_midpage": Case([1, 7, 1, 12], [40, 9, 0, 21], num_q_heads=16, num_kv_heads=1,
                                pad_rows=2, pad_tokens=3),
    "mixed_page256_d256": Case([3, 1], [250, 300], num_q_heads=4, num_kv_heads=1, head_dim=256,
                               page_size=256, pad_tokens=2),
    "bf16_mixed": Case([1, 5], [17, 30], dtype=jnp.bfloat16, pad_rows=1, pad_tokens=1),
    "d64_gqa2": Case([1, 4], [9, 12], head_dim=64),
    "layer2_of_3_traced": Case([1, 6], [20, 3], num_layers=3, layer=2, traced_layer=True,
                               pad_rows=1, pad_tokens=2),
}


@pytest.mark.parametrize("name", jax_versions_cases(REF_CASES, "layer2_of_3_traced"))
def test_reference_matches_numpy_loop(name):
    c = REF_CASES[name]
    x = make_inputs(c)
    o, kv_pages = run(x, "ref", with_write=True)
    want_kv = numpy_write(x)
    np.testing.assert_array_equal(np.asarray(kv_pages, np.float32), want_kv)
    want = numpy_attention(x, want_kv, c.head_dim ** -0.5)
    close(o, want, c.dtype)
    # Without a write the reference attends to the pages as given.
    o2 = run(x, "ref", with_write=False)
    close(o2, numpy_attention(x, x["kv_pages"], c.head_dim ** -0.5), c.dtype)


@pytest.mark.cpu_only(reason="exact softmax weights at rtol 1e-6; XLA:TPU's f32 exp is not "
                            "correctly rounded (the kernel cases check the chip)")
def test_reference_hand_checked():
    """One request, one head, only dim 0 non-zero: softmax weights 1:2(:3) by hand."""
    x = make_inputs(Case([2], [1], num_q_heads=1, num_kv_heads=1, head_dim=128, page_size=16))
    q = np.zeros((2, 1, 128), np.float32)
    q[:, 0, 0] = 1.0
    kv = np.zeros(x["kv_pages"].shape, np.float32)  # [1, N, 2, S, D]
    page = int(x["page_indices"][0, 0])
    kv[0, page, 0, :3, 0] = [0.0, np.log(2.0), np.log(3.0)]  # K: scores (scale 1)
    kv[0, page, 1, :3, 0] = [1.0, 10.0, 100.0]  # V
    x.update(q=jnp.asarray(q), kv_pages=jnp.asarray(kv))
    o = rpa.ref_ragged_paged_attention(*(x[n] for n in ARGS), sm_scale=1.0)
    # token 0 sees positions 0,1: weights 1:2; token 1 sees 0,1,2: weights 1:2:3.
    np.testing.assert_allclose(np.asarray(o[:, 0, 0]), [21.0 / 3, 321.0 / 6], rtol=1e-6)


def test_reference_hand_checked_kv_head_order():
    """Two kv heads: K of head h at index 2h, V at 2h + 1; q head 1 reads kv head 1 only."""
    x = make_inputs(Case([1], [1], num_q_heads=2, num_kv_heads=2, head_dim=128, page_size=16,
                         num_layers=2, layer=1))
    q = np.zeros((1, 2, 128), np.float32)
    q[0, :, 0] = 1.0
    kv = np.zeros(x["kv_pages"].shape, np.float32)  # [2, N, 4, S, D]
    page = int(x["page_indices"][0, 0])
    kv[1, page, 2, :2, 0] = [0.0, np.log(3.0)]  # K of kv head 1: weights 1:3
    kv[1, page, 3, :2, 0] = [4.0, 8.0]  # V of kv head 1
    kv[0, page, 3, :2, 0] = [1e3, 1e3]  # layer 0 must not be read
    x.update(q=jnp.asarray(q), kv_pages=jnp.asarray(kv))
    o = rpa.ref_ragged_paged_attention(*(x[n] for n in ARGS), sm_scale=1.0, layer=1)
    np.testing.assert_allclose(np.asarray(o[0, :, 0]), [0.0, 7.0], rtol=1e-6)


def test_write_new_kv_layout():
    """write_new_kv puts K of kv head h at index 2h and V at 2h + 1 of layer ``layer`` only."""
    x = make_inputs(Case([2], [15], num_layers=2, layer=1))
    kv = rpa.write_new_kv(x["kv_pages"], x["new_k"], x["new_v"], x["kv_lens"],
                          x["page_indices"], x["cu_q_lens"], x["num_seqs"], layer=1)
    p0, p1 = (int(p) for p in x["page_indices"][0, :2])
    # positions 15 (page 0, slot 15) and 16 (page 1, slot 0)
    for t, (page, slot) in enumerate([(p0, 15), (p1, 0)]):
        for h in range(2):
            np.testing.assert_array_equal(kv[1, page, 2 * h, slot], x["new_k"][t, h])
            np.testing.assert_array_equal(kv[1, page, 2 * h + 1, slot], x["new_v"][t, h])
    np.testing.assert_array_equal(kv[0], x["kv_pages"][0])


# --- Pallas (interpret) vs reference -------------------------------------------------------

B = rpa.BlockSizes
KERNEL_CASES = {
    # name: (case, block sizes or None for the defaults, with_write)
    "decode_only": (Case([1, 1, 1, 1], [3, 16, 40, 0]), B(1, 4, 1), False),
    "prefill_only_multiblock": (Case([13, 6], [0, 0]), B(1, 4, 2), True),
    "mixed_chunk_continuation": (Case([1, 9, 1, 5], [30, 20, 0, 11], pad_rows=1, pad_tokens=2),
                                 B(1, 4, 1), True),
    "gqa16_defaults": (Case([1, 6, 1], [20, 10, 47], num_q_heads=16, num_kv_heads=1), None, True),
    "gqa2_small_decode_block": (Case([2, 1, 7], [5, 9, 3]), B(2, 8, 3), False),
    "page256_d256": (Case([1, 4, 1], [260, 3, 10], num_q_heads=2, num_kv_heads=1, head_dim=256,
                          page_size=256, pad_tokens=3), None, True),
    "bf16_mixed": (Case([1, 8, 1], [33, 5, 2], dtype=jnp.bfloat16, pad_rows=2), B(1, 4, 2),
                   True),
    "bf16_page256": (Case([5, 1], [251, 0], dtype=jnp.bfloat16, page_size=256), None, False),
    "d64_bf16_defaults": (Case([1, 7, 1], [18, 4, 30], head_dim=64, dtype=jnp.bfloat16,
                               pad_tokens=1), None, True),
    "layer1_of_2_traced": (Case([1, 5, 1], [17, 9, 0], num_layers=2, layer=1, traced_layer=True,
                                pad_rows=1, pad_tokens=2), B(1, 4, 2), True),
    "layer2_of_3_static_bf16": (Case([3, 1], [12, 40], num_layers=3, layer=2,
                                     dtype=jnp.bfloat16), None, True),
    "f32_q_bf16_cache": (Case([1, 6], [21, 2], kv_dtype=jnp.bfloat16), B(1, 4, 1), True),
    # FP8 pages (half the KV bytes) are upcast to q's dtype in VMEM.
    "bf16_q_fp8_cache": (Case([1, 6, 1], [21, 2, 40], dtype=jnp.bfloat16,
                              kv_dtype=jnp.float8_e4m3fn), B(1, 4, 2), True),
}


@pytest.mark.parametrize("name", jax_versions_cases(KERNEL_CASES, "mixed_chunk_continuation",
                                                    "layer1_of_2_traced", "bf16_q_fp8_cache"))
def test_kernel_matches_reference(name):
    c, block, with_write = KERNEL_CASES[name]
    x = make_inputs(c)
    got = run(x, "interpret", with_write, block)
    want = run(x, "ref", with_write)
    if with_write:
        got, got_kv = got
        want, want_kv = want
        np.testing.assert_array_equal(np.asarray(got_kv, np.float32),
                                      np.asarray(want_kv, np.float32))
        for layer in range(c.num_layers):  # other layers bit-identical to the input
            if layer != c.layer:
                np.testing.assert_array_equal(np.asarray(got_kv[layer]),
                                              np.asarray(x["kv_pages"][layer]))
    close(got, want, c.kv_dtype or c.dtype)
    real = int(x["cu_q_lens"][len(c.q_lens)])
    assert np.all(np.asarray(got[real:], np.float32) == 0.0)  # padding tokens are zero
    assert np.all(np.isfinite(np.asarray(got, np.float32)))


def test_kernel_padding_leaves_pages_untouched_and_outputs_zero():
    c = Case([3, 1], [4, 7], pad_rows=3, pad_tokens=4)
    x = make_inputs(c)
    x["new_k"] = x["new_k"].at[4:].set(1e3)  # padding tokens' K/V must never land in pages
    x["new_v"] = x["new_v"].at[4:].set(1e3)
    o, kv = run(x, "interpret", True, B(1, 4, 1))
    want_kv = numpy_write(x)
    np.testing.assert_array_equal(np.asarray(kv), want_kv)
    assert np.all(np.asarray(o[4:]) == 0.0)
    close(o, numpy_attention(x, want_kv, c.head_dim ** -0.5), c.dtype)


def test_kernel_no_real_requests():
    x = make_inputs(Case([2], [3], pad_rows=1, pad_tokens=2))
    x["num_seqs"] = jnp.asarray([0], jnp.int32)
    assert np.all(np.asarray(run(x, "interpret", False, B(1, 4, 1))) == 0.0)
    assert np.all(np.asarray(run(x, "ref", False)) == 0.0)



def test_prefill_sub_pages():
    """PREFILL_KV_SUB_TOKENS (256) keys per prefill softmax update, whole pages dividing the
    block; otherwise the whole block."""
    sub = rpa.pallas_attention._sub_pages
    assert (sub(2, 256), sub(1, 256), sub(32, 16), sub(8, 16), sub(3, 128), sub(2, 512)) == (
        1, 1, 16, 8, 3, 1)


F8 = jnp.float8_e4m3fn
# 2 pages per K/V block, prefill items in sub-blocks of 1 (page 256) or 2 (page 16, 32-key
# sub-blocks) pages: request 0 straddles a sub-block boundary, request 2's last block has a
# sub-block past every row's causal bound; request 1 is a decode item (whole blocks).
SUB_BLOCK_CASES = {
    # name: (case, block sizes, PREFILL_KV_SUB_TOKENS)
    "page256_bf16": (Case([40, 1, 30], [250, 7, 600], num_q_heads=2, num_kv_heads=1,
                          page_size=256, dtype=jnp.bfloat16, pad_tokens=2), B(8, 32, 2), 256),
    "page256_fp8_scaled": (Case([40, 1, 30], [250, 7, 600], num_q_heads=4, num_kv_heads=1,
                                head_dim=256, page_size=256, dtype=jnp.bfloat16, kv_dtype=F8,
                                scaled=True), B(4, 16, 2), 256),
    "page16_f32_q_fp8_scaled_two_page_sub_blocks": (
        Case([20, 1, 13], [50, 3, 100], kv_dtype=F8, scaled=True, pad_rows=1), B(2, 8, 4), 32),
}


@pytest.mark.parametrize("name", list(SUB_BLOCK_CASES))
def test_kernel_prefill_sub_blocks(name, monkeypatch):
    c, block, sub_tokens = SUB_BLOCK_CASES[name]
    monkeypatch.setattr(rpa.pallas_attention, "PREFILL_KV_SUB_TOKENS", sub_tokens)
    assert rpa.pallas_attention._sub_pages(block.kv_pages_per_block, c.page_size) < (
        block.kv_pages_per_block)
    x = make_inputs(c)
    got, want = run(x, "interpret", True, block)[0], run(x, "ref", True)[0]
    close(got, want, c.kv_dtype or c.dtype)
    real = int(x["cu_q_lens"][len(c.q_lens)])
    assert np.all(np.asarray(got[real:], np.float32) == 0.0)


# --- Pallas K/V write (interpret) vs write_new_kv, bit for bit ------------------------------

WRITE_CASES = {
    # name: case (dtype is the cache's; the window W is min(page, 8/16/32 rows for 32/16/8 bit))
    "decode_f32_page16": Case([1, 1, 1, 1], [3, 16, 40, 0]),
    "decode_bf16_page256_d256": Case([1, 1, 1], [0, 255, 300], head_dim=256, page_size=256,
                                     dtype=jnp.bfloat16, pad_rows=2),
    # 40 tokens from position 250: windows 240 (page 0), 256, 272, 288 (page 1).
    "prefill_bf16_page256_mid_window": Case([40, 3], [250, 7], head_dim=256, page_size=256,
                                            dtype=jnp.bfloat16, pad_tokens=5),
    "prefill_bf16_page16_pages": Case([37, 5, 1], [5, 13, 0], head_dim=64, dtype=jnp.bfloat16),
    "f32_page256_w8_d64": Case([20, 1, 9], [3, 100, 260], head_dim=64, page_size=256),
    "fp8_page256_w32_d256": Case([45, 1, 2], [20, 31, 63], head_dim=256, page_size=256,
                                 dtype=F8, pad_rows=1, pad_tokens=2),
    "fp8_page16_d64": Case([1, 19, 1], [15, 9, 0], head_dim=64, dtype=F8),
    "layer1_of_3_traced_bf16": Case([1, 6, 1], [17, 9, 0], num_layers=3, layer=1,
                                    traced_layer=True, dtype=jnp.bfloat16, pad_rows=1,
                                    pad_tokens=2),
    "layer2_of_3_static_f32": Case([3, 1], [12, 40], num_layers=3, layer=2),
    # Every request straddles a page: 2 items per request, more than R + cdiv(T, W).
    "straddling_pairs": Case([2] * 6, [15, 31, 47, 63, 79, 95], head_dim=64),
    "padding_only": Case([2], [3], pad_rows=2, pad_tokens=3),
}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def bits(a):
    a = np.asarray(a)
    return a.view(UINT[a.dtype.itemsize])


def run_write(x, impl):
    """write_new_kv ("ref") or the Pallas write ("interpret") of x's new K/V, under jit."""
    lyr = x["kv_pages"].shape[0]

    def fn(layer, kv_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, num_seqs,
           kv_scales=None):
        meta = (kv_lens, page_indices, cu_q_lens, num_seqs)
        if impl == "ref":
            return rpa.write_new_kv(kv_pages, new_k, new_v, *meta, layer, kv_scales=kv_scales)
        return rpa._pallas_write_new_kv(kv_pages, new_k, new_v, rpa._layer_index(layer, lyr),
                                        *meta, interpret=pltpu.InterpretParams(),
                                        kv_scales=kv_scales)

    args = [x[n] for n in ("kv_pages", "new_k", "new_v", "kv_lens", "page_indices",
                           "cu_q_lens", "num_seqs")] + ([x["kv_scales"]] if "kv_scales" in x
                                                        else [])
    if x["traced_layer"]:
        return jax.jit(fn)(jnp.asarray(x["layer"], jnp.int32), *args)
    return jax.jit(lambda *a: fn(x["layer"], *a))(*args)


@pytest.mark.parametrize("name", jax_versions_cases(WRITE_CASES, "fp8_page256_w32_d256",
                                                    "layer1_of_3_traced_bf16"))
def test_pallas_write_equals_write_new_kv(name):
    c = WRITE_CASES[name]
    x = make_inputs(c)
    real = int(x["cu_q_lens"][len(c.q_lens)])
    if name == "padding_only":
        x["num_seqs"] = jnp.asarray([0], jnp.int32)
    # Signed zeros and infinities of real tokens land exactly; NaNs of padding tokens nowhere.
    special = -0.0 if c.dtype == F8 else -jnp.inf
    x["new_k"] = x["new_k"].at[0, 0, :2].set(jnp.asarray([-0.0, special], c.dtype))
    x["new_v"] = x["new_v"].at[real:].set(jnp.nan)
    got = run_write(x, "interpret")
    want = run_write(x, "ref")
    np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(np.asarray(want, np.float32), numpy_write(x))
    for layer in range(c.num_layers):  # other layers bit-identical to the input
        if layer != c.layer:
            np.testing.assert_array_equal(bits(got[layer]), bits(x["kv_pages"][layer]))
    if name == "padding_only":
        np.testing.assert_array_equal(bits(got), bits(x["kv_pages"]))


def test_pallas_write_rejects_page_not_multiple_of_tile():
    x = make_inputs(Case([1], [3], page_size=24, dtype=jnp.bfloat16))  # bf16 tile: 16 rows
    with pytest.raises(ValueError, match="multiple of the 16-row tile"):
        rpa.ragged_paged_attention(*(x[n] for n in ARGS), sm_scale=1.0, impl="interpret",
                                   new_k=x["new_k"], new_v=x["new_v"])


# --- invalid input and cost -------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["reference", "interpret"])
@pytest.mark.parametrize("what", ["q_rank", "head_dim", "heads", "kv_rank", "kv_odd_heads",
                                  "cu_len", "pi_rows", "num_seqs", "float_lens", "new_k_only",
                                  "new_k_shape", "layer_range", "layer_float"])
def test_invalid_inputs_raise(impl, what):
    x = make_inputs(Case([1, 2], [3, 4], num_layers=2))
    extra = {}
    if what == "q_rank":
        x["q"] = x["q"][:, 0]
    elif what == "head_dim":
        x["q"] = x["q"][..., :64]
    elif what == "heads":
        x["q"] = x["q"][:, :3]
    elif what == "kv_rank":
        x["kv_pages"] = x["kv_pages"][0]
    elif what == "kv_odd_heads":
        x["kv_pages"] = x["kv_pages"][:, :, :3]
    elif what == "cu_len":
        x["cu_q_lens"] = x["cu_q_lens"][:-1]
    elif what == "pi_rows":
        x["page_indices"] = x["page_indices"][:-1]
    elif what == "num_seqs":
        x["num_seqs"] = jnp.asarray([2, 0], jnp.int32)
    elif what == "float_lens":
        x["kv_lens"] = x["kv_lens"].astype(jnp.float32)
    elif what == "new_k_only":
        extra = {"new_k": x["new_k"]}
    elif what == "new_k_shape":
        extra = {"new_k": x["new_k"][:, :1], "new_v": x["new_v"][:, :1]}
    elif what == "layer_range":
        extra = {"layer": 2}
    elif what == "layer_float":
        extra = {"layer": jnp.asarray(1.0)}
    with pytest.raises(ValueError, match="ragged_paged_attention"):
        rpa.ragged_paged_attention(*(x[n] for n in ARGS), sm_scale=1.0, impl=impl, **extra)


def test_cost_counts_scale_with_shapes():
    c1 = rpa.ragged_paged_attention_cost((8, 4, 128), (3, 10, 4, 16, 128), (2, 4))
    c2 = rpa.ragged_paged_attention_cost((16, 4, 128), (3, 10, 4, 16, 128), (2, 4))
    c3 = rpa.ragged_paged_attention_cost((16, 4, 128), (3, 10, 4, 16, 128), (2, 4),
                                         write_new_kv=True)
    assert c1.flops == 4 * 8 * 4 * 64 * 128
    assert c2.flops == 2 * c1.flops
    assert c1.transcendentals == 8 * 4 * 64
    assert c2.bytes_accessed > c1.bytes_accessed > 0
    assert c3.bytes_accessed == c2.bytes_accessed + 16 * 4 * 128 * 2  # new K/V rows, bf16
    # the number of layers in the cache does not change one call's cost
    assert rpa.ragged_paged_attention_cost((8, 4, 128), (7, 10, 4, 16, 128), (2, 4)) == c1


# --- the XLA serving path (CPU/GPU) vs the reference ----------------------------------------

XLA_CASES = {
    **REF_CASES,
    # Requests of very different lengths: the short ones' blocks past their pages are masked.
    "many_blocks_ragged": Case([1, 1, 5, 1], [3, 130, 60, 0], num_q_heads=4, num_kv_heads=2,
                               head_dim=64, pad_rows=2, pad_tokens=3, num_layers=2, layer=1),
    # 30 tokens with a cached prefix (two groups of the split form's prefix pass) around a
    # fresh prompt.
    "prefix_groups": Case([20, 1, 11, 9], [40, 5, 0, 3], num_q_heads=4, num_kv_heads=2,
                          head_dim=64, pad_tokens=2),
}


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["split", "paged"])
@pytest.mark.parametrize("pages_per_block", [1, 3, 64])
@pytest.mark.parametrize("name", jax_versions_cases(XLA_CASES, "many_blocks_ragged"))
def test_xla_path_matches_reference(name, pages_per_block, batch_invariant):
    """Blocks of 1 and 3 pages split requests into many blocks (3 does not divide the page
    table); 64 covers it in one block. Both XLA forms: the split one (in-step keys dense,
    cached prefixes from the pages for the tokens that have one) and the batch-invariant one
    (every key from the pages). Written K/V bit-identical, padding tokens zero."""
    c = XLA_CASES[name]
    x = make_inputs(c)
    sm_scale = c.head_dim ** -0.5
    kw = dict(sm_scale=sm_scale, new_k=x["new_k"], new_v=x["new_v"], layer=c.layer)
    got, got_kv = jax.jit(lambda *a: rpa.xla_ragged_paged_attention(
        *a, pages_per_block=pages_per_block, batch_invariant=batch_invariant, **kw))(
        *(x[n] for n in ARGS))
    want, want_kv = jax.jit(lambda *a: rpa.ref_ragged_paged_attention(*a, **kw))(
        *(x[n] for n in ARGS))
    np.testing.assert_array_equal(np.asarray(got_kv, np.float32), np.asarray(want_kv, np.float32))
    close(got, want, c.dtype)
    real = int(x["cu_q_lens"][len(c.q_lens)])
    assert np.all(np.asarray(got[real:], np.float32) == 0.0)


@pytest.mark.cpu_only(reason="auto picks Pallas on a TPU")
def test_auto_picks_the_xla_path_off_tpu():
    from sglang_tpu_backend.kernels import dispatch

    assert dispatch.resolve("auto", has_xla=True) == "xla"
    assert dispatch.resolve("auto") == "reference"  # kernels without an XLA path
    assert dispatch.resolve("xla") == "reference"
    assert dispatch.resolve("reference", has_xla=True) == "reference"


# --- FP8 cache with per-row scales (kv_scales) ----------------------------------------------

SCALED_CASES = {
    # name: (case, Pallas block sizes or None for the defaults)
    "decode_prefill_mix_page16": (Case([1, 9, 1, 5], [30, 20, 0, 11], dtype=jnp.bfloat16,
                                       kv_dtype=F8, scaled=True, pad_rows=1, pad_tokens=2),
                                  B(1, 4, 2)),
    "gqa4_d64_f32_q": (Case([1, 6, 1], [21, 2, 40], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            kv_dtype=F8, scaled=True, num_layers=2, layer=1,
                            traced_layer=True), B(1, 4, 1)),
    "page256_d256_defaults": (Case([3, 1], [250, 300], num_q_heads=4, num_kv_heads=1,
                                   head_dim=256, page_size=256, dtype=jnp.bfloat16, kv_dtype=F8,
                                   scaled=True, pad_tokens=2), None),
}


def dequantized_pages(kv_pages, kv_scales):
    return np.asarray(kv_pages, np.float32) * np.asarray(kv_scales)[..., None]


@pytest.mark.parametrize("name", jax_versions_cases(SCALED_CASES, "decode_prefill_mix_page16"))
def test_fp8_scaled_cache_all_paths(name):
    """Reference vs a numpy loop over the dequantised pages; the Pallas kernel (interpret) and
    the XLA path vs the reference: written pages and scales bit-identical, outputs close."""
    c, block = SCALED_CASES[name]
    x = make_inputs(c)
    o, kv, sc = run(x, "ref", with_write=True)
    # Rows not written keep their scale; written rows hold fp8(row / scale), scale = amax / 448.
    rows, scales = rpa.quantize_rows(
        jnp.stack([x["new_k"], x["new_v"]], 2).reshape(x["q"].shape[0], -1, c.head_dim), F8)
    want_scales = np.asarray(x["kv_scales"]).copy()
    cu, kl, pi = (np.asarray(x[n]) for n in ("cu_q_lens", "kv_lens", "page_indices"))
    for r in range(len(c.q_lens)):
        for i in range(c.q_lens[r]):
            pos = kl[r] - c.q_lens[r] + i
            page, slot = pi[r, pos // c.page_size], pos % c.page_size
            want_scales[c.layer, page, :, slot] = np.asarray(scales[cu[r] + i])
            np.testing.assert_array_equal(bits(kv[c.layer, page, :, slot]),
                                          bits(rows[cu[r] + i]))
    np.testing.assert_array_equal(np.asarray(sc), want_scales)
    want = numpy_attention(x, dequantized_pages(kv, sc), c.head_dim ** -0.5)
    close(o, want, jnp.float32 if c.dtype == jnp.float32 else jnp.bfloat16)

    got_o, got_kv, got_sc = run(x, "interpret", True, block)
    np.testing.assert_array_equal(bits(got_kv), bits(kv))
    np.testing.assert_array_equal(bits(got_sc), bits(sc))
    close(got_o, o, c.kv_dtype)
    assert np.all(np.asarray(got_o[int(cu[len(c.q_lens)]):], np.float32) == 0.0)
    for batch_invariant in (False, True):  # the split form and the all-from-pages form
        xo, xkv, xsc = jax.jit(lambda *a, **kw: rpa.xla_ragged_paged_attention(
            *a, sm_scale=c.head_dim ** -0.5, layer=c.layer, batch_invariant=batch_invariant,
            **kw))(*(x[n] for n in ARGS), new_k=x["new_k"], new_v=x["new_v"],
                   kv_scales=x["kv_scales"])
        np.testing.assert_array_equal(bits(xkv), bits(kv))
        np.testing.assert_array_equal(bits(xsc), bits(sc))
        close(xo, o, c.kv_dtype)


def test_fp8_scales_keep_rows_of_any_range():
    """Rows of magnitude 1e-3 and 1e3 come back within e4m3's relative step (2^-3 of the
    row's max) with scales; a plain cast to fp8 flushes the small row to zero."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64)), jnp.float32)
    x = x * jnp.asarray([[1e-3], [1e3]])
    q, s = rpa.quantize_rows(x, F8)
    back = np.asarray(rpa.dequantize(q, s))
    amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    assert np.all(np.abs(back - np.asarray(x)) <= amax * 2.0 ** -4)
    assert float(np.abs(q.astype(jnp.float32)).max()) == rpa.FP8_MAX
    plain_err = np.abs(np.asarray(x[0].astype(F8), np.float32) - np.asarray(x[0])).max()
    assert plain_err > 10 * np.abs(back[0] - np.asarray(x[0])).max()
    zq, zs = rpa.quantize_rows(jnp.zeros((3, 8)), F8)  # zero rows: scale 1, values 0
    assert np.all(np.asarray(zs) == 1.0) and np.all(np.asarray(zq, np.float32) == 0.0)


def test_fp8_scales_shape_is_validated():
    x = make_inputs(Case([1], [3], kv_dtype=F8, scaled=True))
    with pytest.raises(ValueError, match="kv_scales must be f32"):
        rpa.ragged_paged_attention(*(x[n] for n in ARGS), sm_scale=1.0, impl="reference",
                                   kv_scales=x["kv_scales"][..., :-1])


SCALED_WRITE_CASES = {
    # 40 tokens from position 250: windows 240 (page 0), 256, 288 (page 1), W = 32 rows.
    "prefill_page256_w32_mid_window": Case([40, 1, 3], [250, 31, 7], head_dim=256,
                                           page_size=256, dtype=jnp.bfloat16, kv_dtype=F8,
                                           scaled=True, pad_rows=1, pad_tokens=2),
    "mixed_page16_layer1_of_2_traced": Case([1, 19, 1], [15, 9, 0], head_dim=64, kv_dtype=F8,
                                            scaled=True, num_layers=2, layer=1,
                                            traced_layer=True, pad_tokens=3),
    "padding_only": Case([2], [3], kv_dtype=F8, scaled=True, pad_rows=2, pad_tokens=3),
}


@pytest.mark.parametrize("name", jax_versions_cases(SCALED_WRITE_CASES,
                                                    "prefill_page256_w32_mid_window"))
def test_pallas_write_equals_write_new_kv_with_scales(name):
    """FP8 rows and their scales: the Pallas write and the XLA scatter bit for bit; zero and
    non-finite rows of real tokens land alike; padding tokens (NaN) write nowhere; other
    layers and unwritten scales keep their bits."""
    c = SCALED_WRITE_CASES[name]
    x = make_inputs(c)
    real = int(x["cu_q_lens"][len(c.q_lens)])
    if name == "padding_only":
        x["num_seqs"] = jnp.asarray([0], jnp.int32)
    x["new_k"] = x["new_k"].at[0, 0].set(0.0).at[real - 1, -1, 0].set(jnp.inf)
    x["new_k"] = x["new_k"].at[real:].set(jnp.nan)
    x["new_v"] = x["new_v"].at[real:].set(jnp.nan)
    (got_kv, got_sc), (want_kv, want_sc) = run_write(x, "interpret"), run_write(x, "ref")
    np.testing.assert_array_equal(bits(got_kv), bits(want_kv))
    np.testing.assert_array_equal(bits(got_sc), bits(want_sc))
    assert np.all(np.isfinite(np.asarray(want_sc)))
    changed = np.asarray(want_sc) != np.asarray(x["kv_scales"])  # [Lyr, N, 2*Hkv, S]
    for layer in range(c.num_layers):
        if layer != c.layer:
            assert not changed[layer].any()
            np.testing.assert_array_equal(bits(got_kv[layer]), bits(x["kv_pages"][layer]))
    if name == "padding_only":
        assert not changed.any()
        np.testing.assert_array_equal(bits(got_kv), bits(x["kv_pages"]))
    else:  # one scale per written (token, K/V head); the zero row's is 1
        assert changed.sum() <= real * 2 * c.num_kv_heads
        assert changed.sum() >= (real - 1) * 2 * c.num_kv_heads
