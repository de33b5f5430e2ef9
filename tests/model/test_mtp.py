"""The MTP layer (``models/mtp.py``) against a step-by-step numpy reference (float64).

A random 4-layer checkpoint with one MTP layer, loaded in float32. Two requests of different
lengths (plus a padding request and padding rows) run one MTP prefill step over their rows,
then one decode step each; every row's logits and MTP hidden state must equal the reference,
which recomputes each request's whole row sequence at once: zero-centred norms of the next
token's embedding and of the given hidden state, concat [embedding | hidden] -> fc, gated GQA
attention with partial RoPE over the rows' own keys (causal), routed top-k experts + gated
shared expert, final norm, the shared LM head. Then greedy chain drafts equal the reference's
argmax chain, each step feeding its token and hidden state back.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from sglang_tpu_backend.config import model_config_from_dict
from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_loader.checkpoint_io import write_checkpoint
from sglang_tpu_backend.model_loader.loader import load_model, load_mtp_params
from sglang_tpu_backend.model_loader.tiny_model import random_checkpoint_tensors
from sglang_tpu_backend.models.mtp import draft_chain_jit, init_mtp_cache, mtp_forward_jit

CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 256, "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "mtp_num_hidden_layers": 1,
}
PAGE, PAGES_PER_SEQ = 4, 4
LENS = (5, 3)  # prefill rows of the two requests
T, R = 16, 3  # token and request buckets (padding rows and one padding request)
TOL = dict(rtol=2e-4, atol=2e-5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = model_config_from_dict(CONFIG)
    tensors = random_checkpoint_tensors(cfg, seed=5, prefix="model.", dtype=np.float32)
    path = write_checkpoint(tmp_path_factory.mktemp("mtp"), tensors, CONFIG)
    cfg, params = load_model(path, dtype=jnp.float32)
    return cfg, params, load_mtp_params(path, cfg, dtype=jnp.float32)


# Reference (numpy float64) -----------------------------------------------------------------
def np64(x):
    return np.asarray(x, np.float64)


def rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + np64(w))


def rope(x, pos, rd, theta):
    """Rotate-half RoPE on the first rd channels of x [T, heads, D] at positions pos [T]."""
    freqs = pos[:, None] / theta ** (np.arange(0, rd, 2) / rd)  # [T, rd/2]
    cos, sin = np.cos(freqs)[:, None], np.sin(freqs)[:, None]
    x1, x2, rest = x[..., : rd // 2], x[..., rd // 2 : rd], x[..., rd:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(x, gate_up, down):
    g, u = np.split(x @ np64(gate_up), 2, axis=-1)
    return (silu(g) * u) @ np64(down)


def ref_attention(p, x, cfg):
    """Causal gated GQA over one request's rows x [n, H] at positions 0..n-1."""
    n, N, G, D = len(x), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = (x @ np64(p["q_proj"])).reshape(n, N, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = (x @ np64(p["k_proj"])).reshape(n, G, D)
    v = (x @ np64(p["v_proj"])).reshape(n, G, D)
    pos = np.arange(n, dtype=np.float64)
    q = rope(rms(q, p["q_norm"]), pos, cfg.rotary_dim, cfg.rope_theta)
    k = rope(rms(k, p["k_norm"]), pos, cfg.rotary_dim, cfg.rope_theta)
    kv_head = np.arange(N) // (N // G)
    s = np.einsum("tnd,snd->nts", q, k[:, kv_head]) / np.sqrt(D)  # [N, n, n]
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("nts,snd->tnd", w, v[:, kv_head]).reshape(n, N * D)
    return (o / (1.0 + np.exp(-gate.reshape(n, N * D)))) @ np64(p["o_proj"])


def ref_moe(p, x, cfg):
    logits = x @ np64(p["gate"])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        top = np.argsort(-probs[t])[: cfg.num_experts_per_tok]
        w = probs[t, top] / probs[t, top].sum()
        for e, we in zip(top, w):
            ex = p["experts"]  # [E, out, in]: the checkpoint's layout
            out[t] += we * swiglu(x[t], np64(ex["gate_up"][e]).T, np64(ex["down"][e]).T)
    shared = swiglu(x, p["shared_expert"]["gate_up"], p["shared_expert"]["down"])
    return out + shared / (1.0 + np.exp(-(x @ np64(p["shared_expert_gate"]))))


def ref_mtp(params, mtp, next_ids, hidden, cfg):
    """One request's rows: next tokens i32[n], hidden [n, H] -> (logits [n, V], out [n, H])."""
    emb = rms(np64(params["embed_tokens"])[next_ids], mtp["pre_fc_norm_embedding"])
    h = rms(np64(hidden), mtp["pre_fc_norm_hidden"])
    x = np.concatenate([emb, h], axis=-1) @ np64(mtp["fc"])
    layer = mtp["layers"][0]
    x = x + ref_attention(layer["self_attn"], rms(x, layer["input_layernorm"]), cfg)
    x = x + ref_moe(layer["mlp"], rms(x, layer["post_attention_layernorm"]), cfg)
    out = rms(x, mtp["norm"])
    return out @ np64(params["lm_head"]).T, out


# Tests ----------------------------------------------------------------------------------------
def request_pages(r):
    return list(range(PAGES_PER_SEQ * r, PAGES_PER_SEQ * (r + 1)))


def run(model, cache, chunks, hidden_rows, mode=None):
    """One MTP step; hidden_rows: per chunk [q, H]. Returns (logits, out, cache, rows)."""
    cfg, params, mtp = model
    batch, rows = build_forward_batch(chunks, page_size=PAGE, num_tokens=T, num_seqs=R,
                                      pages_per_seq=PAGES_PER_SEQ, num_logits=T, mode=mode)
    hidden = np.full((T, cfg.hidden_size), 3.0, np.float32)  # padding rows: arbitrary values
    hidden[: sum(len(h) for h in hidden_rows)] = np.concatenate(hidden_rows)
    logits, out, cache = mtp_forward_jit(params, mtp, cache, batch, jnp.asarray(hidden), cfg,
                                         impl="xla")
    return np.asarray(logits), np.asarray(out), cache, rows


def test_mtp_forward_matches_reference_over_prefill_then_decode(model):
    cfg, params, mtp = model
    rng = np.random.default_rng(0)
    n = [m + 1 for m in LENS]  # every request: its prefill rows and one decode row
    next_ids = [rng.integers(1, cfg.vocab_size, m) for m in n]
    hidden = [rng.standard_normal((m, cfg.hidden_size)).astype(np.float32) for m in n]
    want = [ref_mtp(params, mtp, i, h, cfg) for i, h in zip(next_ids, hidden)]

    cache = init_mtp_cache(cfg, num_pages=PAGES_PER_SEQ * R, page_size=PAGE, kv_dtype=jnp.float32)
    prefill = [SeqChunk(ids[:-1].tolist(), 0, request_pages(r), r, "all")
               for r, ids in enumerate(next_ids)]
    logits, out, cache, rows = run(model, cache, prefill, [h[:-1] for h in hidden])
    start = 0
    for r, m in enumerate(LENS):
        np.testing.assert_allclose(logits[rows[r]], want[r][0][:m], **TOL)
        np.testing.assert_allclose(out[start : start + m], want[r][1][:m], **TOL)
        start += m

    decode = [SeqChunk([int(ids[-1])], m, request_pages(r), r)
              for r, (ids, m) in enumerate(zip(next_ids, LENS))]
    logits, out, cache, rows = run(model, cache, decode, [h[-1:] for h in hidden])
    for r in range(len(LENS)):  # attends to the prefill rows' keys in the MTP's own pages
        np.testing.assert_allclose(logits[rows[r]], want[r][0][-1:], **TOL)
        np.testing.assert_allclose(out[r], want[r][1][-1], **TOL)
    assert np.abs(want[0][0][-1]).max() > 0.1  # the logits are not vanishingly small


def test_draft_chain_feeds_its_tokens_and_hidden_states_back(model):
    cfg, params, mtp = model
    rng = np.random.default_rng(1)
    m, k = LENS[0], 3
    next_ids = rng.integers(1, cfg.vocab_size, m + 1)
    hidden = rng.standard_normal((m + 1, cfg.hidden_size)).astype(np.float32)
    cache = init_mtp_cache(cfg, num_pages=PAGES_PER_SEQ * R, page_size=PAGE, kv_dtype=jnp.float32)
    _, _, cache, _ = run(model, cache, [SeqChunk(next_ids[:m].tolist(), 0, request_pages(0), 0)],
                         [hidden[:m]])
    batch, _ = build_forward_batch([SeqChunk([int(next_ids[m])], m, request_pages(0), 0)],
                                   page_size=PAGE, num_tokens=R, num_seqs=R,
                                   pages_per_seq=PAGES_PER_SEQ, num_logits=R)
    table = batch.page_table.copy()
    table[0] = request_pages(0)  # the drafts' positions run onto the request's next page
    batch = dataclasses.replace(batch, page_table=table)
    h0 = np.zeros((R, cfg.hidden_size), np.float32)
    h0[0] = hidden[m]
    drafts, _ = draft_chain_jit(params, mtp, cache, batch, jnp.asarray(h0), cfg, num_steps=k,
                                impl="xla")

    ids, rows = list(next_ids), hidden.astype(np.float64)
    for _ in range(k):  # the reference: append each draft's row and recompute the sequence
        logits, out = ref_mtp(params, mtp, np.asarray(ids), rows, cfg)
        ids.append(int(np.argmax(logits[-1])))
        rows = np.concatenate([rows, out[-1:]])
    assert np.asarray(drafts)[0].tolist() == ids[m + 1 :]
    assert len(set(ids[m + 1 :])) > 1 or k == 1  # the chain is not stuck on one token
