"""ragged_paged_attention (kernels/ragged_paged_attention/) compiled by Mosaic for one TPU7x
TensorCore, with the new K/V written into the stacked cache and the layer a traced scalar.

Tiny model: Hq=4, Hkv=2, D=64, page 16, 2 layers x 256 pages, up to 8 pages (128 tokens) per
request; 16 decode rows (T=R=16) and 64 mixed tokens (R=16), the latter also with f32 queries
over the bf16 cache.
Qwen3.5-397B per chip: Hq=32, Hkv=2, D=256, page 256, 15 attention layers x 4096 pages (a 30 GiB
bf16 cache), up to 32 pages (8K tokens) per request; decode at T=R=64 and T=R=512, mixed
prefill + decode at T=1024 and T=2048 (R=64). Metadata is data, so "decode" and "mixed" differ
only in T and R here.

Each program donates the cache; the assertions check that the Pallas write of the new K/V
updates it in place (the cache is aliased and no temporary the size of a cache layer appears):
two Mosaic kernels per call (write, attention). The last case compiles a ``lax.scan`` over the
15 attention layers of (write + attention), the model's loop, and checks that XLA never copies
or relays out the stacked cache (before the Pallas write, XLA's scatter made it copy the whole
cache twice per layer: a temporary of one full cache).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from sglang_tpu_backend.kernels import ragged_paged_attention as rpa
from sglang_tpu_backend.kernels.tpu_compile import abstract, compile_for_tpu

BF16, F32 = jnp.bfloat16, jnp.float32
# (label, T tokens, R rows, Hq, Hkv, D, S page size, P pages per row, N pages, Lyr layers,
#  q dtype); the cache and new K/V are bf16.
SHAPES = [
    ("tiny decode", 16, 16, 4, 2, 64, 16, 8, 256, 2, BF16),
    ("tiny mixed", 64, 16, 4, 2, 64, 16, 8, 256, 2, BF16),
    ("tiny mixed", 64, 16, 4, 2, 64, 16, 8, 256, 2, F32),
    ("397B decode", 64, 64, 32, 2, 256, 256, 32, 4096, 15, BF16),
    ("397B decode", 512, 512, 32, 2, 256, 256, 32, 4096, 15, BF16),
    ("397B mixed", 1024, 64, 32, 2, 256, 256, 32, 4096, 15, BF16),
    ("397B mixed", 2048, 64, 32, 2, 256, 256, 32, 4096, 15, BF16),
]


@pytest.mark.parametrize(
    "label,t,r,hq,hkv,d,s,p,n,lyr,q_dtype", SHAPES,
    ids=[f"{sh[0].split()[0]}-T{sh[1]}-R{sh[2]}-q{jnp.dtype(sh[-1]).name}" for sh in SHAPES])
def test_ragged_paged_attention_compiles(mesh, record, label, t, r, hq, hkv, d, s, p, n, lyr,
                                         q_dtype):
    dt = BF16
    i32 = jnp.int32
    args = [
        abstract((t, hq, d), q_dtype, mesh),  # q
        abstract((lyr, n, 2 * hkv, s, d), dt, mesh),  # kv_pages (donated)
        abstract((r,), i32, mesh),  # kv_lens
        abstract((r, p), i32, mesh),  # page_indices
        abstract((r + 1,), i32, mesh),  # cu_q_lens
        abstract((1,), i32, mesh),  # num_seqs
        abstract((), i32, mesh),  # layer (traced)
        abstract((t, hkv, d), dt, mesh),  # new_k
        abstract((t, hkv, d), dt, mesh),  # new_v
    ]

    def fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, layer, new_k, new_v):
        return rpa.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=d ** -0.5, new_k=new_k,
                                          new_v=new_v, layer=layer, impl="pallas")

    report = compile_for_tpu(fn, args, mesh, donate_argnums=(1,))
    record(f"ragged_paged_attention {label} T={t} R={r} Hq={hq} Hkv={hkv} D={d} page={s} "
           f"cache [{lyr},{n},{2 * hkv},{s},{d}] q {jnp.dtype(q_dtype).name}", report)
    assert len(report.kernels) == 2  # the K/V write and the attention
    cache_bytes = lyr * n * 2 * hkv * s * d * jnp.dtype(dt).itemsize
    layer_bytes = cache_bytes // lyr
    assert report.memory["alias_size_in_bytes"] >= cache_bytes  # cache updated in place
    assert report.memory["temp_size_in_bytes"] < layer_bytes  # no copy of the cache


def test_layer_scan_writes_cache_in_place(mesh, record):
    """15 layers of (write + attention) in a lax.scan at 397B decode shapes (T=R=64): the
    stacked bf16 cache [15, 2048, 4, 256, 256] (15 GiB) is carried and updated in place."""
    t = r = 64
    lyr, n, hkv, hq, s, d, p = 15, 2048, 2, 32, 256, 256, 32
    dt, i32 = BF16, jnp.int32
    cache_shape = (lyr, n, 2 * hkv, s, d)
    args = [
        abstract(cache_shape, dt, mesh),  # kv_pages (donated)
        abstract((lyr, t, hq, d), dt, mesh),  # q of every layer
        abstract((lyr, t, hkv, d), dt, mesh),  # new_k of every layer
        abstract((lyr, t, hkv, d), dt, mesh),  # new_v of every layer
        abstract((r,), i32, mesh),  # kv_lens
        abstract((r, p), i32, mesh),  # page_indices
        abstract((r + 1,), i32, mesh),  # cu_q_lens
        abstract((1,), i32, mesh),  # num_seqs
    ]

    def fn(kv_pages, q, new_k, new_v, kv_lens, page_indices, cu_q_lens, num_seqs):
        def layer_step(kv, xs):
            layer, q_l, k_l, v_l = xs
            o, kv = rpa.ragged_paged_attention(q_l, kv, kv_lens, page_indices, cu_q_lens,
                                               num_seqs, sm_scale=d ** -0.5, new_k=k_l,
                                               new_v=v_l, layer=layer, impl="pallas")
            return kv, o

        return jax.lax.scan(layer_step, kv_pages,
                            (jnp.arange(lyr, dtype=i32), q, new_k, new_v))

    report = compile_for_tpu(fn, args, mesh, donate_argnums=(0,))
    record(f"ragged_paged_attention scan over {lyr} layers (write + attention) T={t} R={r} "
           f"cache [{lyr},{n},{2 * hkv},{s},{d}]", report, min_kernels=2)
    cache_bytes = lyr * n * 2 * hkv * s * d * jnp.dtype(dt).itemsize
    assert report.memory["alias_size_in_bytes"] >= cache_bytes  # cache updated in place
    assert report.memory["temp_size_in_bytes"] < cache_bytes // 8, report.memory
    # Only the loop plumbing and the two Mosaic kernels produce a value of the cache's shape:
    # no copy, scatter or relayout (copy / sparse-core data-format call) of it.
    shape = re.escape(f"bf16[{','.join(map(str, cache_shape))}]")
    made = re.findall(rf"^\s*(?:ROOT )?%(\S+) = {shape}{{[^}}]*}} ([\w-]+)\((.*)$", report.hlo,
                      re.MULTILINE)
    allowed = {"parameter", "get-tuple-element", "tuple", "while", "bitcast"}
    bad = [f"{name} = {op}" for name, op, rest in made if op not in allowed
           and not (op == "custom-call" and 'custom_call_target="tpu_custom_call"' in rest)]
    assert made and not bad, bad


F8 = jnp.float8_e4m3fn
# (label, T, R, Hq, Hkv, D, S, P, N, Lyr) of an FP8 cache with per-row f32 scales
# (--kv-cache-dtype fp8_e4m3); q and the new K/V bf16 (quantised before the write kernel).
FP8_SHAPES = [
    ("tiny mixed", 64, 16, 4, 2, 64, 16, 8, 256, 2),
    ("397B decode", 64, 64, 32, 2, 256, 256, 32, 4096, 15),
    ("397B mixed", 1024, 64, 32, 2, 256, 256, 32, 4096, 15),
]


@pytest.mark.parametrize("label,t,r,hq,hkv,d,s,p,n,lyr", FP8_SHAPES,
                         ids=[f"{sh[0].split()[0]}-T{sh[1]}-R{sh[2]}" for sh in FP8_SHAPES])
def test_fp8_scaled_cache_compiles(mesh, record, label, t, r, hq, hkv, d, s, p, n, lyr):
    """The FP8 write (rows and the touched pages' scale blocks) and attention (scale blocks
    DMA'd beside the pages; K scales on the scores, V scales on the probabilities) compile,
    both caches donated and updated in place."""
    i32 = jnp.int32
    args = [
        abstract((t, hq, d), BF16, mesh),  # q
        abstract((lyr, n, 2 * hkv, s, d), F8, mesh),  # kv_pages (donated)
        abstract((lyr, n, 2 * hkv, s), F32, mesh),  # kv_scales (donated)
        abstract((r,), i32, mesh),  # kv_lens
        abstract((r, p), i32, mesh),  # page_indices
        abstract((r + 1,), i32, mesh),  # cu_q_lens
        abstract((1,), i32, mesh),  # num_seqs
        abstract((), i32, mesh),  # layer (traced)
        abstract((t, hkv, d), BF16, mesh),  # new_k
        abstract((t, hkv, d), BF16, mesh),  # new_v
    ]

    def fn(q, kv_pages, kv_scales, kv_lens, page_indices, cu_q_lens, num_seqs, layer, new_k,
           new_v):
        return rpa.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=d ** -0.5, new_k=new_k,
                                          new_v=new_v, layer=layer, impl="pallas",
                                          kv_scales=kv_scales)

    report = compile_for_tpu(fn, args, mesh, donate_argnums=(1, 2))
    record(f"ragged_paged_attention fp8+scales {label} T={t} R={r} Hq={hq} Hkv={hkv} D={d} "
           f"page={s} cache [{lyr},{n},{2 * hkv},{s},{d}]", report)
    assert len(report.kernels) == 2  # the K/V write and the attention
    pages_bytes = lyr * n * 2 * hkv * s * d
    scales_bytes = lyr * n * 2 * hkv * s * 4
    assert report.memory["alias_size_in_bytes"] >= pages_bytes + scales_bytes  # in place
    assert report.memory["temp_size_in_bytes"] < pages_bytes // lyr  # no copy of a cache
