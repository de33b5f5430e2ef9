"""The request routers' decisions (``ray_app/routing.py``), without a cluster: prefix keys,
rendezvous ranking, the affinity router's load guard, the decode router's free-KV order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from ray_app.routing import FreeKVRouter, PrefixAffinityRouter, prefix_key, rendezvous_rank  # noqa: E402


def test_prefix_key_covers_the_leading_whole_pages_only():
    shared = list(range(100, 400))  # a 300-token shared prefix
    a, b = shared + [1, 2, 3], shared + [7] * 50
    assert prefix_key(a, 16, 256) == prefix_key(b, 16, 256) is not None  # the first 256 tokens
    assert prefix_key(a, 16, 256) != prefix_key([5] + a[1:], 16, 256)  # first page differs
    assert prefix_key(list(range(20)), 16, 256) == prefix_key(list(range(16)) + [9] * 4, 16, 256)
    assert prefix_key(list(range(15)), 16, 256) is None  # no whole page
    assert prefix_key(a, 16, 0) is None  # affinity off
    assert prefix_key(a, 256, 16) is not None  # at least one page


def test_rendezvous_rank_is_stable_and_spreads_keys():
    replicas = ["r1", "r2", "r3"]
    keys = [prefix_key(list(range(i, i + 32)), 16, 32) for i in range(96)]
    firsts = [rendezvous_rank(k, replicas)[0] for k in keys]
    assert all(firsts.count(r) >= 16 for r in replicas), firsts  # no replica left out
    for k, first in zip(keys, firsts):  # removing another replica never moves a key
        rest = [r for r in replicas if r != first]
        assert rendezvous_rank(k, [first, rest[0]])[0] == first
        assert rendezvous_rank(k, list(reversed(replicas)))[0] == first


def _replica(rid: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)


def _choose(router_cls, state: dict, replicas, key=None):
    router = SimpleNamespace(**state)
    pending = SimpleNamespace(kwargs={"routing_key": key})
    return asyncio.run(router_cls.choose_replicas(router, replicas, pending))


def test_affinity_router_prefers_the_keys_replica_unless_it_is_busy():
    reps = [_replica("a"), _replica("b"), _replica("c")]
    key = prefix_key(list(range(64)), 16, 64)
    best = rendezvous_rank(key, ["a", "b", "c"])[0]
    qlen = {"a": 0, "b": 0, "c": 0}
    state = {"imbalance": 4, "_queue_len": lambda r: qlen[r.replica_id.unique_id]}
    ranks = _choose(PrefixAffinityRouter, state, reps, key)
    assert [r.replica_id.unique_id for r in ranks[0]] == [best] and len(ranks[1]) == 2
    qlen[best] = 4  # as busy as the guard allows: still preferred
    assert _choose(PrefixAffinityRouter, state, reps, key)[0][0].replica_id.unique_id == best
    qlen[best] = 5  # busier: every replica is a candidate (least loaded wins)
    (busy,) = _choose(PrefixAffinityRouter, state, reps, key)
    assert sorted(r.replica_id.unique_id for r in busy) == ["a", "b", "c"]
    firsts = set()  # no key: one rank of all, in random order (ties spread over replicas)
    for _ in range(30):
        (only,) = _choose(PrefixAffinityRouter, state, reps, None)
        assert len(only) == 3
        firsts.add(only[0].replica_id.unique_id)
    assert firsts == {"a", "b", "c"}


def test_decode_router_ranks_by_free_kv_room():
    reps = [_replica("a", free_kv_tokens=100), _replica("b", free_kv_tokens=900),
            _replica("c")]  # no stats yet
    ranks = _choose(FreeKVRouter, {}, reps)
    assert [r.replica_id.unique_id for r in ranks[0]] == ["b"]
    assert [r.replica_id.unique_id for r in ranks[1]] == ["a", "c"]


def test_ingress_keys_text_by_its_leading_tokens_without_tokenizing_it_all():
    """A text prompt's key is the key of its token ids (the ingress tokenizes a bounded text
    prefix only); prompts sharing a long text prefix share it, others do not."""
    from ray_app.ingress import RemoteEngine
    from sglang_tpu_backend.managers.io_struct import GenerateReqInput
    from sglang_tpu_backend.server_args import ServerArgs

    remote = RemoteEngine(ServerArgs(page_size=16), engine=object(), affinity_tokens=64)
    shared = "The sea was calm and the sky above it wide. " * 40

    def key(text):
        return remote._routing_key(GenerateReqInput(text=text))

    full = remote.tokenizer.encode(shared + "first tail")
    assert key(shared + "first tail") == prefix_key(full, 16, 64) is not None
    assert key(shared + "first tail") == key(shared + "a second, different tail")
    assert key("Another prompt entirely. " + shared) != key(shared)
    assert RemoteEngine(ServerArgs(), engine=object())._routing_key(
        GenerateReqInput(text=shared)) is None  # affinity off
