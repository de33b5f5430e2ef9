"""The jitted sampler: penalties, grammar mask, temperature, top-k/top-p/min-p, seeded draws,
logprobs of the chosen token and top alternatives, and prompt-row logprobs.

Dimension letters: L logits rows from the forward, R requests (sampling rows), V vocab,
S penalty-state rows (one per GDN state slot), W = ceil(V / 32) bitmask words,
K top logprobs returned, B = ``MAX_LOGIT_BIAS`` logit-bias entries per row.

Penalty state lives on the device between steps: ``counts i32[S, V]`` counts each slot's
output tokens, ``prompt_mask bool[S, V]`` marks its prompt tokens. ``reset_penalty_rows``
fills a slot's rows when a request (re)starts; ``sample`` adds each sampled token.
SGLang semantics: frequency/presence penalties see output tokens only; repetition
penalty sees prompt and output tokens (positive logits divided, negative multiplied).

A ``SamplerVariant`` (static) leaves out the stages no row of the step needs: the draw (an
all-greedy step takes an argmax), the top-k/top-p/min-p filter (its full-vocabulary sort),
the penalties, the logit bias and the grammar bitmask (then not even built on the host). A stage left out is
an identity for every row of that step, so each variant's outputs equal the full sampler's
bit for bit. ``variant_for`` collapses a step's needs into three levels (GREEDY, PLAIN, FULL),
the compilations warm-up makes. A multi-step program (``model_executor/multistep.py``) holds
the three as branches of one program instead (``MULTISTEP_BRANCHES``, picked at run time by
``multistep_branch``), FULL without its mask stage: no multi-step row has a grammar or a
``min_new_tokens`` ban.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf
# Logit-bias entries one request may give (OpenAI's limit); rows are padded to this many
# entries (token id V, dropped), so the FULL variant has one shape whatever the requests ask.
MAX_LOGIT_BIAS = 300


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """Per-request sampling values of one step (row r = request r; padding rows past the real ones).

    sample_rows:  i32[R] row of ``logits`` holding request r's next-token logits.
    valid:        bool[R] row is a real request that samples this step.
    temperature:  f32[R] 0 = greedy.
    top_p, min_p: f32[R] (1.0 / 0.0 = off).
    top_k:        i32[R] (0 = off).
    frequency_penalty, presence_penalty, repetition_penalty: f32[R] (0, 0, 1 = off).
    seed_lo, seed_hi: u32[R] halves of the per-request seed.
    step:         i32[R] index of the output token being sampled (key = f(seed, step)).
    slot:         i32[R] penalty-state row.
    bitmask:      i32[R, W] allowed tokens, bit ``t % 32`` of word ``t // 32`` (-1 = all);
                  None when the step's variant has ``mask=False``.
    bias_ids:     i32[R, B] tokens whose logits ``bias_values`` f32[R, B] are added to (padding
                  entries: id V, dropped); None: no row has one (always so when the
                  variant has ``bias=False``).
    target_ids:   i32[L] token whose logprob each logits row reports (prompt logprobs).
    """

    sample_rows: jax.Array
    valid: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    repetition_penalty: jax.Array
    seed_lo: jax.Array
    seed_hi: jax.Array
    step: jax.Array
    slot: jax.Array
    bitmask: jax.Array | None
    target_ids: jax.Array
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SamplerVariant:
    """Which optional stages one jitted sample runs (a static argument: one compilation each).

    draw:      some row samples at temperature > 0 (without it every token is the argmax).
    filter:    some drawn row uses top_k, top_p < 1 or min_p > 0 (sorts the vocabulary).
    penalties: some row has a frequency, presence or repetition penalty.
    mask:      some row has a grammar or a min_new_tokens ban (``bitmask`` is i32[R, W]).
    bias:      some row has a logit bias (``bias_ids`` / ``bias_values`` are [R, B]).
    """

    draw: bool = True
    filter: bool = True
    penalties: bool = True
    mask: bool = True
    bias: bool = True


FULL = SamplerVariant()
PLAIN = SamplerVariant(draw=True, filter=False, penalties=False, mask=False, bias=False)
GREEDY = SamplerVariant(draw=False, filter=False, penalties=False, mask=False, bias=False)
VARIANTS = (GREEDY, PLAIN, FULL)  # what serving uses (``variant_for``): warm-up compiles each
FULL_NO_MASK = SamplerVariant(mask=False)
# The branches of a multi-step program's sampler (a runtime index, ``multistep_branch``), and
# the variant whose input layout (``sampler_state.dummy_sampling_inputs``) carries every field
# they read: penalties, filter parameters and logit-bias entries, no bitmask.
MULTISTEP_BRANCHES = (GREEDY, PLAIN, FULL_NO_MASK)
MULTISTEP_INPUTS = FULL_NO_MASK


def variant_for(needs: SamplerVariant) -> SamplerVariant:
    """The served variant covering a step's ``needs`` (each flag: some row needs the stage):
    FULL if it needs a filter, penalties, a mask or a logit bias, else PLAIN if it draws,
    else GREEDY."""
    if needs.filter or needs.penalties or needs.mask or needs.bias:
        return FULL
    return PLAIN if needs.draw else GREEDY


def multistep_branch(variant: SamplerVariant) -> int:
    """The index in ``MULTISTEP_BRANCHES`` of a served variant (``variant_for``) of a step none
    of whose rows needs the mask: FULL's is FULL_NO_MASK's, which then gives FULL's outputs."""
    return MULTISTEP_BRANCHES.index(FULL_NO_MASK if variant == FULL else variant)


