"""Multi-step decoding (``--num-scheduler-steps N``): N decode steps in one device program.

The host's per-step work (schedule, batch build, dispatch, result split, delivery) costs
milliseconds; a small decode step's device time is well under that. Running N decode
steps per launch pays the host work once per N tokens of every request.

One program (``multi_decode_jit``, one device only) runs a ``lax.scan`` of N iterations of:
forward of the DECODE batch -> the sampler (penalty counts and ``last_tokens`` updated as a
single step updates them) -> each request's sampled token becomes its next input id, and its
position and KV length advance by one. Sampling is keyed per (request seed, output index)
(``SamplingInputs.step``), and the scan advances ``step`` by one per iteration, so greedy
and seeded tokens equal those of N single steps.

One program per DECODE bucket serves every sampler variant: the sampler is a ``lax.switch``
over ``sampler.MULTISTEP_BRANCHES`` (greedy, plain draws, full without the mask stage, which
no multi-step request needs) on a runtime index packed with the sampling inputs
(``pack_inputs``: the inputs laid out for every branch, ``sampler.MULTISTEP_INPUTS``, and the
step's branch, ``sampler.multistep_branch``), so only the step's branch runs on the device and
its outputs are those of the step's variant. (A program per variant cost warm-up three
programs per bucket, each lowered on its own.)

The scheduler (``Scheduler._multistep_ok``) sends such a step only when every chunk is a
decode whose request is eligible (no grammar, no pending ``min_new_tokens`` ban, no routed
experts, N more positions within the context) and has pages for N more tokens. Tokens past
a request's finish (EOS, stop ids / strings, max_new_tokens) are computed and dropped on the
host (``Scheduler._append_tokens``); their KV sits in the request's own pages, freed with
them. Router stats are not returned for these steps (as for verify steps).

Where it does not run (``supported``; the runner then serves single steps): DP / TP ranks
(one device only), speculative decoding, the routed-expert store (it records every step's
routed ids), EPLB rebalancing (it needs every step's expert loads) and deterministic mode (a
request's tokens would depend on whether a batch mate made its step a single one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.managers.schedule_batch import ChunkResult, ScheduledChunk
from sglang_tpu_backend.model_executor import host_inputs
from sglang_tpu_backend.model_executor.forward_batch import ForwardBatch
from sglang_tpu_backend.model_executor.sampler_state import _record_tokens, dummy_sampling_inputs
from sglang_tpu_backend.models import qwen3_5_moe
from sglang_tpu_backend.sampling import sampler

# Sampler outputs of prompt rows: a decode step has none worth returning.
_ROW_KEYS = ("row_logprobs", "row_top_logprobs", "row_top_ids")


def advance_batch(fb: ForwardBatch, tokens: jax.Array, valid: jax.Array) -> ForwardBatch:
    """The DECODE batch of the next step: request r's input id := ``tokens[r]`` (i32[R], at
    its token row ``cu_q_lens[r]``, rows with ``valid[r]`` only), positions of the real token
    rows and KV lengths of the real requests + 1. Padding rows stay as they are."""
    T, R = fb.input_ids.shape[0], fb.kv_lens.shape[0]
    rows = jnp.where(valid, fb.cu_q_lens[:R], T)
    input_ids = fb.input_ids.at[rows].set(tokens.astype(fb.input_ids.dtype), mode="drop")
    real_tokens = jnp.arange(T) < fb.cu_q_lens[fb.num_seqs[0]]
    real_reqs = jnp.arange(R) < fb.num_seqs[0]
    return dataclasses.replace(
        fb, input_ids=input_ids, positions=fb.positions + real_tokens.astype(jnp.int32),
        kv_lens=fb.kv_lens + real_reqs.astype(jnp.int32))


def sample_branch(branch, logits, counts, prompt_mask, inp: sampler.SamplingInputs,
                  num_top_logprobs: int):
    """``sampler.sample`` with the variant ``sampler.MULTISTEP_BRANCHES[branch]`` (i32[],
    traced): a ``lax.switch``, so only that branch runs. ``inp`` holds every field the branches
    read (``sampler.MULTISTEP_INPUTS``); each branch ignores those it does not. Returns
    ``sample``'s outputs but the prompt rows' (``_ROW_KEYS``); the counts are updated after
    the switch, one scatter outside the branches."""
    def run(variant):
        def one(logits, counts, prompt_mask, inp):
            out = sampler.sample(logits, counts, prompt_mask, inp,
                                 num_top_logprobs=num_top_logprobs, variant=variant)
            return {k: v for k, v in out.items() if k != "counts" and k not in _ROW_KEYS}
        return one

    out = jax.lax.switch(branch, [run(v) for v in sampler.MULTISTEP_BRANCHES],
                         logits, counts, prompt_mask, inp)
    out["counts"] = sampler.count_tokens(counts, inp, out["tokens"])
    return out


def multi_decode(params, cache, fb: ForwardBatch, counts, prompt_mask, last_tokens, buf, *,
                 layout: host_inputs.PackLayout, num_steps: int, num_top_logprobs: int,
                 cfg, impl: str, batch_invariant: bool):
    """``num_steps`` (N) decode steps of ``fb`` (device ForwardBatch, input ids resolved) with
    the SamplingInputs and the sampler branch packed in ``buf`` (``pack_inputs``).

    Returns (out, cache, counts, last_tokens): ``out`` the sampler's outputs stacked per
    iteration (``tokens`` i32[N, R], ``logprobs`` f32[N, R]; with K > 0 ``top_logprobs``
    f32[N, R, K] and ``top_ids`` i32[N, R, K]); ``last_tokens`` holds each request's Nth
    token (what an overlapped next step reads)."""
    inp, branch = host_inputs.unpack_tree(buf, layout)

    def body(carry, _):
        cache, counts, last_tokens, fb, step = carry
        # The jitted forward, nested (its trace cached by JAX); XLA inlines it, so the program
        # is the same as with the forward written out here.
        logits, cache = qwen3_5_moe.forward_jit(params, cache, fb, cfg=cfg, impl=impl,
                                                batch_invariant=batch_invariant)
        out = sample_branch(branch, logits, counts, prompt_mask,
                            dataclasses.replace(inp, step=step), num_top_logprobs)
        counts = out.pop("counts")
        last_tokens = _record_tokens(last_tokens, inp.slot, out["tokens"], inp.valid)
        fb = advance_batch(fb, out["tokens"], inp.valid)
        return (cache, counts, last_tokens, fb, step + 1), out

    (cache, counts, last_tokens, _, _), out = jax.lax.scan(
        body, (cache, counts, last_tokens, fb, inp.step), None, length=num_steps)
    return out, cache, counts, last_tokens


multi_decode_jit = jax.jit(
    multi_decode,
    static_argnames=("layout", "num_steps", "num_top_logprobs", "cfg", "impl",
                     "batch_invariant"),
    donate_argnames=("cache", "counts", "last_tokens"))


def supported(one_device: bool, num_drafts: int, nextn, routed, rebalances: bool,
              batch_invariant: bool) -> bool:
    """Multi-step launches can run on a runner of this kind (module docstring)."""
    return (one_device and not num_drafts and nextn is None and routed is None
            and not rebalances and not batch_invariant)


def widen_page_table(fb: ForwardBatch, chunks: list[ScheduledChunk]) -> None:
    """Multi-step: request row j of numpy ``fb`` gets every page chunk j holds (the scheduler
    gave it pages for the step's N positions), not only those of its first position."""
    P = fb.page_table.shape[1]
    for j, c in enumerate(chunks):
        pages = c.pages[:P]
        fb.page_table[j, :len(pages)] = pages


def chunk_result(out: dict, i: int, c: ScheduledChunk) -> ChunkResult:
    """A multi-step decode chunk's result from the stacked host outputs (``multistep``):
    ``run`` = its N (token, logprob, top logprobs) in order; ``i`` its sampling row."""
    n_top = c.req.top_logprobs_num
    tops = out.get("top_ids") is not None and n_top
    run = []
    for n in range(out["tokens"].shape[0]):
        top = (list(zip(out["top_logprobs"][n, i, :n_top].tolist(),
                        out["top_ids"][n, i, :n_top].tolist())) if tops else None)
        run.append((int(out["tokens"][n, i]), float(out["logprobs"][n, i]), top))
    return ChunkResult(next_token=run[0][0], logprob=run[0][1], top_logprobs=run[0][2], run=run)


def pack_inputs(runner, inp: sampler.SamplingInputs, variant: sampler.SamplerVariant
                ) -> host_inputs.Packed:
    """The multi-step program's sampling inputs on a ``ModelRunner``'s device in one copy:
    ``inp`` (numpy, laid out as ``sampler.MULTISTEP_INPUTS``: no bitmask) and the index of
    ``variant``'s branch (``sampler.multistep_branch``)."""
    if inp.bitmask is not None or inp.bias_ids is None:
        raise ValueError("multi-step sampling inputs are laid out as sampler.MULTISTEP_INPUTS")
    branch = np.int32(sampler.multistep_branch(variant))
    return host_inputs.packed((inp, branch), runner.backend.device)


def dummy_inputs(runner, R: int, L: int) -> host_inputs.Packed:
    """All-padding multi-step sampling inputs of R rows / L logits rows, packed as serving
    packs them (warm-up; the greedy branch, though any branch's program holds them all)."""
    inp = dummy_sampling_inputs(R, L, runner.vocab_size, sampler.MULTISTEP_INPUTS)
    return pack_inputs(runner, inp, sampler.GREEDY)


def dispatch(runner, fb: ForwardBatch, inp: host_inputs.Packed, num_steps: int, K: int
             ) -> dict[str, jax.Array]:
    """``multi_decode_jit`` on a ``ModelRunner``'s params, cache and sampler state, for a placed
    DECODE batch and sampling inputs packed by ``pack_inputs``: the runner's cache, penalty
    counts and last tokens are donated and replaced; returns the stacked outputs (nothing
    waited for)."""
    state = runner.sampler
    args, static = _call(runner, fb, inp, num_steps, K)
    out, runner.cache, state.counts, state.last_tokens = multi_decode_jit(*args, **static)
    return out


def lower_dispatch(runner, fb: ForwardBatch, inp: host_inputs.Packed, num_steps: int, K: int
                   ) -> jax.stages.Lowered:
    """``dispatch``'s program lowered for these arguments (nothing runs; ``parallel_compile``)."""
    args, static = _call(runner, fb, inp, num_steps, K)
    return multi_decode_jit.lower(*args, **static)


def _call(runner, fb, inp, num_steps, K) -> tuple[tuple, dict]:
    state = runner.sampler
    return ((runner.params, runner.cache, fb, state.counts, state.prompt_mask, state.last_tokens,
             inp.buf),
            dict(layout=inp.layout, num_steps=num_steps, num_top_logprobs=K,
                 cfg=runner.cfg, impl=runner.backend.impl,
                 batch_invariant=runner.backend.batch_invariant))
