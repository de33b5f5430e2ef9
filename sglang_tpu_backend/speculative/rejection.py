"""Verification of speculative drafts for sampled and greedy requests (rejection sampling).

Dimension letters: R requests, k drafts per request, n = k + 1 verified positions, V vocab,
S penalty-state rows, W = ceil(V / 32) bitmask words.

A verify step gives each request n logits rows: row j is the target model's next-token
logits after the request's tokens and its drafts d_0 .. d_{j-1}. Row j's target distribution
p_j is what ``sampler.sample`` would draw that token from: penalties (frequency and presence
count the output tokens including d_0 .. d_{j-1}, repetition also the prompt), logit bias, the
grammar bitmask of position j, temperature, top-k/top-p/min-p.

The rule (speculative sampling, Leviathan et al. and Chen et al., 2023), from j = 0: accept
d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a token drawn from
the residual norm(max(0, p_j - q_j)) and stop; when all k drafts are accepted emit a bonus token
drawn from p_k. Each emitted token is then distributed exactly as under plain sampling, given
the tokens before it, whatever the drafts are, as long as d_j is drawn from q_j. q_j is the
drafter's distribution (``draft_probs``, MTP) or, for deterministic drafts (n-gram),
the one-hot of d_j: d_j is accepted with probability p_j(d_j) and the residual is p_j without d_j.
Greedy rows (temperature 0) accept d_j while it equals the argmax of row j (after penalties,
bias and mask, as the greedy sampler) and emit the argmax of the first row not accepted.

Randomness: position j of a request uses the key of (seed, output step ``inp.step + j``) that
the sampler would use, folded with ``KEY_SALT``, so speculation never reuses a plain draw; the
acceptance uniform and the residual draw come from two halves of that key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sglang_tpu_backend.sampling.sampler import (
    FULL, SamplerVariant, SamplingInputs, draw_logits, process_logits, row_keys)

KEY_SALT = 0x5EC1  # folded into every key drawn here; the plain sampler never folds it


def accept_drafts(p_draft, q_draft, u):
    """Whether each draft is accepted: u < p / q, written so that q = 0 accepts (ratio +inf).

    p_draft, q_draft f32[R, k] target and draft probability of each draft; u f32[R, k] in [0, 1).
    """
    return u * q_draft < p_draft


def residual_probs(p, q):
    """Unnormalised residual max(0, p - q) f32[R, n, V]; p where that has no mass (then the
    draft is accepted with probability 1, up to rounding)."""
    r = jnp.maximum(p - q, 0.0)
    return jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0.0, r, p)


def position_targets(logits, drafts, counts, prompt_mask, inp: SamplingInputs,
                     variant: SamplerVariant = FULL):
    """Each position's processed logits, logprobs and draw logits, as ``sampler.sample`` makes them.

    logits f32[R, n, V]; drafts i32[R, k]; counts i32[S, V], prompt_mask bool[S, V] the penalty
    state before this step (rows ``inp.slot``); ``inp.bitmask`` i32[R, n, W] when
    ``variant.mask``. Position j counts d_0 .. d_{j-1} as output tokens.

    Returns ``(x, logprobs, scaled)``, each f32[R, n, V]: x after penalties, bias and mask (the
    greedy argmax), logprobs at the row's temperature, scaled the filtered draw logits.
    """
    R, n, V = logits.shape
    c = counts[inp.slot]  # i32[R, V]
    if variant.penalties:
        seen = jnp.cumsum(jax.nn.one_hot(drafts, V, dtype=c.dtype), axis=1)  # i32[R, k, V]
        c = c[:, None] + jnp.concatenate([jnp.zeros((R, 1, V), c.dtype), seen], axis=1)
    else:
        c = jnp.broadcast_to(c[:, None], (R, n, V))
    bitmask = inp.bitmask if variant.mask else jnp.zeros((R, n, 0), jnp.int32)
    if variant.mask and (bitmask is None or bitmask.shape[:2] != (R, n)):
        raise ValueError(f"inp.bitmask must be i32[R, n, W] = [{R}, {n}, W] for a verify step, "
                         f"got {None if bitmask is None else bitmask.shape}")
    pm = prompt_mask[inp.slot]

    def one_position(x_j, c_j, m_j):
        x_j = process_logits(x_j, c_j, pm, m_j, inp, variant)
        return (x_j, *draw_logits(x_j, inp, variant))

    return jax.vmap(one_position, in_axes=1, out_axes=1)(logits, c, bitmask)


def _position_keys(inp: SamplingInputs, n: int):
    """(uniform keys, draw keys), each u32[R, n, 2]: position j's key of output step step + j."""
    R = inp.step.shape[0]
    steps = inp.step[:, None] + jnp.arange(n, dtype=inp.step.dtype)[None, :]
    keys = row_keys(jnp.repeat(inp.seed_lo, n), jnp.repeat(inp.seed_hi, n), steps.reshape(-1))
    halves = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, KEY_SALT)))(keys)
    return halves[:, 0].reshape(R, n, -1), halves[:, 1].reshape(R, n, -1)


