"""The scheduler with the prefix cache, driven by a fake model that checks what it is fed.

The fake model stores the token of every KV position in its page (per DP rank) and, per
state slot and per GDN snapshot, the tokens folded into that state. Each chunk must find its
pages holding exactly ``fill_ids[:start]`` (shared cached pages included) and its slot
holding the state of exactly those tokens (restored from a snapshot when it starts after a
cached prefix); a save must capture exactly ``prompt[:num_tokens]``. The next token is a
hash of the state, so any mistake changes the outputs, which must equal the cache-less
reference. Plain Python, fast.
"""

from __future__ import annotations

import random

from sglang_tpu_backend.managers.prefix_cache import PrefixCache
from sglang_tpu_backend.managers.scheduler import Scheduler
from sglang_tpu_backend.mem_cache.radix_cache import RadixCache, SnapshotPool
from sglang_tpu_backend.mem_cache.rank_pools import RankPools
from tests.engine.test_scheduler import make_req, next_token, reference

PAGE = 4


def random_ids(seed: int, n: int, lo: int, hi: int) -> list[int]:
    """``n`` token ids drawn uniformly from ``[lo, hi)`` by one seeded generator."""
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]


class CheckingModel:
    def __init__(self):
        self.kv: dict[tuple[int, int], list] = {}  # (rank, page) -> token per position
        self.slots: dict[tuple[int, int], list[int]] = {}  # (rank, slot) -> tokens in the state
        self.snaps: dict[tuple[int, int], list[int]] = {}  # (rank, snapshot) -> tokens
        self.prefill_tokens = 0

    def run(self, batch):
        from sglang_tpu_backend.managers.schedule_batch import ChunkResult

        for ld in batch.state_loads:
            self.slots[ld.rank, ld.slot] = list(self.snaps[ld.rank, ld.snapshot])
        written: set[tuple[int, int]] = set()
        out = []
        for c in batch.chunks:
            req, fill = c.req, c.req.fill_ids
            if req.finished:  # aborted after scheduling: its result is dropped
                out.append(ChunkResult())
                continue
            assert c.start == req.num_computed and c.dp_rank == req.dp_rank
            if c.start == 0:
                self.slots[c.dp_rank, c.state_slot] = []
            state = self.slots[c.dp_rank, c.state_slot]
            assert state == fill[:c.start], "state slot does not hold the request's context"
            for pos in range(c.start):  # every context token is in the request's pages
                assert self.kv[c.dp_rank, c.pages[pos // PAGE]][pos % PAGE] == fill[pos], pos
            for pos in range(c.start, c.start + c.num_tokens):
                key = (c.dp_rank, c.pages[pos // PAGE])
                assert key not in written or pos % PAGE, "two requests write one page"
                written.add(key)
                self.kv.setdefault(key, [None] * PAGE)[pos % PAGE] = fill[pos]
            state.extend(fill[c.start:c.start + c.num_tokens])
            if not req.is_decode_ready or c.num_tokens > 1:
                self.prefill_tokens += c.num_tokens
            res = ChunkResult()
            if c.sample:
                res.next_token = next_token(state)
            out.append(res)
        for sv in batch.state_saves:
            tokens = self.slots[sv.rank, sv.slot]
            assert len(tokens) == sv.num_tokens and tokens == sv.req.prompt_ids[:sv.num_tokens]
            self.snaps[sv.rank, sv.snapshot] = list(tokens)
        return out


def make_sched(num_pages, num_snapshots=16, max_running=8, step_tokens=32, dp_size=1, cache=True):
    pools = RankPools.per_rank(dp_size, num_pages=num_pages, page_size=PAGE, num_slots=max_running)
    prefix = PrefixCache([RadixCache(p.page_pool, SnapshotPool(num_snapshots)) for p in pools]) if cache else None
    return Scheduler(pools, max_running_requests=max_running, max_tokens_per_step=step_tokens,
                     prefix=prefix)


def drive(sched, model, max_steps=20_000):
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            assert sched.is_idle()
            return
        sched.process_result(batch, model.run(batch))
    raise AssertionError("scheduler did not drain")


def assert_idle_pools(sched):
    """Requests hold nothing; after a flush the tree holds nothing either."""
    for k, p in enumerate(sched.pools):
        cache = sched.prefix.caches[k]
        assert p.state_pool.num_used == 0
        assert p.page_pool.num_used == cache.num_cached_pages == cache.num_evictable_pages
    sched.prefix.flush()
    for k, p in enumerate(sched.pools):
        assert p.page_pool.num_used == 0 and sched.prefix.caches[k].snapshot_pool.num_used == 0


def shared_prompts(rng, n):
    base = [rng.randrange(10, 90) for _ in range(64)]
    out = []
    for _ in range(n):
        k = rng.choice([0, 3, 4, 5, 8, 16, 17, 31, 32, 40, 64])
        out.append(base[:k] + [rng.randrange(10, 90) for _ in range(rng.randint(0 if k else 1, 9))])
    return out


def test_shared_prefixes_give_reference_outputs_and_reuse_pages():
    rng = random.Random(1)
    prompts = shared_prompts(rng, 40)
    sched, model = make_sched(num_pages=200), CheckingModel()
    reqs = []
    for wave in range(4):  # later waves find earlier prompts cached
        batch = [make_req(f"r{wave}-{i}", p, rng.randint(1, 6)) for i, p in enumerate(prompts[wave::4])]
        for r in batch:
            sched.add_request(r)
        reqs += batch
        drive(sched, model)
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, r.max_new_tokens), r.rid
    cached = sum(r.cached_tokens for r in reqs)
    assert cached > 200 and model.prefill_tokens + cached == sum(len(r.prompt_ids) for r in reqs)
    assert sched.num_cached_tokens_total == cached
    assert_idle_pools(sched)


def test_small_pools_evict_and_retract_and_stay_exact():
    rng = random.Random(2)
    prompts = shared_prompts(rng, 30)
    sched, model = make_sched(num_pages=24, num_snapshots=3, max_running=6), CheckingModel()
    reqs = [make_req(f"r{i}", p, rng.randint(4, 20)) for i, p in enumerate(prompts)]
    for i, r in enumerate(reqs):
        sched.add_request(r)
        if i % 3 == 2:
            for _ in range(3):  # interleave arrivals with steps
                batch = sched.schedule()
                if batch is not None:
                    sched.process_result(batch, model.run(batch))
    drive(sched, model)
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, r.max_new_tokens), r.rid
    assert sched.num_retracted_total > 0
    assert sched.prefix.caches[0].num_evicted_pages > 0 and sum(r.cached_tokens for r in reqs) > 0
    assert_idle_pools(sched)


def test_same_prompt_eight_times_is_prefilled_once():
    prompt = random_ids(3, 50, 10, 90)
    sched, model = make_sched(num_pages=200, step_tokens=16), CheckingModel()
    reqs = [make_req(f"s{i}", prompt, 3) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, model)
    last = (50 - 1) // PAGE * PAGE  # 48: the deepest snapshot point
    assert sorted(r.cached_tokens for r in reqs) == [0] + [last] * 7
    assert model.prefill_tokens == 50 + 7 * (50 - last)
    assert all(r.output_ids == reference(prompt, 3) for r in reqs)
    assert_idle_pools(sched)


def test_abort_and_flush_while_running_free_everything():
    rng = random.Random(4)
    prompt = [rng.randrange(10, 90) for _ in range(30)]
    sched, model = make_sched(num_pages=100, step_tokens=8), CheckingModel()
    first = make_req("a", prompt, 2)
    sched.add_request(first)
    drive(sched, model)
    reqs = [make_req(f"b{i}", prompt + [i + 10] * 5, 30) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):
        sched.process_result(b := sched.schedule(), model.run(b))
    assert all(r.cached_tokens == 28 for r in reqs)  # (30 - 1) // 4 * 4 of the cached prompt
    sched.prefix.flush()  # in-use nodes are detached, freed on release
    assert sched.prefix.caches[0].match_prefix(prompt, 28).length == 0
    sched.abort("b0")
    batch = sched.schedule()
    sched.abort("b1")  # aborted while its step runs
    sched.process_result(batch, model.run(batch))
    drive(sched, model)
    for r in reqs[2:]:
        assert r.output_ids == reference(r.prompt_ids, 30)
    assert_idle_pools(sched)


def test_prompt_logprob_rows_are_never_taken_from_the_cache():
    prompt = random_ids(5, 40, 10, 90)
    sched, model = make_sched(num_pages=100), CheckingModel()
    sched.add_request(make_req("warm", prompt, 1))
    drive(sched, model)  # chunks 0-32, 32-36, 36-40: snapshots at 32 and 36
    got = {}
    for start in (10, 34, 39):
        r = make_req(f"lp{start}", prompt, 1)
        r.return_logprob, r.logprob_start_len = True, start
        sched.add_request(r)
        drive(sched, model)
        got[start] = r.cached_tokens
    assert got == {10: 0, 34: 32, 39: 36}  # never past the first row asked for
    assert_idle_pools(sched)


def test_dp_ranks_have_separate_caches():
    prompt = random_ids(6, 20, 10, 90)
    sched, model = make_sched(num_pages=50, dp_size=2), CheckingModel()
    a = make_req("a", prompt, 2)
    sched.add_request(a)
    drive(sched, model)
    b, c = make_req("b", prompt, 2), make_req("c", [11] * 20, 2)
    sched.add_request(b)
    sched.add_request(c)
    drive(sched, model)
    assert b.cached_tokens == 16 and c.cached_tokens == 0
    assert sched.num_admitted_per_rank == [2, 1] or sched.num_admitted_per_rank == [1, 2]
    assert b.output_ids == a.output_ids == reference(prompt, 2)
    assert_idle_pools(sched)


def test_disabled_cache_keeps_old_behaviour():
    prompt = [7] * 20
    sched, model = make_sched(num_pages=50, cache=False), CheckingModel()
    reqs = [make_req(f"r{i}", prompt, 2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, model)
    assert model.prefill_tokens == 60 and all(r.cached_tokens == 0 for r in reqs)
    assert all(p.page_pool.num_used == 0 for p in sched.pools)


def test_failed_step_gives_its_snapshot_ids_back():
    sched = make_sched(num_pages=50, step_tokens=8)
    sched.add_request(make_req("a", random_ids(7, 20, 10, 90), 2))
    batch = sched.schedule()
    assert [s.num_tokens for s in batch.state_saves] == [8]
    sched.prefix.discard(batch.state_saves)  # what the engine does when the step raises
    sched.abort("a")
    assert sched.prefix.caches[0].snapshot_pool.num_used == 0
    assert_idle_pools(sched)


def test_few_snapshots_still_cover_the_prompts_last_point():
    prompt = random_ids(8, 60, 10, 90)
    sched, model = make_sched(num_pages=100, num_snapshots=2, step_tokens=8), CheckingModel()
    reqs = [make_req(f"s{i}", prompt, 2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, model)  # 7 chunk ends inside the prompt, 2 snapshots
    assert sorted(r.cached_tokens for r in reqs) == [0, 56, 56]
    assert_idle_pools(sched)
