"""DP x EP generation on 8 CPU devices vs each request alone on one device (run as a script).

Run by tests/parallel/test_dp_ep.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8; writes an .npz of greedy tokens and
logits of both runs. Loads are uneven on purpose: rank 0 holds four long prompts, ranks 1-4
one or two short ones, ranks 5-7 are idle at first; rank 6 admits a new request in the middle
of decoding, which turns those steps into MIXED steps.

EPLB (``parallel/eplb.py``): the same plan again with the experts stored in 24 physical
slots (16 experts + 8 redundant) of other placements (one from made-up loads: permuted, hot
experts copied; the trivial one, rebalanced in mid-run), and on a checkpoint whose router
favours a few experts, run once on the trivial placement and once after a rebalance from its
recorded loads (the per-EP-rank routed-row max/mean of both).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
from sglang_tpu_backend.model_executor.expert_balancer import ExpertBalancer
from sglang_tpu_backend.model_executor.expert_location import moe_layers, params_location
from sglang_tpu_backend.model_executor.forward_batch import ForwardMode
from sglang_tpu_backend.model_loader.loader import load_model
from sglang_tpu_backend.model_loader.tiny_model import default_model_path
from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache
from sglang_tpu_backend.parallel.dp_forward import DPForward
from sglang_tpu_backend.parallel.eplb import ExpertLocation, place_experts
from sglang_tpu_backend.parallel.mesh import make_mesh

PAGE = 8
PAGES_PER_SEQ = 12  # 96 tokens of context per request
STEPS = 6  # decode steps after the prefill
LATE_STEP = 2  # the step at which rank 6's request arrives
# rank -> prompt lengths (spanning several pages and GDN chunks); ranks 5-7 idle at first.
PLAN = {0: [37, 33, 41, 29], 1: [9, 14], 2: [5], 3: [22, 3], 4: [17]}
LATE = (6, 19)  # (rank, prompt length)
REDUNDANT = 8  # EPLB runs: 16 experts + 8 redundant = 24 slots, 3 per rank
REBALANCE_STEP = 3  # the step before which the redundant run rebalances
HOT_EXPERTS = (9, 10, 11)  # the skewed router favours them (all on rank 3 at first)


def alone(params, cfg, prompt, steps, prefill_bucket=64):
    """Greedy tokens and per-step logits of one request on one device (the prompt padded to
    one bucket, so every request shares one prefill compile)."""
    cache = init_cache(cfg, num_pages=PAGES_PER_SEQ, page_size=PAGE, num_state_slots=1,
                       kv_dtype=jnp.float32, state_dtype=jnp.float32)
    pages = list(range(PAGES_PER_SEQ))
    batch, _ = build_forward_batch([SeqChunk(prompt, 0, pages, 0)], page_size=PAGE,
                                   num_tokens=prefill_bucket, num_seqs=1,
                                   pages_per_seq=PAGES_PER_SEQ, num_logits=1)
    logits, cache = forward_jit(params, cache, batch, cfg, "reference")
    out_logits, tokens = [np.asarray(logits[0])], []
    for step in range(steps):
        tokens.append(int(np.argmax(out_logits[-1])))
        batch, _ = build_forward_batch([SeqChunk([tokens[-1]], len(prompt) + step, pages, 0)],
                                       page_size=PAGE, pages_per_seq=PAGES_PER_SEQ)
        logits, cache = forward_jit(params, cache, batch, cfg, "reference")
        out_logits.append(np.asarray(logits[0]))
    return tokens, np.stack(out_logits)


class Request:
    def __init__(self, rank, slot, prompt):
        self.rank, self.slot, self.prompt = rank, slot, prompt
        self.pages = list(range(slot * PAGES_PER_SEQ, (slot + 1) * PAGES_PER_SEQ))  # rank-local
        self.tokens, self.logits, self.context = [], [], 0

    def chunk(self):
        ids = self.prompt if self.context == 0 else [self.tokens[-1]]
        return SeqChunk(ids, self.context, self.pages, self.slot)


def make_requests(cfg):
    """PLAN's requests (random prompts, seed 0) and the late one."""
    rng = np.random.default_rng(0)
    requests = [Request(rank, slot, rng.integers(3, cfg.vocab_size, n).tolist())
                for rank, lens in PLAN.items() for slot, n in enumerate(lens)]
    late = Request(LATE[0], 0, rng.integers(3, cfg.vocab_size, LATE[1]).tolist())
    return requests, late


def generate(dp_size, requests, late, run_step):
    """Greedy generation of the plan; ``run_step(rank_batches) -> f32[D*R, V]`` runs one step.

    Returns the requests (in arrival order) and the mode of each step."""
    active, modes = list(requests), []
    for step in range(STEPS + 1):
        if step == LATE_STEP:
            active.append(late)
        live = [r for r in active if len(r.logits) <= STEPS - (LATE_STEP if r is late else 0)]
        per_rank = [[r for r in live if r.rank == k] for k in range(dp_size)]
        decode = all(r.context > 0 for r in live)
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        R = 8
        T = max(8, max(sum(len(r.chunk().token_ids) for r in rs) for rs in per_rank))
        T = R if decode else 1 << (T - 1).bit_length()
        batches, rows = [], []
        for rs in per_rank:
            fb, rws = build_forward_batch([r.chunk() for r in rs], page_size=PAGE, mode=mode,
                                          num_tokens=T, num_seqs=R, pages_per_seq=PAGES_PER_SEQ,
                                          num_logits=R)
            batches.append(fb)
            rows.append(rws)
        logits = np.asarray(run_step(batches)).reshape(dp_size, R, -1)
        modes.append(int(mode))
        for k, rs in enumerate(per_rank):
            for r, rw in zip(rs, rows[k]):
                r.context += len(r.chunk().token_ids)
                r.logits.append(logits[k, rw[-1]])
                r.tokens.append(int(np.argmax(r.logits[-1])))
    return active, modes