def _sampled_rule(scaled, drafts, draft_probs, has_draft, inp: SamplingInputs):
    """Rejection sampling for drawn rows: (accepted bool[R, k], fallback i32[R, n]), fallback j
    being the token emitted when position j is the first not accepted."""
    R, n, V = scaled.shape
    p = jax.nn.softmax(scaled, axis=-1)  # f32[R, n, V]
    q = jax.nn.one_hot(drafts, V, dtype=p.dtype) if draft_probs is None else draft_probs
    q = jnp.where(has_draft[..., None], q, 0.0)  # f32[R, k, V]
    q = jnp.concatenate([q, jnp.zeros((R, 1, V), q.dtype)], axis=1)  # f32[R, n, V]: none at k
    u_keys, draw_keys = _position_keys(inp, n)
    u = jax.vmap(jax.random.uniform)(u_keys.reshape(R * n, -1)).reshape(R, n)[:, : n - 1]
    d = jnp.clip(drafts, 0, V - 1)[..., None]
    accepted = accept_drafts(jnp.take_along_axis(p[:, : n - 1], d, axis=-1)[..., 0],
                             jnp.take_along_axis(q[:, : n - 1], d, axis=-1)[..., 0], u)
    resid = jnp.log(residual_probs(p, q)).reshape(R * n, V)
    fallback = jax.vmap(jax.random.categorical)(draw_keys.reshape(R * n, -1), resid)
    return accepted, fallback.reshape(R, n).astype(jnp.int32)


