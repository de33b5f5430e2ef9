"""Greedy acceptance of a verify step, on the device (one program per (R, n, K) bucket).

Request r of the step owns logits rows ``r*n .. r*n+k`` (n = k+1): row i predicts the token
after position i of ``[last, d_1 .. d_k]``. With greedy decoding the target would have
produced ``argmax(row 0)``, then (if that was ``d_1``) ``argmax(row 1)``, and so on, so the
drafts kept are the longest prefix with ``d_{i+1} == argmax(row i)`` (a_r of them) and the
next token is ``argmax(row a_r)``: the request appends ``argmax(rows 0..a_r)``, exactly the
tokens one-by-one greedy decoding gives. Logprobs are ``log_softmax`` of each row, as the
sampler reports them for a greedy row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_verify(logits, drafts, accept, real, *, num_top_logprobs: int = 0) -> dict:
    """Accept drafts greedily.

    Args:
      logits: f32[R*n, V] the verify step's logits, request r's rows at r*n .. r*n+n-1.
      drafts: i32[R, k] each request's drafts (k = n-1).
      accept: bool[R] whether a request may accept drafts (greedy rows without penalties,
              bias or a grammar); one that may not keeps only its last position.
      real:   bool[R] real requests (padding rows commit nothing).
      num_top_logprobs: static K; > 0 also returns each row's top-K logprobs.

    Returns a dict: ``tokens`` i32[R, n] argmax of every row, ``logprobs`` f32[R, n] their
    logprobs, ``num_accepted`` i32[R] a_r (0 where ``accept`` is off), ``accepted_len`` i32[R]
    positions to commit (1 + a_r, 0 for padding: ``verify.commit_accepted``), ``first_rows``
    f32[R, V] row 0 of each request (what the sampler draws from when drafts are not
    accepted); with K > 0 ``top_logprobs`` f32[R, n, K] and ``top_ids`` i32[R, n, K].
    """
    R, k = drafts.shape
    n = k + 1
    rows = logits[: R * n].reshape(R, n, -1)
    tokens = jnp.argmax(rows, axis=-1).astype(jnp.int32)  # [R, n]
    agree = (drafts == tokens[:, :k]) & accept[:, None]
    num_accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
    logprobs = jax.nn.log_softmax(rows, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    out = {"tokens": tokens, "logprobs": chosen, "num_accepted": num_accepted.astype(jnp.int32),
           "accepted_len": jnp.where(real, 1 + num_accepted, 0).astype(jnp.int32),
           "first_rows": rows[:, 0]}
    if num_top_logprobs > 0:
        vals, ids = jax.lax.top_k(logprobs, num_top_logprobs)
        out["top_logprobs"], out["top_ids"] = vals, ids.astype(jnp.int32)
    return out


greedy_verify_jit = jax.jit(greedy_verify, static_argnames=("num_top_logprobs",))
