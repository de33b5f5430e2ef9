"""One tiny-model Engine shared by the engine test modules (compiles once per shape)."""

from __future__ import annotations

import contextlib
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

ENGINE_ARGS = dict(max_running_requests=64, chunked_prefill_size=64, context_length=128,
                   page_size=16, dtype="float32", skip_warmup=True, random_seed=0)


@pytest.fixture(scope="session")
def engine():
    yield from serving(ENGINE_ARGS)


def serving(args: dict):
    """An engine of ``args`` (ServerArgs fields) for a fixture to yield; shut down after."""
    from sglang_tpu_backend.engine import Engine
    from sglang_tpu_backend.server_args import ServerArgs

    eng = Engine(ServerArgs(**args))
    yield eng
    eng.shutdown()


def wait_pools_empty(engine, timeout=10.0) -> dict:
    """Pool stats once nothing is allocated (abort frees synchronously; this allows a step to end)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.pool_stats()
        if (s["kv_pages_used"] == 0 and s["state_slots_used"] == 0 and s["num_running"] == 0
                and s["num_queued"] == 0) or time.monotonic() > deadline:
            return s


@pytest.fixture
def clean_engine(engine):
    """The shared engine; asserts the pools are empty after the test."""
    yield from drained(engine)


def drained(engine):
    """Yields ``engine``, then asserts its pools are empty (a ``clean_*`` fixture's body)."""
    yield engine
    s = wait_pools_empty(engine)
    assert s["kv_pages_used"] == 0 and s["state_slots_used"] == 0, s


@contextlib.contextmanager
def small_page_pool(engine, num_pages: int):
    """Serve from a ``num_pages`` KV page pool (rank 0) inside the block, to force retractions.

    The prefix cache's tree owns pages of the pool in use, so it is flushed before the swap and
    pointed at the small pool; on exit the small pool is flushed and must be empty (nothing
    leaked), then the engine's own pool comes back. Yields the small pool.
    """
    from sglang_tpu_backend.mem_cache.page_pool import PagePool

    pools = engine.scheduler.pools[0]
    big, small = pools.page_pool, PagePool(num_pages, engine.args.page_size)
    cache = engine.scheduler.prefix.caches[0] if engine.scheduler.prefix else None

    def use(pool):
        with engine.loop.lock:
            pools.page_pool = pool
            if cache is not None:
                cache.page_pool = pool

    engine.flush_cache()
    use(small)
    try:
        yield small
        engine.flush_cache()
        assert small.num_used == 0
    finally:
        use(big)
