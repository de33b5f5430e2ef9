"""Plain-Python tests of the pools, request state and scheduler, driven by a fake model.

The fake model keeps, per state slot, the tokens it has "seen" (standing in for KV pages +
GDN state) and returns next token = hash of that sequence, so a scheduler that feeds a
request's tokens wrongly (gaps, repeats, stale slot after retraction) changes the output.
"""

from __future__ import annotations

import random

import pytest

from sglang_tpu_backend.managers.io_struct import InvalidRequestError
from sglang_tpu_backend.managers.schedule_batch import ChunkResult, IncrementalDetokenizer, Req
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.managers.scheduler import Scheduler
from sglang_tpu_backend.mem_cache.page_pool import PagePool, pages_for
from sglang_tpu_backend.mem_cache.rank_pools import RankPools
from sglang_tpu_backend.mem_cache.state_pool import StatePool
from sglang_tpu_backend.sampling.sampling_params import SamplingParams

V = 97
EOS = 3


def next_token(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 131 + t + 7) % 1_000_003
    return 10 + h % (V - 10)  # never EOS unless asked


class FakeModel:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.seen: dict[tuple[int, int], list[int]] = {}  # (dp_rank, state slot) -> tokens
        self.steps: list = []

    def run(self, batch) -> list[ChunkResult]:
        self.steps.append(batch)
        used_pages: set[tuple[int, int]] = set()  # (dp_rank, page)
        out = []
        for c in batch.chunks:
            req = c.req
            assert c.start == req.num_computed
            assert len(c.pages) * self.page_size >= c.start + c.num_tokens  # pages cover the KV
            assert c.dp_rank == req.dp_rank
            pages = {(c.dp_rank, p) for p in c.pages}
            assert not used_pages & pages, "two requests share a page"
            used_pages |= pages
            if c.start == 0:
                self.seen[c.dp_rank, c.state_slot] = []
            seen = self.seen[c.dp_rank, c.state_slot]
            assert len(seen) == c.start, "state slot does not hold the request's context"
            seen.extend(req.fill_ids[c.start:c.start + c.num_tokens])
            res = ChunkResult()
            if c.sample:
                res.next_token = next_token(seen)
            if c.logits == "all":
                rows = req.input_logprob_rows(c.start, c.num_tokens)
                res.input_logprobs = [-float(r) for r in rows]
            out.append(res)
        return out


def make_req(rid, prompt, max_new, **sp) -> Req:
    params = SamplingParams.from_dict({"max_new_tokens": max_new, **sp})
    return Req(rid, prompt, params, max_new_tokens=max_new, seed=0, eos_ids=frozenset([EOS]))


def reference(prompt, max_new) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_new):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out


def drive(sched: Scheduler, model: FakeModel, max_steps=10_000):
    finished = []
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            assert sched.is_idle()
            return finished
        for k in range(sched.dp_size):  # per-rank limits
            assert sum(c.num_tokens for c in batch.chunks if c.dp_rank == k) <= sched.max_tokens_per_step
            assert len(sched.running_on(k)) <= sched.max_running_requests
        touched = sched.process_result(batch, model.run(batch))
        finished += [r for r in touched if r.finished]
    raise AssertionError("scheduler did not drain")


def make_sched(num_pages, page_size=4, max_running=8, step_tokens=32, dp_size=1):
    """Pools and limits per rank."""
    pools = RankPools.per_rank(dp_size, num_pages=num_pages, page_size=page_size, num_slots=max_running)
    return Scheduler(pools, max_running_requests=max_running, max_tokens_per_step=step_tokens)


def used(sched, rank=0) -> tuple[int, int]:
    """(KV pages, state slots) in use on one rank."""
    p = sched.pools[rank]
    return p.page_pool.num_used, p.state_pool.num_used


def test_fill_slice_equals_slicing_fill_ids():
    req = Req("r", [1, 2, 3, 4], SamplingParams(), max_new_tokens=8, seed=0)
    req.output_ids = [5, 6, 7]
    for start in range(8):
        for n in range(9):
            assert req.fill_slice(start, n) == req.fill_ids[start:start + n], (start, n)