def apply_penalties(logits, counts, prompt_mask, freq, pres, rep):
    """logits f32[R, V], counts i32[R, V], prompt_mask bool[R, V], penalties f32[R] -> f32[R, V]."""
    c = counts.astype(jnp.float32)
    logits = logits - freq[:, None] * c - pres[:, None] * (c > 0)
    seen = (counts > 0) | prompt_mask
    r = rep[:, None]
    penalised = jnp.where(logits > 0, logits / r, logits * r)
    return jnp.where(seen, penalised, logits)


def apply_logit_bias(logits, bias_ids, bias_values):
    """logits f32[R, V] + bias_values f32[R, B] at bias_ids i32[R, B] (ids >= V dropped)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, bias_ids].add(bias_values, mode="drop")


def apply_bitmask(logits, bitmask):
    """logits f32[R, V], bitmask i32[R, W] -> f32[R, V] with disallowed tokens at -inf."""
    V = logits.shape[-1]
    ids = jnp.arange(V, dtype=jnp.int32)
    words = bitmask[:, ids // 32]  # i32[R, V]
    allowed = ((words >> (ids % 32)) & 1).astype(jnp.bool_)
    return jnp.where(allowed, logits, NEG_INF)


def top_k_top_p_min_p_mask(probs, top_k, top_p, min_p):
    """Which tokens survive, judged on the unfiltered probs (SGLang's order-free rule).

    probs f32[R, V]; top_k i32[R] (0 = off); top_p, min_p f32[R]. Returns bool[R, V].
    Keeps rank < k, tokens whose preceding cumulative mass is <= top_p (top_p >= 1 keeps
    all, whatever the rounding of the cumulative sum), and probs >= min_p times the largest;
    the most likely token always survives. Ranks are those of a stable descending sort (equal
    probs ranked by token id).

    Each rule is monotone in the rank (the cumulative sum of sorted probs never decreases), so
    the survivors are the first ``n_keep`` ranks: counted on a values-only sort, then mapped
    back to tokens by their threshold value. (An argsort and a scatter back took XLA:TPU
    several times longer to compile; an unstable values-only sort half a stable one's time.)
    """
    sorted_p = -jnp.sort(-probs, axis=-1, stable=False)  # f32[R, V] descending (values only)
    keep = keep_by_rank(sorted_p, top_k, top_p, min_p)
    return keep_first_ranks(probs, sorted_p, jnp.sum(keep, axis=-1, dtype=jnp.int32))


def keep_by_rank(sorted_p, top_k, top_p, min_p):
    """The filter's rules judged per rank: bool[R, V] of which ranks of the descending probs
    sorted_p f32[R, V] survive (top_k i32[R], top_p and min_p f32[R]; see
    ``top_k_top_p_min_p_mask``)."""
    rank = jnp.arange(sorted_p.shape[-1], dtype=jnp.int32)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    cum_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep &= (cum_before <= top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    return keep | (rank == 0)


def keep_first_ranks(probs, sorted_p, n_keep):
    """bool[R, V]: the tokens of ranks < n_keep i32[R] (1 <= n_keep <= V) in the stable
    descending order of probs f32[R, V], whose values sorted_p f32[R, V] are.

    With t the value at rank n_keep - 1: every token above t, and of the tokens equal to t the
    first (n_keep - count above t) in token order (the stable order ranks ties by token id).
    """
    kept = jnp.arange(probs.shape[-1], dtype=jnp.int32)[None, :] < n_keep[:, None]
    t = jnp.min(jnp.where(kept, sorted_p, jnp.inf), axis=-1, keepdims=True)  # f32[R, 1]
    above = probs > t
    n_ties = n_keep - jnp.sum(above, axis=-1, dtype=jnp.int32)  # i32[R] >= 1
    tie = probs == t
    tie_rank = jnp.cumsum(tie.astype(jnp.int32), axis=-1)  # 1-based among ties, token order
    return above | (tie & (tie_rank <= n_ties[:, None]))


def process_logits(x, counts, prompt_mask, bitmask, inp: SamplingInputs, variant: SamplerVariant):
    """The stages before temperature: penalties, logit bias, grammar bitmask.

    x f32[R, V] the rows' logits; counts i32[R, V] and prompt_mask bool[R, V] the rows' penalty
    state (read when ``variant.penalties``); bitmask i32[R, W] (read when ``variant.mask``);
    ``inp``'s per-row fields (R rows). Returns f32[R, V]; a greedy row's token is its argmax.
    """
    if variant.penalties:
        x = apply_penalties(x, counts, prompt_mask, inp.frequency_penalty, inp.presence_penalty,
                            inp.repetition_penalty)
    if variant.bias and inp.bias_ids is not None:
        x = apply_logit_bias(x, inp.bias_ids, inp.bias_values)
    if variant.mask:
        x = apply_bitmask(x, bitmask)
    return x


def draw_logits(x, inp: SamplingInputs, variant: SamplerVariant):
    """Temperature and the top-k/top-p/min-p filter of processed rows x f32[R, V].

    Returns ``(logprobs, scaled)``, both f32[R, V]: ``logprobs`` the log-softmax at the row's
    temperature (1 for greedy rows), what the logprob outputs report; ``scaled`` the logits a
    draw samples from, tokens the filter drops (when ``variant.draw and variant.filter``) at -inf.
    """
    temp = jnp.where(inp.temperature <= 0.0, 1.0, inp.temperature)
    scaled = x / temp[:, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    if variant.draw and variant.filter:
        keep = top_k_top_p_min_p_mask(jnp.exp(logprobs), inp.top_k, inp.top_p, inp.min_p)
        scaled = jnp.where(keep, scaled, NEG_INF)
    return logprobs, scaled


def row_keys(seed_lo, seed_hi, step):
    """Each row's PRNG key u32[R, 2] of (seed, output step): seed_lo, seed_hi u32[R], step i32[R]."""

    def one(lo, hi, t):
        k = jax.random.fold_in(jax.random.PRNGKey(lo), hi)
        return jax.random.fold_in(k, t)

    return jax.vmap(one)(seed_lo, seed_hi, step)


# XLA:TPU runs a top-k over fewer than ~1.5K columns as a full sort, which takes seconds to
# compile; from there on it is its TopK kernel (0.2 s). Narrower rows are padded to this width.
TOP_K_MIN_WIDTH = 2048


def _top(logprobs, k):
    """The k largest of each row of logprobs f32[N, V] and their ids, descending (equal values:
    lower id first): (f32[N, k], i32[N, k]). Rows narrower than ``TOP_K_MIN_WIDTH`` are padded
    with -inf past V; padding ranks after every real token (same value, higher id), and k <= V."""
    V = logprobs.shape[-1]
    if V < TOP_K_MIN_WIDTH:
        logprobs = jnp.pad(logprobs, ((0, 0), (0, TOP_K_MIN_WIDTH - V)), constant_values=NEG_INF)
    vals, ids = jax.lax.top_k(logprobs, k)
    return vals, ids.astype(jnp.int32)


def sample(logits, counts, prompt_mask, inp: SamplingInputs, *, num_top_logprobs: int = 0,
           variant: SamplerVariant = FULL):
    """Sample one token per request row.

    Args:
      logits:      f32[L, V] forward output.
      counts:      i32[S, V] output-token counts per penalty slot (updated and returned).
      prompt_mask: bool[S, V] prompt tokens per penalty slot.
      inp:         SamplingInputs with R rows.
      num_top_logprobs: static K; 0 skips every logprob output but the chosen token's.
      variant:     static SamplerVariant; its stages left out must be identities for every
                   row (``variant_for`` of the rows' needs): the outputs are then FULL's.

    Returns:
      dict with ``tokens`` i32[R], ``logprobs`` f32[R] (of the chosen token, after penalties,
      logit bias, mask and temperature), and when K > 0 ``top_logprobs`` f32[R, K], ``top_ids`` i32[R, K],
      ``row_logprobs`` f32[L] (raw log-softmax at ``target_ids``), ``row_top_logprobs``
      f32[L, K], ``row_top_ids`` i32[L, K]; and the updated ``counts``.
    """
    x = process_logits(logits[inp.sample_rows], counts[inp.slot], prompt_mask[inp.slot],
                       inp.bitmask, inp, variant)  # f32[R, V]
    logprobs, scaled = draw_logits(x, inp, variant)
    tokens = jnp.argmax(x, axis=-1).astype(jnp.int32)  # i32[R] greedy
    if variant.draw:
        keys = row_keys(inp.seed_lo, inp.seed_hi, inp.step)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        tokens = jnp.where(inp.temperature <= 0.0, tokens, drawn)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    out = {"tokens": tokens, "logprobs": chosen, "counts": count_tokens(counts, inp, tokens)}
    if num_top_logprobs > 0:
        out["top_logprobs"], out["top_ids"] = _top(logprobs, num_top_logprobs)
        raw = jax.nn.log_softmax(logits, axis=-1)  # f32[L, V]
        out["row_logprobs"] = jnp.take_along_axis(raw, inp.target_ids[:, None], axis=-1)[:, 0]
        out["row_top_logprobs"], out["row_top_ids"] = _top(raw, num_top_logprobs)
    return out


def count_tokens(counts, inp: SamplingInputs, tokens):
    """counts i32[S, V] + 1 at (``inp.slot[r]``, ``tokens[r]``) of each valid row r."""
    return counts.at[inp.slot, tokens].add(inp.valid.astype(counts.dtype))


def reset_penalty_rows(counts, prompt_mask, slot, prompt_ids, output_ids):
    """Refill one slot's penalty rows for a request (re)starting.

    counts i32[S, V], prompt_mask bool[S, V], slot i32[], prompt_ids i32[A], output_ids i32[B];
    ids >= V (padding) are dropped.
    """
    V = counts.shape[1]
    c = jnp.zeros((V,), counts.dtype).at[output_ids].add(1, mode="drop")
    m = jnp.zeros((V,), jnp.bool_).at[prompt_ids].set(True, mode="drop")
    return counts.at[slot].set(c), prompt_mask.at[slot].set(m)


sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs", "variant"), donate_argnames=("counts",))
reset_penalty_rows_jit = jax.jit(reset_penalty_rows, donate_argnames=("counts", "prompt_mask"))


def set_penalty_row(counts, prompt_mask, slot, count_row, mask_row):
    """counts[slot] := count_row i32[V], prompt_mask[slot] := mask_row bool[V] (rows built on
    the host: one program whatever the prompt's length)."""
    return counts.at[slot].set(count_row), prompt_mask.at[slot].set(mask_row)


set_penalty_row_jit = jax.jit(set_penalty_row, donate_argnames=("counts", "prompt_mask"))