def init_dp_cache(dp: DPForward):
    return dp.init_cache(num_pages=8 * PAGES_PER_SEQ, page_size=PAGE, num_state_slots=8,
                         kv_dtype=jnp.float32, state_dtype=jnp.float32)


def eplb_generate(cfg, params, dp: DPForward, balancer: ExpertBalancer, rebalance_at=None,
                  placed=None):
    """The plan on the physical params of ``balancer``'s location (``placed``: already placed
    ones), every step's expert loads recorded; a rebalance before step ``rebalance_at``.
    Returns (requests, the placed params after the run)."""
    state = {"params": dp.shard_params(balancer.physical(params)) if placed is None else placed,
             "cache": init_dp_cache(dp), "step": 0}

    def run_step(batches):
        if state["step"] == rebalance_at:
            state["params"] = balancer.rebalance(state["params"])
        logits, state["cache"], (_, counts) = dp(state["params"], state["cache"],
                                                 dp.put_batch(batches))
        balancer.record(np.asarray(counts))
        state["step"] += 1
        return logits

    done, _ = generate(dp.dp_size, *make_requests(cfg), run_step)
    return done, state["params"]


def skewed(params, cfg, scale=3.0):
    """``params`` with the router's columns of HOT_EXPERTS scaled by ``scale`` in every layer."""
    def scale_gate(group):
        gate = group["mlp"]["gate"]  # [groups, H, E]
        gate = gate.at[..., list(HOT_EXPERTS)].multiply(scale)
        return {**group, "mlp": {**group["mlp"], "gate": gate}}

    return {**params, "layer_groups": tuple(scale_gate(g) for g in params["layer_groups"])}


def eplb_runs(cfg, params, results):
    """The EPLB runs' tokens / logits and balance figures into ``results``."""
    layers = len(moe_layers(cfg))
    dp = DPForward(cfg, make_mesh(8), impl="reference", with_stats=True)
    loads = np.random.default_rng(1).integers(1, 100, (layers, cfg.num_experts))
    slots = cfg.num_experts + REDUNDANT  # every run 24 slots: one compiled step for all
    runs = {
        "permuted": (ExpertBalancer(cfg, place_experts(loads, slots, 8), 8), None),
        "rebalanced": (ExpertBalancer(cfg, ExpertLocation.trivial(layers, cfg.num_experts, slots),
                                      8), REBALANCE_STEP),
    }
    for name, (balancer, rebalance_at) in runs.items():
        first = balancer.location.logical
        done, placed = eplb_generate(cfg, params, dp, balancer, rebalance_at)
        for i, r in enumerate(done):
            results[f"{name}_tokens_{i}"] = np.asarray(r.tokens[:len(r.logits) - 1])
            results[f"{name}_logits_{i}"] = np.stack(r.logits)
        results[f"{name}_first_location"] = first
        results[f"{name}_last_location"] = params_location(placed, cfg).logical
        results[f"{name}_rebalances"] = np.asarray(balancer.num_rebalances)

    # Skewed router: the plan on the trivial placement, a rebalance, the plan again.
    hot = skewed(params, cfg)
    balancer = ExpertBalancer(cfg, ExpertLocation.trivial(layers, cfg.num_experts, slots), 8)
    before, placed = eplb_generate(cfg, hot, dp, balancer)
    results["skew_ratio_before"] = balancer.rank_balance()
    placed = balancer.rebalance(placed)
    after, _ = eplb_generate(cfg, hot, dp, balancer, placed=placed)
    results["skew_ratio_after"] = balancer.rank_balance()
    results["skew_logical_loads"] = balancer.location.logical_loads(balancer.window.counts)
    results["skew_tokens_before"] = np.concatenate([r.tokens for r in before])
    results["skew_tokens_after"] = np.concatenate([r.tokens for r in after])


def main(out_path: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    cfg, params = load_model(default_model_path(), dtype=jnp.float32)
    dp = DPForward(cfg, make_mesh(8), impl="reference")
    sharded, cache = dp.shard_params(params), [init_dp_cache(dp)]

    def run_step(batches):
        logits, cache[0] = dp(sharded, cache[0], dp.put_batch(batches))
        return logits

    done, _ = generate(dp.dp_size, *make_requests(cfg), run_step)
    results = {}
    for i, r in enumerate(done):
        steps = len(r.logits) - 1
        tokens, logits = alone(params, cfg, r.prompt, steps)
        results[f"dp_tokens_{i}"] = np.asarray(r.tokens[:steps])
        results[f"dp_logits_{i}"] = np.stack(r.logits)
        results[f"ref_tokens_{i}"] = np.asarray(tokens)
        results[f"ref_logits_{i}"] = logits
    results["num_requests"] = np.asarray(len(done))
    results["mesh_shape"] = np.asarray(dp.mesh.devices.shape)
    eplb_runs(cfg, params, results)
    np.savez(out_path, **results)


if __name__ == "__main__":
    main(sys.argv[1])