def verify_sampled(logits, drafts, draft_probs, counts, prompt_mask, inp: SamplingInputs, *,
                   num_drafts=None, num_top_logprobs: int = 0, variant: SamplerVariant = FULL):
    """Accept a prefix of each request's drafts and choose its next token.

    Args:
      logits:      f32[R, n, V] target logits; row j follows drafts d_0 .. d_{j-1}.
      drafts:      i32[R, k], k = n - 1 (entries past ``num_drafts`` are ignored).
      draft_probs: f32[R, k, V] the distribution each draft was drawn from, or None for
                   deterministic drafts (one-hot).
      counts:      i32[S, V] output-token counts per penalty slot (updated and returned).
      prompt_mask: bool[S, V] prompt tokens per penalty slot.
      inp:         SamplingInputs with R rows; ``step`` is the output index of the token row 0
                   predicts; ``bitmask`` is i32[R, n, W] (one mask per position) when
                   ``variant.mask``; ``sample_rows`` and ``target_ids`` are not read.
      num_drafts:  i32[R] drafts each request has (0..k), or None for k everywhere.
      num_top_logprobs: static K; > 0 also returns each position's top-K logprobs.
      variant:     static SamplerVariant covering the rows' needs (as for ``sampler.sample``).

    Returns:
      dict with ``num_accepted`` i32[R] in 0..k, ``next_token`` i32[R], ``tokens`` i32[R, n]
      the emitted tokens (the accepted drafts, then the next token; 0 past it), ``logprobs``
      f32[R, n] of the emitted tokens (as ``sample`` reports them; 0 past them) and the updated
      ``counts``; with K > 0 ``top_logprobs`` f32[R, n, K] and ``top_ids`` i32[R, n, K] (of
      the logprobs ``sample`` reports its top ones from). Padding rows (``valid`` False) accept 0 drafts, emit token 0, count nothing.
    """
    R, n, V = logits.shape
    k = n - 1
    if drafts.shape != (R, k):
        raise ValueError(f"drafts must be i32[R, n - 1] = [{R}, {k}], got shape {drafts.shape}")
    x, logprobs, scaled = position_targets(logits, drafts, counts, prompt_mask, inp, variant)
    pos = jnp.arange(n, dtype=jnp.int32)[None, :]
    has_draft = pos[:, :k] < (k if num_drafts is None else num_drafts[:, None])  # bool[R, k]
    argmax = jnp.argmax(x, axis=-1).astype(jnp.int32)  # i32[R, n]
    accepted, fallback = drafts == argmax[:, :k], argmax
    if variant.draw:
        greedy = (inp.temperature <= 0.0)[:, None]
        drawn_ok, drawn = _sampled_rule(scaled, drafts, draft_probs, has_draft, inp)
        accepted = jnp.where(greedy, accepted, drawn_ok)
        fallback = jnp.where(greedy, fallback, drawn)
    run = jnp.cumprod((accepted & has_draft).astype(jnp.int32), axis=1)  # leading accepts
    num_accepted = jnp.where(inp.valid, jnp.sum(run, axis=1), 0).astype(jnp.int32)
    next_token = jnp.take_along_axis(fallback, num_accepted[:, None], axis=1)[:, 0]
    next_token = jnp.where(inp.valid, next_token, 0)
    emitted = (pos <= num_accepted[:, None]) & inp.valid[:, None]  # bool[R, n]
    padded = jnp.concatenate([drafts, jnp.zeros((R, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(pos < num_accepted[:, None], padded, next_token[:, None])
    tokens = jnp.where(emitted, tokens, 0).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    counts = counts.at[inp.slot[:, None], tokens].add(emitted.astype(counts.dtype))
    out = {"num_accepted": num_accepted, "next_token": next_token, "tokens": tokens,
           "logprobs": jnp.where(emitted, chosen, 0.0), "counts": counts}
    if num_top_logprobs > 0:
        vals, ids = jax.lax.top_k(logprobs, num_top_logprobs)
        out["top_logprobs"], out["top_ids"] = vals, ids.astype(jnp.int32)
    return out


def sample_verify_step(logits, counts, prompt_mask, last_tokens, drafts, num_drafts,
                       inp: SamplingInputs, *, num_top_logprobs: int = 0,
                       variant: SamplerVariant = FULL):
    """The sampler of a TARGET_VERIFY step: ``verify_sampled`` on the forward's logits rows.

    logits f32[L, V] with request r's n rows at r*n .. r*n+k (L >= R*n); last_tokens i32[S]
    (each slot's last sampled token); drafts i32[R, k]; num_drafts i32[R] the drafts request r
    may accept (0 accepts none); other arguments as ``verify_sampled``.

    Returns ``(out, counts, last_tokens)``: ``verify_sampled``'s outputs plus ``accepted_len``
    i32[R] (1 + num_accepted, 0 for padding rows: what ``verify.commit_accepted`` keeps), the
    updated counts and last tokens (each request's ``next_token``, its last emitted one).
    """
    R, k = drafts.shape
    rows = logits[: R * (k + 1)].reshape(R, k + 1, -1)
    out = verify_sampled(rows, drafts, None, counts, prompt_mask, inp, num_drafts=num_drafts,
                         num_top_logprobs=num_top_logprobs, variant=variant)
    counts = out.pop("counts")
    out["accepted_len"] = jnp.where(inp.valid, 1 + out["num_accepted"], 0).astype(jnp.int32)
    where = jnp.where(inp.valid, inp.slot, last_tokens.shape[0])
    last_tokens = last_tokens.at[where].set(out["next_token"], mode="drop")
    return out, counts, last_tokens


verify_sampled_jit = jax.jit(verify_sampled, static_argnames=("num_top_logprobs", "variant"),
                             donate_argnames=("counts",))
sample_verify_step_jit = jax.jit(sample_verify_step,
                                 static_argnames=("num_top_logprobs", "variant"),
                                 donate_argnames=("counts", "last_tokens"))
