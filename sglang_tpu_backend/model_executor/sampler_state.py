"""The sampler's device state and its host-built inputs.

State, one row per global state slot (S = dp_size * num_state_slots; DP rank r's slot s is
row ``r * num_state_slots + s``):
  counts       i32[S, V]   how often each token was sampled (frequency / presence penalty)
  prompt_mask  bool[S, V]  the tokens of the prompt (repetition penalty)
  last_tokens  i32[S]      the token each slot's request sampled last (overlap scheduling: a
                           decode launched before that token reaches the host reads its input
                           here: ``unpack_batch_jit`` resolves its input id as the step's batch is unpacked)
The sampler compiles per R, per static top-logprob count (0 or max_top_logprobs_num) and per
``sampling.sampler.VARIANTS`` entry (greedy / plain draws / full: filters, penalties or a
grammar bitmask); ``sampler_variant`` picks a step's variant from what its rows ask for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.managers.schedule_batch import ScheduledChunk
from sglang_tpu_backend.model_executor import host_inputs
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch
from sglang_tpu_backend.sampling import sampler
from sglang_tpu_backend.speculative.rejection import sample_verify_step_jit


def uses_penalties(sp: Any) -> bool:
    """Whether sampling params ``sp`` apply a frequency, presence or repetition penalty."""
    return sp.frequency_penalty != 0 or sp.presence_penalty != 0 or sp.repetition_penalty != 1


def _resolve_input_ids(input_ids, from_slot, last_tokens):
    """i32[T]: ``last_tokens[from_slot[t]]`` where ``from_slot[t] >= 0`` (a decode whose input
    is the token its request's previous step sampled), else ``input_ids[t]``."""
    picked = last_tokens[jnp.clip(from_slot, 0, last_tokens.shape[0] - 1)]
    return jnp.where(from_slot >= 0, picked, input_ids)


def _record_tokens(last_tokens, slot, tokens, valid):
    """last_tokens[slot[r]] := tokens[r] for the rows that sampled (i32[S], i32[R] x2, bool[R])."""
    where = jnp.where(valid, slot, last_tokens.shape[0])
    return last_tokens.at[where].set(tokens.astype(last_tokens.dtype), mode="drop")


_record_tokens_jit = jax.jit(_record_tokens, donate_argnums=(0,))


def _unpack_batch(buf, last_tokens, layout: host_inputs.PackLayout) -> ForwardBatch:
    """The (ForwardBatch, from_slot) packed in ``buf`` (``host_inputs``), its input ids
    resolved from ``last_tokens`` (``_resolve_input_ids``): one program."""
    fb, from_slot = host_inputs.unpack_tree(buf, layout)
    return dataclasses.replace(fb, input_ids=_resolve_input_ids(fb.input_ids, from_slot,
                                                                last_tokens))


unpack_batch_jit = jax.jit(_unpack_batch, static_argnames=("layout",))


def _sample_packed(logits, counts, prompt_mask, last_tokens, buf, *, layout, num_top_logprobs,
                   variant):
    """One device: ``sampler.sample`` on SamplingInputs packed in ``buf`` (``host_inputs``),
    then the sampled tokens recorded in ``last_tokens``, in one program. (With DP or TP the
    sampler and the record stay two programs: there the sampler state's first placement and
    a program's output differ in sharding, and one program over both would need each
    variant compiled for both.)"""
    inp = host_inputs.unpack_tree(buf, layout)
    out = sampler.sample(logits, counts, prompt_mask, inp, num_top_logprobs=num_top_logprobs,
                         variant=variant)
    counts = out.pop("counts")
    return out, counts, _record_tokens(last_tokens, inp.slot, out["tokens"], inp.valid)


_sample_packed_jit = jax.jit(_sample_packed,
                             static_argnames=("layout", "num_top_logprobs", "variant"),
                             donate_argnames=("counts", "last_tokens"))


def needs_top_k(chunks: Sequence[ScheduledChunk]) -> bool:
    """A step's sampler must run with K > 0 (``max_top_logprobs_num``): some request asks for
    top logprobs, or for prompt logprobs in this chunk (the sampler's row outputs come with
    K). Every step returns the chosen tokens' logprobs."""
    return any(c.req.wants_top_logprobs or (c.req.return_logprob and len(
        c.req.input_logprob_rows(c.start, c.num_tokens)) > 0) for c in chunks)


def sampler_variant(chunks: Sequence[ScheduledChunk]) -> sampler.SamplerVariant:
    """The sampler variant of a step: the stages its sampling rows need (host-side)."""
    draw = filt = pen = mask = bias = False
    for c in chunks:
        if not c.sample:
            continue
        req, sp = c.req, c.req.sampling
        if sp.temperature > 0:
            draw = True
            filt |= sp.top_k_or_off > 0 or sp.top_p < 1 or sp.min_p > 0
        pen |= uses_penalties(sp)
        mask |= req.grammar is not None or req.num_sampled < sp.min_new_tokens
        bias |= bool(sp.logit_bias)
    return sampler.variant_for(sampler.SamplerVariant(draw=draw, filter=filt, penalties=pen,
                                                      mask=mask, bias=bias))


def no_bias(R: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """All-padding logit-bias entries of R rows: ids i32[R, B] = V (dropped), values 0."""
    B = sampler.MAX_LOGIT_BIAS
    return np.full((R, B), vocab_size, np.int32), np.zeros((R, B), np.float32)


def ban_stop_tokens(words: np.ndarray, req: Any, vocab_size: int) -> None:
    """Clear the bits of ``req``'s stop (and, unless ignored, eos) tokens in its bitmask row
    ``words`` u32[W]: it has not yet sampled ``min_new_tokens``."""
    sp = req.sampling
    banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(req.eos_ids))
    for t in banned:
        if 0 <= t < vocab_size:
            words[t // 32] &= ~np.uint32(1 << (t % 32))


def sampling_inputs(chunks: Sequence[ScheduledChunk], rows: Sequence[np.ndarray], R: int, L: int,
                    vocab_size: int, *, row_offset: int = 0, slot_offset: int = 0,
                    mask: bool = True, bias: bool = True) -> sampler.SamplingInputs:
    """Sampling inputs of one rank's chunks (R request rows, L logits rows); ``rows`` are each
    chunk's logits rows. ``row_offset`` / ``slot_offset`` place the rank's logits rows and
    penalty-state rows in the global [D*L] / [D*S] layout. ``mask=False`` (no row has a
    grammar or a min_new_tokens ban) builds no bitmask, ``bias=False`` (no row has a logit
    bias) no bias entries."""
    inp = dummy_sampling_inputs(R, L, vocab_size, sampler.SamplerVariant(mask=mask, bias=bias))
    for i, (c, r) in enumerate(zip(chunks, rows)):
        req, sp = c.req, c.req.sampling
        inp.slot[i] = c.state_slot + slot_offset
        if c.logits == "all":
            fill = req.fill_ids
            inp.target_ids[r] = [fill[p + 1] if p + 1 < len(fill) else 0
                                 for p in range(c.start, c.start + c.num_tokens)]
        if not c.sample:
            continue
        inp.sample_rows[i] = r[-1] + row_offset
        inp.valid[i] = True
        inp.temperature[i], inp.top_p[i], inp.min_p[i] = sp.temperature, sp.top_p, sp.min_p
        inp.top_k[i] = sp.top_k_or_off
        inp.frequency_penalty[i] = sp.frequency_penalty
        inp.presence_penalty[i] = sp.presence_penalty
        inp.repetition_penalty[i] = sp.repetition_penalty
        inp.seed_lo[i], inp.seed_hi[i] = req.seed & 0xFFFFFFFF, (req.seed >> 32) & 0xFFFFFFFF
        inp.step[i] = req.num_sampled  # this token's index (earlier ones may be in flight)
        if inp.bias_ids is not None and (entries := sp.logit_bias_arrays()) is not None:
            inp.bias_ids[i, :len(entries[0])], inp.bias_values[i, :len(entries[1])] = entries
        if inp.bitmask is None:
            continue
        if req.grammar is not None:
            req.grammar.fill_bitmask(inp.bitmask[i])
        if req.num_sampled < sp.min_new_tokens:
            ban_stop_tokens(inp.bitmask.view(np.uint32)[i], req, vocab_size)
    return inp


def dummy_sampling_inputs(R: int, L: int, vocab_size: int,
                          variant: sampler.SamplerVariant = sampler.FULL) -> sampler.SamplingInputs:
    """All-padding sampling inputs of R rows / L logits rows, shaped for ``variant`` (fresh,
    writable arrays: ``sampling_inputs`` fills them in)."""
    z = lambda dtype=np.int32: np.zeros(R, dtype)  # noqa: E731
    f = lambda v: np.full(R, v, np.float32)  # noqa: E731
    bias_ids, bias_values = no_bias(R, vocab_size) if variant.bias else (None, None)
    return sampler.SamplingInputs(
        sample_rows=z(), valid=z(np.bool_), temperature=f(0.0), top_p=f(1.0), top_k=z(),
        min_p=f(0.0), frequency_penalty=f(0.0), presence_penalty=f(0.0),
        repetition_penalty=f(1.0), seed_lo=z(np.uint32), seed_hi=z(np.uint32), step=z(),
        slot=z(), target_ids=np.zeros(L, np.int32), bias_ids=bias_ids, bias_values=bias_values,
        bitmask=np.full((R, (vocab_size + 31) // 32), -1, np.int32) if variant.mask else None,
    )


class SamplerState:
    """The penalty counts, prompt masks and last tokens of every global state slot (see the
    module docstring), placed by ``place`` (the step backend's ``place_sampler_state``)."""

    def __init__(self, vocab_size: int, num_slots: int,
                 place: Callable[[jax.Array, jax.Array, jax.Array], tuple]):
        self.vocab_size = vocab_size
        S, V = num_slots, vocab_size
        self.counts, self.prompt_mask, self.last_tokens = place(
            jnp.zeros((S, V), jnp.int32), jnp.zeros((S, V), jnp.bool_), jnp.zeros((S,), jnp.int32))

    def reset_penalty_row(self, slot: int, req: Any) -> None:
        """Penalty state of global slot ``slot`` := the counts of ``req``'s prompt and outputs
        (built here with numpy, set on the device by one fixed-shape program)."""
        count_row = np.bincount(np.asarray(req.output_ids, np.int64),
                                minlength=self.vocab_size)[: self.vocab_size].astype(np.int32)
        mask_row = np.zeros(self.vocab_size, np.bool_)
        mask_row[np.asarray(req.prompt_ids, np.int64)] = True
        self._set_row(slot, count_row, mask_row)

    def clear_row(self, slot: int) -> None:
        """Zero the penalty state of global slot ``slot`` (compiles the row program)."""
        self._set_row(slot, np.zeros(self.vocab_size, np.int32),
                      np.zeros(self.vocab_size, np.bool_))

    def _set_row(self, slot: int, count_row: np.ndarray, mask_row: np.ndarray) -> None:
        self.counts, self.prompt_mask = sampler.set_penalty_row_jit(
            self.counts, self.prompt_mask, np.int32(slot), count_row, mask_row)

    def sample(self, logits: jax.Array, inp: sampler.SamplingInputs, K: int,
               variant: sampler.SamplerVariant = sampler.FULL) -> dict[str, jax.Array]:
        """Dispatch the sampler (updating the penalty counts and ``last_tokens``); returns its
        outputs as device arrays."""
        out, self.counts, self.last_tokens = self.sample_with(
            logits, self.counts, self.last_tokens, inp, K, variant)
        return out

    def sample_with(self, logits, counts, last_tokens, inp, K, variant):
        """The sampler on given penalty counts / last tokens (both donated): (outputs, new
        counts, new last tokens). ``inp``: SamplingInputs (two programs), or packed on the
        device (``host_inputs.Packed``: unpacked inside one program, ``_sample_packed``). Warm-up runs it on
        scratch copies."""
        if isinstance(inp, host_inputs.Packed):
            return _sample_packed_jit(logits, counts, self.prompt_mask, last_tokens, inp.buf,
                                      layout=inp.layout, num_top_logprobs=K, variant=variant)
        out = sampler.sample_jit(logits, counts, self.prompt_mask, inp, num_top_logprobs=K,
                                 variant=variant)
        counts = out.pop("counts")
        return out, counts, _record_tokens_jit(last_tokens, inp.slot, out["tokens"], inp.valid)

    def lower_sample(self, logits, inp: host_inputs.Packed, K, variant) -> jax.stages.Lowered:
        """``sample_with``'s packed program lowered on the live counts and last tokens
        (nothing runs; ``parallel_compile``)."""
        return _sample_packed_jit.lower(logits, self.counts, self.prompt_mask, self.last_tokens,
                                        inp.buf, layout=inp.layout, num_top_logprobs=K,
                                        variant=variant)

    def verify_with(self, logits, counts, last_tokens, spec, inp, K, variant):
        """The verify sampler (``rejection.sample_verify_step``) on given penalty counts /
        last tokens (both donated) and ``spec`` (``verify_step.VerifyInputs``): (outputs,
        new counts, new last tokens). Warm-up runs it on scratch copies."""
        return sample_verify_step_jit(logits, counts, self.prompt_mask, last_tokens,
                                      spec.drafts, spec.num_drafts, inp,
                                      num_top_logprobs=K, variant=variant)