def test_page_pool_accounting():
    pool = PagePool(8, 16)
    assert pages_for(0, 16) == 0 and pages_for(16, 16) == 1 and pages_for(17, 16) == 2
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_used == 3 and pool.num_free == 5
    assert not pool.can_allocate(6) and pool.can_allocate(5)
    with pytest.raises(RuntimeError):
        pool.allocate(6)
    pool.free(a[:1])
    with pytest.raises(ValueError):
        pool.free(a[:1])  # double free
    pool.free(a[1:])
    assert pool.num_used == 0 and pool.num_free == 8


def test_state_pool_accounting():
    pool = StatePool(2)
    s0, s1 = pool.allocate(), pool.allocate()
    assert {s0, s1} == {0, 1} and not pool.can_allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.free(s0)
    with pytest.raises(ValueError):
        pool.free(s0)
    assert pool.allocate() == s0


def test_all_requests_complete_with_reference_outputs_and_pools_empty():
    rng = random.Random(0)
    sched = make_sched(num_pages=200)
    model = FakeModel(4)
    reqs = []
    for i in range(20):
        prompt = [rng.randrange(10, V) for _ in range(rng.randint(1, 40))]
        reqs.append(make_req(f"r{i}", prompt, rng.randint(1, 12)))
        sched.add_request(reqs[-1])
    done = drive(sched, model)
    assert {r.rid for r in done} == {r.rid for r in reqs}
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, r.max_new_tokens), r.rid
        assert r.finish_reason == {"type": "length", "length": r.max_new_tokens}
    assert used(sched) == (0, 0)
    kinds = {b.kind for b in model.steps}
    assert kinds == {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED}
    for b in model.steps:  # mode labels match content
        dec = [c.start > 0 and c.num_tokens == 1 and c.req.output_ids for c in b.chunks]
        if b.kind == ForwardMode.DECODE:
            assert all(dec)
    # Chunked prefill: a 40-token prompt cannot go in one chunk of a 32-token step.
    assert max(c.num_tokens for b in model.steps for c in b.chunks) <= 32


def test_retraction_keeps_outputs_and_frees_everything():
    rng = random.Random(1)
    sched = make_sched(num_pages=12, page_size=4, max_running=8, step_tokens=16)  # 48 tokens of KV
    model = FakeModel(4)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(10, V) for _ in range(rng.randint(2, 10))]
        reqs.append(make_req(f"r{i}", prompt, rng.randint(8, 20)))
        sched.add_request(reqs[-1])
    drive(sched, model)
    assert sched.num_retracted_total > 0
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, r.max_new_tokens), r.rid
    assert used(sched) == (0, 0)


