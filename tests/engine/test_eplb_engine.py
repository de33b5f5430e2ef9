"""EPLB while serving (one device, 16 experts in 24 physical slots, a rebalance every 3
steps): concurrent requests all finish with the shared engine's greedy tokens, the
rebalances between steps compile nothing after warm-up, and the recorded loads (also those of
the shared engine, without EPLB) come out as a load file that ``--init-expert-location``
reads."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from tests.engine.conftest import ENGINE_ARGS

SAMPLING = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def eplb_engine():
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    args = {**ENGINE_ARGS, "max_running_requests": 8, "skip_warmup": False,
            "ep_num_redundant_experts": 8, "enable_eplb": True,
            "eplb_rebalance_num_iterations": 3}
    eng = Engine(ServerArgs(**args))
    yield eng
    eng.shutdown()


def _prompts(n=10, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def _generate_all(engine, prompts):
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput

    async def one(ids):
        obj = GenerateReqInput(input_ids=ids, sampling_params=dict(SAMPLING))
        return [x async for x in engine.generate_request(obj)][-1]

    async def run():
        return await asyncio.gather(*(one(ids) for ids in prompts))

    return asyncio.run(run())


def test_rebalance_while_serving_loses_nothing_and_compiles_nothing(eplb_engine, engine):
    from sglang_tpu_backend.model_executor.compile_cache import CompileCounter

    balancer = eplb_engine.runner.balancer
    assert balancer.location.num_physical == 24 and balancer.num_rebalances == 0
    prompts = _prompts()
    counter = CompileCounter()
    outs = _generate_all(eplb_engine, prompts)
    assert counter.lowerings == 0, f"{counter.lowerings} programs lowered while rebalancing"
    assert balancer.num_rebalances >= 2
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    reference = _generate_all(engine, prompts)  # the shared engine: no EPLB
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in reference]


def test_recorded_loads_round_trip_as_a_load_file(eplb_engine, engine, tmp_path):
    """Every real row is routed to top-k experts once per MoE layer: the dumped loads grow by
    K x (prompt rows + one row per decode step) in every layer, on the EPLB engine (whose
    slots are rebalanced meanwhile) and on the shared one (no EPLB: logical experts)."""
    from sglang_tpu_backend.model_executor.expert_location import moe_layers
    from sglang_tpu_backend.parallel.eplb import read_load_file

    cfg = eplb_engine.model_config

    def dumped(eng):
        path = eng.dump_expert_distribution_record(str(tmp_path / "records"))
        return read_load_file(path, cfg.num_experts, moe_layers(cfg))

    prompts = _prompts(3, seed=4)
    rows = sum(len(p) + SAMPLING["max_new_tokens"] - 1 for p in prompts)
    assert not engine.runner.balancer.stores_physical
    for eng in (eplb_engine, engine):
        before = dumped(eng).sum(axis=1)
        _generate_all(eng, prompts)
        np.testing.assert_allclose(dumped(eng).sum(axis=1) - before,
                                   rows * cfg.num_experts_per_tok)


def test_expert_distribution_record_starts_and_stops(engine, tmp_path):
    """SGLang's start / stop / dump: a start drops the record, rows count until the stop."""
    from sglang_tpu_backend.model_executor.expert_location import moe_layers
    from sglang_tpu_backend.parallel.eplb import read_load_file

    cfg = engine.model_config

    def dumped():
        path = engine.dump_expert_distribution_record(str(tmp_path))
        return read_load_file(path, cfg.num_experts, moe_layers(cfg)).sum(axis=1)

    prompts = _prompts(2, seed=5)
    rows = sum(len(p) + SAMPLING["max_new_tokens"] - 1 for p in prompts)
    try:
        engine.start_expert_distribution_record()
        assert not dumped().any()
        _generate_all(engine, prompts)
        np.testing.assert_allclose(dumped(), rows * cfg.num_experts_per_tok)
        engine.stop_expert_distribution_record()
        _generate_all(engine, prompts)
        np.testing.assert_allclose(dumped(), rows * cfg.num_experts_per_tok)
    finally:
        engine.start_expert_distribution_record()  # the shared engine records again
