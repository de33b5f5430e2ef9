"""``--mem-fraction-static``: the KV pool is what F * device memory leaves after the weights
and static buffers, with the byte counts checked against real arrays (loaded params, an
allocated cache) rather than against the formulas themselves."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from sglang_tpu_backend.config import load_model_config  # noqa: E402
from sglang_tpu_backend.model_loader.tiny_model import default_model_path  # noqa: E402
from sglang_tpu_backend.planning.mem_budget import device_memory_bytes, size_pools  # noqa: E402
from sglang_tpu_backend.planning.plan import step_activation_bytes  # noqa: E402
from sglang_tpu_backend.server_args import ServerArgs  # noqa: E402

ARGS = dict(dtype="float32", page_size=16, max_running_requests=4, chunked_prefill_size=64,
            context_length=128, skip_warmup=True)


@pytest.fixture(scope="module")
def measured():
    """cfg, and byte counts from real arrays: loaded f32 weights, one KV page, one GDN slot."""
    from sglang_tpu_backend.model_loader.loader import load_params
    from sglang_tpu_backend.models.qwen3_5_moe import init_cache

    path = default_model_path()
    cfg = load_model_config(path)
    params = load_params(path, cfg, dtype=jnp.float32)
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    one = init_cache(cfg, num_pages=1, page_size=16, num_state_slots=1, kv_dtype=jnp.float32)
    two = init_cache(cfg, num_pages=2, page_size=16, num_state_slots=2, kv_dtype=jnp.float32)
    page = two.kv_pages.nbytes - one.kv_pages.nbytes
    slot = (two.conv_state.nbytes + two.rec_state.nbytes) - (one.conv_state.nbytes + one.rec_state.nbytes)
    return cfg, weights, page, slot


def static_bytes(cfg, slot: int, r: int, snapshots: int) -> int:
    """Everything but weights and KV pages for r running requests (the module docstring's list)."""
    V = cfg.vocab_size
    return ((r + snapshots) * slot + r * (5 * V + 4)
            + step_activation_bytes(cfg, ep=1, tp=1, tokens=64, dtype_bytes=4) + 4 * r * V)


def test_pages_follow_the_formula(measured):
    cfg, weights, page, slot = measured
    D, F = 64 << 20, 0.5
    got = size_pools(cfg, ServerArgs(**ARGS, mem_fraction_static=F), D)
    assert got.weights == weights and got.page_bytes == page
    expected = (int(F * D) - weights - static_bytes(cfg, slot, 4, 4)) // page
    assert got.num_pages_per_rank == expected > 4
    assert got.max_running_requests_per_rank == 4


def test_nextn_counts_the_mtp_weights_and_pages(measured):
    """With NEXTN the weights include the loaded MTP params and a page the MTP layer's KV."""
    from sglang_tpu_backend.model_loader.loader import load_mtp_params
    from sglang_tpu_backend.models.mtp import init_mtp_cache

    cfg, weights, page, _ = measured
    mtp = load_mtp_params(default_model_path(), cfg, dtype=jnp.float32)
    mtp_weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(mtp))
    mtp_page = (init_mtp_cache(cfg, num_pages=2, page_size=16, kv_dtype=jnp.float32).nbytes
                - init_mtp_cache(cfg, num_pages=1, page_size=16, kv_dtype=jnp.float32).nbytes)
    got = size_pools(cfg, ServerArgs(**ARGS, mem_fraction_static=0.5,
                                     speculative_algorithm="NEXTN"), 64 << 20)
    assert mtp_weights > 0 and got.weights == weights + mtp_weights
    assert mtp_page > 0 and got.page_bytes == page + mtp_page


def test_doubling_the_free_part_doubles_the_pages(measured):
    cfg, weights, page, slot = measured
    fixed = weights + static_bytes(cfg, slot, 4, 4)
    free = 300 * page + page // 3
    one = size_pools(cfg, ServerArgs(**ARGS, mem_fraction_static=0.5), 2 * (fixed + free))
    two = size_pools(cfg, ServerArgs(**ARGS, mem_fraction_static=0.5), 2 * (fixed + 2 * free))
    assert one.num_pages_per_rank == 300
    assert abs(two.num_pages_per_rank - 2 * one.num_pages_per_rank) <= 1