def test_max_running_and_abort_frees_at_once():
    sched = make_sched(num_pages=100, max_running=2)
    model = FakeModel(4)
    reqs = [make_req(f"r{i}", [11, 12, 13], 50) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    batch = sched.schedule()
    assert len(batch.chunks) == 2 and sched.num_waiting == 2
    sched.process_result(batch, model.run(batch))
    assert sched.abort("r0") is reqs[0] and reqs[0].finish_reason["type"] == "abort"
    assert sched.abort("r3") is reqs[3]  # from the queue
    assert sched.abort("nope") is None
    assert used(sched) == (1, 1)
    drive(sched, model)
    assert reqs[1].output_ids == reference([11, 12, 13], 50)
    assert used(sched) == (0, 0)


def test_abort_while_step_in_flight_drops_its_result():
    sched = make_sched(num_pages=100)
    model = FakeModel(4)
    req = make_req("a", [11, 12], 5)
    sched.add_request(req)
    batch = sched.schedule()
    results = model.run(batch)
    sched.abort("a")
    assert sched.process_result(batch, results) == [] and req.output_ids == []
    assert used(sched) == (0, 0) and sched.is_idle()


def test_finish_on_eos_stop_ids_min_new_and_ignore_eos():
    r = make_req("x", [11], 10)
    r.output_ids = [20, EOS]
    r.check_token_finish()
    assert r.finish_reason == {"type": "stop", "matched": EOS}
    r = make_req("x", [11], 10, ignore_eos=True)
    r.output_ids = [EOS]
    r.check_token_finish()
    assert r.finish_reason is None
    r = make_req("x", [11], 10, stop_token_ids=[42])
    r.output_ids = [42]
    r.check_token_finish()
    assert r.finish_reason == {"type": "stop", "matched": 42}
    r = make_req("x", [11], 2)
    r.output_ids = [20, 21]
    r.check_token_finish()
    assert r.finish_reason == {"type": "length", "length": 2}
    r = make_req("x", [11, 12, 13], 100)
    r.context_length = 5
    r.output_ids = [20, 21]
    r.check_token_finish()
    assert r.finish_reason == {"type": "length", "length": 2}


def test_stop_strings_trim_and_hold_back():
    vocab = {20: "Hel", 21: "lo W", 22: "orld", 23: "!!"}
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    params = SamplingParams.from_dict({"stop": ["o Wor", "zzz"]})
    r = Req("s", [1], params, max_new_tokens=10, seed=0, decode=decode)
    r.output_ids = [20]
    r.update_text()
    assert r.text == "Hel" and not r.finished
    r.output_ids = [20, 21]
    r.update_text()
    assert r.text == "Hell" and not r.finished  # "o W" may start "o Wor": held back
    r.output_ids = [20, 21, 22]
    r.update_text()
    assert r.finish_reason == {"type": "stop", "matched": "o Wor"} and r.text == "Hell"


def _reference_stop_text(pieces: list[str], stops: list[str]) -> list[tuple[str, str | None]]:
    """(visible text, matched stop) after each piece, searching the whole text every time:
    the earliest occurrence wins (then the smallest string); a tail that begins a stop string
    is held back."""
    out, text = [], ""
    for piece in pieces:
        text += piece
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            out.append((text[:i], s))
            return out
        k = next((k for k in range(min(len(text), max(map(len, stops)) - 1), 0, -1)
                  if any(s.startswith(text[-k:]) for s in stops)), 0)
        out.append((text[:len(text) - k], None))
    return out


def _run_stop_req(pieces: list[str], stops: list[str]) -> list[tuple[str, str | None]]:
    vocab = dict(enumerate(pieces, start=100))
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    r = Req("s", [1], SamplingParams.from_dict({"stop": stops}), max_new_tokens=10**6, seed=0, decode=decode)
    out = []
    for t in vocab:
        r.output_ids.append(t)
        r.update_text()
        out.append((r.text, r.finish_reason["matched"] if r.finished else None))
        if r.finished:
            break
    return out


def test_stop_string_spanning_several_tokens():
    pieces = ["The", " end", " is", " n", "e", "ar", " here", "!"]
    got = _run_stop_req(pieces, ["is near", "end is nigh"])
    assert got == _reference_stop_text(pieces, ["is near", "end is nigh"])
    # "e", "end", ..., "end is n" may begin "end is nigh": held back until "e" rules that out;
    # then "is ne" may begin "is near", which the next token completes over four tokens
    assert got == [("Th", None), ("The ", None), ("The ", None), ("The ", None), ("The end ", None),
                   ("The end ", "is near")]


def test_many_stop_strings_match_like_a_full_search():
    """The tail-only search (held-back tail + new text) finds what a search of the whole text
    finds, over random texts and the maximum number of overlapping stop strings."""
    from sglang_tpu_backend.sampling.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS

    rng = random.Random(0)
    for trial in range(200):
        alphabet = "ab" if trial % 2 else "abc "
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
                      for _ in range(MAX_STOP_STRINGS)})
        if trial % 50 == 0:
            stops[0] = "a" * (MAX_STOP_STRING_LEN - 1) + "b"  # long prefix held back, then matched
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(80)]
        if trial % 50 == 0:
            pieces = ["a" * 7] * 40 + ["b"] + pieces
        assert _run_stop_req(pieces, stops) == _reference_stop_text(pieces, stops), (stops, pieces)


