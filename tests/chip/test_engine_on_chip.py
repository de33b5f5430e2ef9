"""The engine on a TPU chip, in-process (no sockets there): it starts, serves, shuts down, and
its greedy float32 tokens equal the CPU's on two architectures.

Runs on the TPU leg (``tests/run_tpu.sh``); skipped everywhere else (marker ``chip``).

Parity: the engine decodes greedily on the chip (f32 weights and caches, the Pallas kernels,
matmuls at "highest" precision); the CPU then runs the pure-JAX reference
forward over each whole sequence (prompt + the chip's tokens, teacher-forced) on the CPU
device of the same process. A sequence equals the CPU's greedy one exactly when, at every
generated position, the CPU's argmax is the chip's token. Where the first one differs, the
CPU's preference for its own token over the chip's must be a near-tie: below the numeric
disagreement the two devices show where they agree. That disagreement (``drift``) is the
largest gap between the chip's log-probability of each generated token and the CPU's
log-softmax of the same token, over every position before a sequence's first divergence; a
flip is a near-tie when the CPU's gap is below ``TIE_FACTOR`` x drift (two logits, each off
by up to the drift, plus margin) or ``NEAR_TIE``, whichever is larger. A defect moves the
logits by far more than either.
The figures (sequences equal, first divergence, its gap) are printed and, when
``STB_CHIP_REPORT`` names a file, written there as JSON.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.chip

NUM_PROMPTS = 32
NEW_TOKENS = 48
NEAR_TIE = 1e-3  # floor of the near-tie bound (logits, f32, "highest")
TIE_FACTOR = 4  # near-tie bound in units of the measured chip-vs-CPU logprob drift


def _engine(**kw):
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.entrypoints.offline import OfflineEngine
    from sglang_tpu_backend.server_args import ServerArgs

    args = dict(max_running_requests=32, chunked_prefill_size=256, context_length=256,
                page_size=16, random_seed=0)
    return OfflineEngine(engine=Engine(ServerArgs(**{**args, **kw})))


def test_engine_starts_serves_and_shuts_down():
    """The default engine (bf16, warm-up on) starts on the chip, answers, and stops. On main
    b104d16 it failed while loading: the parameter shardings of a TPU hold layout
    ``Format``s, which ``host_load.is_cpu`` read as Shardings (AttributeError)."""
    assert jax.default_backend() == "tpu"
    eng = _engine()
    try:
        assert {d.platform for x in jax.tree.leaves(eng.engine.runner.params)
                for d in x.devices()} == {"tpu"}
        outs = eng.generate(["The sea is", "Once upon a time"],
                            {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert [len(o["output_ids"]) for o in outs] == [8, 8]
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        stats = eng.engine.pool_stats()
        assert stats["num_running"] == 0 and stats["state_slots_used"] == 0
    finally:
        eng.shutdown()
    assert not eng.engine.loop.is_running


def test_staged_warmup_compiles_off_the_serving_thread_on_the_chip():
    """The TPU default: ready after the first stage, serving while the second compiles; after
    it, decode steps take their own buckets and multi-step launches and nothing compiles (the
    programs lowered on ShapeDtypeStructs of the TPU arrays, layouts included, have the
    serving calls' cache keys)."""
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter

    eng = _engine(compilation_cache_dir="")
    try:
        bg = eng.engine.background_warmup
        assert bg is not None
        sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        early = eng.generate(["The sea is", "Once upon a time"], sp)
        assert bg.wait(timeout=300), bg.status()
        assert bg.status()["stage"] == "complete", bg.status()
        counter, launches = CompileCounter(), eng.engine.scheduler.num_multistep_launches
        late = eng.generate(["The sea is", "Once upon a time"] + ["A B C"] * 6, sp)
        assert counter.lowerings == 0, counter.lowered_names
        assert eng.engine.scheduler.num_multistep_launches > launches
        assert all(len(o["output_ids"]) == 24 for o in early + late)
        print(f"\nstaged warm-up on the chip: {bg.status()}")
    finally:
        eng.shutdown()


def _cpu_teacher_forced(model_path, sequences: list[list[int]], prompt_lens: list[int]):
    """For each sequence, the CPU reference's logits f32[n_generated, V] at the positions that
    predict its generated tokens (one prefill of the whole sequence on the CPU device). Every
    sequence is padded at its end to one length, so the CPU compiles one program, not one per
    length: a position's logits depend only on the tokens before it (causal attention, GDN's
    forward recurrence), so the padding changes none that are read."""
    from sglang_tpu_backend.model_loader.loader import load_model
    from sglang_tpu_backend.model_executor.batch_builder import SeqChunk, build_forward_batch
    from sglang_tpu_backend.models.qwen3_5_moe import forward_jit, init_cache

    cpu, page = jax.devices("cpu")[0], 16
    length = -(-max(map(len, sequences)) // page) * page
    with jax.default_device(cpu):
        cfg, params = load_model(model_path, dtype=jnp.float32)
        params = jax.device_put(params, cpu)
        out = []
        for seq, n in zip(sequences, prompt_lens):
            padded = list(seq) + [0] * (length - len(seq))
            cache = init_cache(cfg, num_pages=length // page, page_size=page, num_state_slots=2,
                               kv_dtype=jnp.float32, state_dtype=jnp.float32)
            batch, rows = build_forward_batch(
                [SeqChunk(padded, 0, list(range(length // page)), 1, logits="all")],
                page_size=page)
            batch = jax.device_put(batch, cpu)
            logits, _ = forward_jit(params, cache, batch, cfg, impl="reference")
            logits = np.asarray(logits)[rows[0]]  # [length, V]
            out.append(logits[n - 1:len(seq) - 1])
    return out


def _parity(model_path, name: str) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, int(n)).tolist() for n in rng.integers(4, 120, NUM_PROMPTS)]
    eng = _engine(model_path=str(model_path) if model_path else None, dtype="float32")
    try:
        outs = eng.generate(input_ids=prompts, return_logprob=True, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        path = eng.engine.args.model_path
    finally:
        eng.shutdown()
    gen = [o["output_ids"] for o in outs]
    assert all(len(g) == NEW_TOKENS for g in gen)
    ref = _cpu_teacher_forced(path, [p + g for p, g in zip(prompts, gen)],
                              [len(p) for p in prompts])
    chip_lp = [np.array([e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs]
    report = {"model": name, "sequences": len(prompts), "tokens_each": NEW_TOKENS,
              "equal": 0, "drift": 0.0, "divergences": []}
    for i, (g, lg) in enumerate(zip(gen, ref)):
        cpu_tokens = lg.argmax(-1)
        diff = np.nonzero(cpu_tokens != np.asarray(g))[0]
        agree = int(diff[0]) if diff.size else len(g)  # positions before the first divergence
        cpu_lp = lg - np.logaddexp.reduce(lg, axis=-1, keepdims=True)
        cpu_lp = cpu_lp[np.arange(len(g)), np.asarray(g)]
        report["drift"] = max(report["drift"],
                              float(np.abs(chip_lp[i][:agree] - cpu_lp[:agree]).max(initial=0)))
        if diff.size == 0:
            report["equal"] += 1
            continue
        j = int(diff[0])
        top2 = np.sort(lg[j])[-2:]
        report["divergences"].append({"sequence": i, "first_divergence": j,
                                      "chip_token": int(g[j]), "cpu_token": int(cpu_tokens[j]),
                                      "cpu_top2_gap": float(top2[1] - top2[0]),
                                      "chip_token_cpu_gap": float(lg[j].max() - lg[j][g[j]])})
    print(f"\nparity {name}: {json.dumps(report)}")
    if os.environ.get("STB_CHIP_REPORT"):
        with open(os.environ["STB_CHIP_REPORT"], "a") as f:
            f.write(json.dumps(report) + "\n")
    return report


@pytest.fixture
def f32_matmuls():
    """f32 matmuls process-wide for the test (the engine's loop thread traces its programs
    too, and a ``with`` block would hold for this thread only), restored after."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)


@pytest.mark.parametrize("arch", ["default", "second"])
def test_greedy_f32_tokens_equal_the_cpus(arch, tmp_path, f32_matmuls):
    from sglang_tpu_backend.model_loader.tiny_model import SECOND_ARCHITECTURE, write_architecture

    path = None if arch == "default" else write_architecture(tmp_path / "m", SECOND_ARCHITECTURE)
    report = _parity(path, arch)
    assert 0 < report["drift"] < 1e-2, report  # logprobs came back and the devices agree
    bound = max(NEAR_TIE, TIE_FACTOR * report["drift"])
    for d in report["divergences"]:  # a divergence is a near-tie on the CPU, never a defect
        assert d["chip_token_cpu_gap"] < bound, (d, bound)
    assert report["equal"] >= NUM_PROMPTS - 2, report