def test_running_requests_shrink_to_fit_then_error(measured, caplog):
    cfg, weights, page, slot = measured
    # Room for 2 running requests (and 2 snapshots) with 2 pages, not for 4 with 4 pages.
    D = weights + static_bytes(cfg, slot, 2, 2) + 2 * page
    with caplog.at_level(logging.WARNING, logger="sglang_tpu_backend.planning.mem_budget"):
        got = size_pools(cfg, ServerArgs(**ARGS, mem_fraction_static=1.0), D)
    assert got.max_running_requests_per_rank == 2 and got.num_pages_per_rank == 2
    assert "reduced 4 -> 2" in caplog.text
    with pytest.raises(ValueError, match="--mem-fraction-static 0.01 .* no room for one request"):
        size_pools(cfg, ServerArgs(**ARGS, mem_fraction_static=0.01), D)


def test_device_memory_needs_a_budget_on_cpu():
    if jax.devices()[0].memory_stats():
        pytest.skip("this device reports its memory")
    with pytest.raises(ValueError, match="--device-memory-bytes"):
        device_memory_bytes(ServerArgs(mem_fraction_static=0.5))
    assert device_memory_bytes(ServerArgs(mem_fraction_static=0.5, device_memory_bytes=123)) == 123


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True])
def test_fraction_validated(bad):
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        ServerArgs(mem_fraction_static=bad)


def test_engine_sizes_its_pool_and_reports_it(measured):
    from sglang_tpu_backend.engine import Engine

    cfg, weights, page, slot = measured
    D = 2 * (weights + static_bytes(cfg, slot, 4, 4) + 40 * page)
    eng = Engine(ServerArgs(**ARGS, mem_fraction_static=0.5, device_memory_bytes=D), start_loop=False)
    try:
        info = eng.get_server_info()
        assert info["num_pages"] == 40 == eng.runner.cache.kv_pages.shape[1]
        assert info["max_total_tokens"] == 40 * 16 and info["kv_pages_total"] == 40
        assert info["mem_budget"]["num_pages_per_rank"] == 40
        assert info["mem_budget"]["weights"] == weights
        # --max-total-tokens caps the pool
        capped = Engine(ServerArgs(**ARGS, mem_fraction_static=0.5, device_memory_bytes=D,
                                   max_total_tokens=10 * 16), start_loop=False)
        assert capped.get_server_info()["num_pages"] == 10
        capped.shutdown()
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        Engine(ServerArgs(**ARGS, mem_fraction_static=0.5, device_memory_bytes=weights),
               start_loop=False)


def test_page_size_defaults_per_backend_and_an_explicit_one_is_kept():
    """``--page-size`` unset: 128-token pages on a TPU (the decode kernel DMAs a page at a
    time), 16 elsewhere, resolved with the other sizes; a given one is kept on both; a bad
    one is refused naming the flag."""
    from sglang_tpu_backend.planning.mem_budget import size_serving_args
    from sglang_tpu_backend.server_args import CPU_PAGE_SIZE, TPU_PAGE_SIZE

    cfg = load_model_config(default_model_path())
    unset = ServerArgs(max_running_requests=4, context_length=128)
    assert unset.page_size is None
    assert size_serving_args(unset, cfg, "tpu")[0].page_size == TPU_PAGE_SIZE == 128
    assert size_serving_args(unset, cfg, "cpu")[0].page_size == CPU_PAGE_SIZE == 16
    for backend in ("tpu", "cpu"):
        assert size_serving_args(ServerArgs(page_size=32), cfg, backend)[0].page_size == 32
    with pytest.raises(ValueError, match="--page-size must be a positive integer"):
        ServerArgs(page_size=0)