def test_incremental_detokenizer_matches_full_decode_and_holds_partial_utf8():
    pieces = {1: b"a", 2: b"\xe2\x82", 3: b"\xac", 4: b" b"}
    decode = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")  # noqa: E731
    d = IncrementalDetokenizer(decode)
    ids = []
    for t in [1, 2, 3, 4]:
        ids.append(t)
        d.step(ids)
        assert "\ufffd" not in d.text
    assert d.text == decode(ids) == "a\u20ac b"


def test_a_run_is_detokenised_once_unless_a_stop_string_may_end_it():
    """A multi-step launch appends N tokens per request: without stop strings the text is
    decoded once for the run (2 decode calls, not 2N), and equals the token-by-token text,
    a split UTF-8 sequence included; with a stop string each token is checked, and the run
    ends at the token that completes it."""
    pieces = {1: b"a", 2: b"\xe2\x82", 3: b"\xac", 4: b" b", 5: b"c", 6: b" d", 7: b"e", 8: b"f"}
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    run = [(t, 0.0, None) for t in pieces]
    r = Req("r", [9], SamplingParams.from_dict({}), max_new_tokens=100, seed=0, decode=decode)
    assert Scheduler._append_tokens(r, run, 0.0) == 8
    assert len(calls) == 2 and r.text == "a\u20ac bc def" and not r.finished
    one = Req("o", [9], SamplingParams.from_dict({}), max_new_tokens=100, seed=0, decode=decode)
    for tok in run:
        Scheduler._append_tokens(one, [tok], 0.0)
    assert one.text == r.text
    calls.clear()
    s = Req("s", [9], SamplingParams.from_dict({"stop": [" b"]}), max_new_tokens=100, seed=0,
            decode=decode)
    assert Scheduler._append_tokens(s, run, 0.0) == 4  # the token completing " b"
    assert s.output_ids == [1, 2, 3, 4] and s.finish_reason == {"type": "stop", "matched": " b"}
    assert s.text == "a\u20ac" and len(calls) >= 2 * 4


def test_prompt_logprob_rows_and_row_budget():
    sched = make_sched(num_pages=100, max_running=4, step_tokens=64)
    model = FakeModel(4)
    prompt = list(range(10, 30))  # 20 tokens, logprobs from position 2
    req = make_req("lp", prompt, 1)
    req.return_logprob, req.logprob_start_len = True, 2
    sched.add_request(req)
    drive(sched, model)
    # Rows 2..18 (row i predicts prompt token i+1), delivered in chunks of <= 4 rows.
    assert req.input_logprobs == [-float(i) for i in range(2, 19)]
    assert max(c.num_tokens for b in model.steps for c in b.chunks if c.logits == "all") <= 4
    assert req.output_ids == reference(prompt, 1)


def test_prompt_only_request_finishes_after_prefill():
    sched = make_sched(num_pages=100)
    model = FakeModel(4)
    req = make_req("p", [11, 12, 13], 0)
    sched.add_request(req)
    drive(sched, model)
    assert req.output_ids == [] and req.finish_reason == {"type": "length", "length": 0}
    assert used(sched) == (0, 0)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("min_p", 2.0),
    ("max_new_tokens", -1), ("repetition_penalty", 0.0), ("frequency_penalty", 3.0),
    ("stop", [""]), ("stop_token_ids", [10_000]),
])
def test_sampling_params_validation_names_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({field: value}).validate(vocab_size=1000)
    assert e.value.field == f"sampling_params.{field}"


def test_sampling_params_nulls_types_and_unknown_keys():
    sp = SamplingParams.from_dict({"temperature": None, "top_k": None, "stop": "x", "max_new_tokens": None})
    assert sp.temperature == 1.0 and sp.top_k == -1 and sp.stop == ["x"] and sp.max_new_tokens is None
    sp.validate(1000)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"temprature": 1.0})
    assert e.value.field == "sampling_params.temprature"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"max_new_tokens": "5"})
    assert e.value.field == "sampling_params.max_new_tokens"
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({"regex": "a", "json_schema": "{}"}).validate()


# Data-parallel attention ranks ---------------------------------------------------------------
def placements(sched) -> dict[str, int]:
    return {r.rid: r.dp_rank for r in sched.running}


