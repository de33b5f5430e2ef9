"""benchmarks/bench_kernels.py on the smoke preset (kernels in interpret mode on the CPU): a few
cases of each kind, the JSON and markdown outputs, one cost checked by hand, and a peer that
raises recorded as an error instead of ending the run."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from tests.scripts import load_script

ONLY = ["attention/decode-4x64-bf16", "gmm/down-bf16-decode", "gdn/decode-4-f32",
        "routing/reduce-decode", "collectives/packed"]


def load_bench():
    return load_script("benchmarks/bench_kernels.py")


def test_smoke_run_rows_costs_json_and_failing_peer(tmp_path, monkeypatch, capsys):
    bench = load_bench()
    real_routing_case = bench.routing_case

    def with_failing_peer(*a, **k):  # inject a peer that raises when it is called
        setup = real_routing_case(*a, **k)

        def boom(*args):
            raise RuntimeError("injected peer failure\nsecond line")

        setup.peers.append(bench.Impl("boom", boom, setup.ours.make_args))
        return setup

    monkeypatch.setattr(bench, "routing_case", with_failing_peer)
    out_json, out_md = tmp_path / "k.json", tmp_path / "k.md"
    argv = ["--preset", "smoke", "--interpret", "--warmup", "1", "--iters", "2",
            "--json-out", str(out_json), "--markdown-out", str(out_md)]
    for s in ONLY:
        argv += ["--only", s]
    result = bench.main(argv)

    data = json.loads(out_json.read_text())
    for field in ("device_kind", "jax_version", "preset", "timestamp", "rows", "impl"):
        assert field in data
    assert data["preset"] == "smoke"
    rows = {r["name"]: r for r in data["rows"]}
    assert len(rows) == len(ONLY) == len(result["rows"])
    for name, r in rows.items():
        if name.startswith("collectives/"):
            assert "skipped" in r
            continue
        assert r["ours"]["time_ms"] > 0 and r["ours"]["min_ms"] > 0, r
        assert r["bytes"] > 0 and r["flops"] > 0, r
        assert r["peers"], r
        ok = [pe for pe in r["peers"] if "error" not in pe]
        assert ok and all(pe["time_ms"] > 0 and "max_abs_diff_vs_peer" in pe for pe in ok), r

    # Hand-checked cost: 4 decode requests at context 64; Hq 4, Hkv 2, D 128, page 16, bf16.
    # q in + o out 2*4*4*128*2 = 8,192; K and V rows 4*64 tokens * 4 heads * 128 * 2 = 262,144;
    # metadata i32: kv_lens 4 + page table 4*4 + cu_q_lens 5 + num_seqs 1 + layer 1 = 27 -> 108.
    # flops: 4 * Hq * D * keys = 4 * 4 * 128 * (4 * 64) = 524,288.
    attn = rows["attention/decode-4x64-bf16"]
    assert attn["bytes"] == 8192 + 262144 + 108
    assert attn["flops"] == 4 * 4 * 128 * 4 * 64
    # ... which is the kernel's own cost model at these shapes (full pages, one token each)
    from sglang_tpu_backend.kernels.ragged_paged_attention import ragged_paged_attention_cost
    helper = ragged_paged_attention_cost((4, 4, 128), (1, 16, 4, 16, 128), (4, 4))
    assert (attn["bytes"], attn["flops"]) == (helper.bytes_accessed, helper.flops)
    assert any(pe["name"] == "ours-xla" and pe["max_abs_diff_vs_peer"] < 0.05
               for pe in attn["peers"])

    # The injected peer is an error row; the other peer of that case still ran.
    red = rows["routing/reduce-decode"]
    boom = [pe for pe in red["peers"] if pe["name"] == "boom"]
    assert boom and boom[0]["error"] == "RuntimeError: injected peer failure"
    assert any(pe["name"] == "xla-reference" and pe["time_ms"] > 0 for pe in red["peers"])

    md = out_md.read_text()
    assert "| case |" in md and "attention/decode-4x64-bf16" in md
    printed = capsys.readouterr().out
    assert "speed-up" in printed and "gmm/down-bf16-decode-gathered" in printed


def test_list_names_every_kind():
    bench = load_bench()
    names = bench.main(["--preset", "397b", "--list"])["cases"]
    for part in ("attention/decode-64x2048-bf16", "attention/decode-64x8192-fp8",
                 "attention/kv-write", "gmm/gate_up-fp8-prefill-packed",
                 "gmm/down-bf16-prefill-gathered", "gdn/decode-64-bf16-state",
                 "gdn/prefill-4x1024", "routing/gather-prefill", "collectives/"):
        assert any(part in n for n in names), part


@pytest.mark.parametrize("in_flight", [1, 3, 8])
def test_dma_read_ceiling_reads_every_chunk_once(in_flight):
    """The manual-DMA ceiling (``kernel_ceilings.dma_read``) sums each chunk's first 8 rows:
    a ring slot refilled too early or a chunk skipped changes the sum."""
    import numpy as np

    ceil = load_script("benchmarks/kernel_ceilings.py")
    x = np.random.default_rng(0).standard_normal((3, 64, 128)).astype(np.float32)
    got = ceil.dma_read(jnp.asarray(x), chunk_rows=16, in_flight=in_flight, interpret=True)
    want = x.reshape(-1, 16, 128)[:, :8].sum(0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_attention_matmuls_ceiling_visits_each_q_block_s_causal_kv_blocks():
    """``kernel_ceilings.attention_matmuls`` (the MXU ceiling of attention prefill) sums
    bf16(q k^T) v over exactly the kv blocks up to each q block's causal bound: a block more
    or less, or a q block fed another's bound, changes the sum."""
    import numpy as np

    ceil = load_script("benchmarks/kernel_ceilings.py")
    r, hkv, g, t, ctx, d, bq, bkv = 2, 2, 2, 16, 48, 128, 8, 16
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in
               ((r, hkv, t * g, d), (r, hkv, ctx, d), (r, hkv, ctx, d)))
    got = ceil.attention_matmuls(q, k, v, group=g, q_tokens=bq, kv_block=bkv, interpret=True)
    qf, kf, vf = (np.asarray(x, np.float32) for x in (q, k, v))
    want = np.zeros(q.shape, np.float32)
    for j in range(t // bq):  # q block j's last token sits at ctx - t + (j+1)*bq - 1
        keys = -(-(ctx - t + (j + 1) * bq) // bkv) * bkv
        rows = slice(j * bq * g, (j + 1) * bq * g)
        s = np.einsum("rhqd,rhkd->rhqk", qf[:, :, rows], kf[:, :, :keys])
        s = np.asarray(jnp.asarray(s).astype(jnp.bfloat16), np.float32)
        want[:, :, rows] = np.einsum("rhqk,rhkd->rhqd", s, vf[:, :, :keys])
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2,
                               atol=2e-2 * np.abs(want).max())
    assert not np.allclose(want[:, :, : bq * g], 0)  # the first q block saw a partial context


def test_gdn_chunk_matmuls_ceiling_carries_the_state_across_chunks():
    """``kernel_ceilings.gdn_chunk_matmuls`` (the GDN chunked kernel's matmul chain alone)
    against a float64 loop over each head block's chunks: T = (I + tril(beta K K^T, -1))^-1,
    U = T V, W = T K, V' = U - W S, O = Q S + tril(Q K^T) V', S <- S + K^T V'."""
    import numpy as np

    ceil = load_script("benchmarks/kernel_ceilings.py")
    nb, n, kb, rep, L, d = 2, 3, 1, 2, 64, 128
    rng = np.random.default_rng(2)
    qk = (nb, n, kb, L, d)
    q, k = (jnp.asarray(0.1 * rng.standard_normal(qk), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((nb, n, kb * rep, L, d)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(nb, n, L, kb * rep)), jnp.float32)
    got = np.asarray(ceil.gdn_chunk_matmuls(q, k, v, beta, rep=rep, interpret=True))
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    want = np.zeros(got.shape)
    for j in range(nb):
        s = np.zeros((kb * rep, d, d))
        for i in range(n):
            for h in range(kb * rep):
                qh, kh, vh = q64[j, i, h // rep], k64[j, i, h // rep], v64[j, i, h]
                bh = np.asarray(beta, np.float64)[j, i, :, h]
                t_inv = np.linalg.inv(np.eye(L) + np.tril(bh[:, None] * (kh @ kh.T), -1))
                v_new = t_inv @ vh - (t_inv @ kh) @ s[h]
                want[j, i, h] = qh @ s[h] + np.tril(qh @ kh.T) @ v_new
                s[h] = s[h] + kh.T @ v_new
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