def test_dp_placement_balances_load_ties_to_lowest_rank():
    sched = make_sched(num_pages=100, dp_size=4, max_running=4, step_tokens=64)
    lens = {"a": 30, "b": 5, "c": 5, "d": 5, "e": 5, "f": 5, "g": 20}
    for rid, n in lens.items():
        sched.add_request(make_req(rid, [11] * n, 4))
    batch = sched.schedule()
    # a..d fill the empty ranks in order; then the least-loaded rank (ties: lowest) takes the next.
    assert placements(sched) == {"a": 0, "b": 1, "c": 2, "d": 3, "e": 1, "f": 2, "g": 3}
    assert {c.req.rid: c.dp_rank for c in batch.chunks} == placements(sched)
    assert sched.num_admitted_per_rank == [1, 2, 2, 2]


def test_dp_rank_at_running_limit_is_skipped():
    sched = make_sched(num_pages=100, dp_size=2, max_running=2, step_tokens=64)
    for rid, n in [("a", 1), ("b", 40), ("c", 1), ("d", 1), ("e", 1)]:
        sched.add_request(make_req(rid, [11] * n, 4))
    sched.schedule()
    # Rank 0 is far less loaded, but after a and c it holds its 2 running requests.
    assert placements(sched) == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert [r.rid for r in sched.waiting] == ["e"]


def test_dp_token_budget_is_per_rank():
    sched = make_sched(num_pages=100, dp_size=2, max_running=4, step_tokens=16)
    for rid in "abc":
        sched.add_request(make_req(rid, [11] * 16, 2))
    batch = sched.schedule()
    # Each rank's step holds 16 token rows: a fills rank 0, b rank 1, c waits.
    assert [(c.req.rid, c.dp_rank, c.num_tokens) for c in batch.chunks] == [("a", 0, 16), ("b", 1, 16)]
    assert sched.num_waiting == 1


def test_dp_idle_ranks_get_nothing():
    sched = make_sched(num_pages=100, dp_size=4)
    model = FakeModel(4)
    reqs = [make_req(f"r{i}", [11, 12 + i], 3) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, model)
    assert sched.num_admitted_per_rank == [1, 1, 0, 0]
    assert all({c.dp_rank for c in b.chunks} <= {0, 1} for b in model.steps)
    assert all(used(sched, k) == (0, 0) for k in range(4))


def test_dp_abort_frees_only_its_ranks_pools():
    sched = make_sched(num_pages=100, dp_size=2)
    model = FakeModel(4)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", [11] * (5 + i), 20))
    batch = sched.schedule()
    sched.process_result(batch, model.run(batch))
    victim = next(r for r in sched.running if r.dp_rank == 1)
    before = [used(sched, k) for k in range(2)]
    n_pages = len(victim.pages)
    assert sched.abort(victim.rid) is victim
    assert used(sched, 0) == before[0]
    assert used(sched, 1) == (before[1][0] - n_pages, before[1][1] - 1)
    drive(sched, model)
    assert all(used(sched, k) == (0, 0) for k in range(2))


def test_dp_retraction_frees_only_its_ranks_pools_and_keeps_outputs():
    rng = random.Random(3)
    sched = make_sched(num_pages=8, page_size=4, max_running=4, step_tokens=16, dp_size=3)
    model = FakeModel(4)
    retractions = []
    real_retract = sched._retract

    def recording_retract(req):
        rank, before = req.dp_rank, [used(sched, k) for k in range(3)]
        real_retract(req)
        after = [used(sched, k) for k in range(3)]
        retractions.append((rank, before, after))

    sched._retract = recording_retract
    reqs = [make_req(f"r{i}", [rng.randrange(10, V) for _ in range(rng.randint(2, 10))],
                     rng.randint(8, 20)) for i in range(15)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, model)
    assert retractions
    for rank, before, after in retractions:
        for k in range(3):
            if k == rank:
                assert after[k][0] <= before[k][0] and after[k][1] == before[k][1] - 1
            else:
                assert after[k] == before[k]
    for r in reqs:
        assert r.output_ids == reference(r.prompt_ids, r.max_new_tokens), r.rid
    assert min(sched.num_admitted_per_rank) > 0
    assert all(used(sched, k) == (0, 0) for k in range(3))
