"""The handover transports' send / receive outside Serve (the apps use them end to end:
object_store in tests/ray_serve/test_serve_app.py, device in test_multihost_app.py), and the
object store's keeper (in process, and its actor on a local Ray cluster)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from ray_app.handover import (
    DeviceTransport, HandoverKeeper, ObjectStoreTransport, release, state_arrays, state_buffers)
from sglang_tpu_backend.managers.handover import RequestHandover
from sglang_tpu_backend.managers.io_struct import GenerateReqInput


def _handover(seed: int) -> RequestHandover:
    rng = np.random.default_rng(seed)
    return RequestHandover(
        request=GenerateReqInput(input_ids=[1, 2, 3], rid=f"r{seed}"), prompt_ids=[1, 2, 3],
        output_ids=[7], seed=seed, num_computed=3, page_size=16, weight_version="v1",
        kv=rng.standard_normal((2, 3, 4, 16, 8)).astype(ml_dtypes.bfloat16),
        conv=rng.standard_normal((6, 3, 64)).astype(np.float32),
        rec=rng.standard_normal((6, 2, 8, 8)).astype(np.float32))


def _assert_same(got: RequestHandover, want: RequestHandover) -> None:
    for name in ("kv", "conv", "rec"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert (got.request.rid, got.output_ids, got.weight_version) == (
        want.request.rid, want.output_ids, want.weight_version)


def test_state_buffers_round_trip_bfloat16_without_copies():
    h = _handover(0)
    buffers = state_buffers(h)
    assert all(buf.dtype == np.uint8 for _, _, buf in buffers.values())
    arrays = state_arrays(buffers)
    assert arrays["kv"].dtype == h.kv.dtype and np.array_equal(arrays["kv"], h.kv)
    assert np.shares_memory(arrays["conv"], buffers["conv"][2])  # views, no copy


def test_device_transport_pulls_the_state_into_another_server():
    """Two transfer servers (a prefill and a decode replica's) in one process: tickets carry
    no array bytes; every request's state arrives equal, over one reused connection."""
    prefill, decode = DeviceTransport(), DeviceTransport()
    sent = [_handover(i) for i in range(3)]
    tickets = [prefill.send(h) for h in sent]
    assert all(t["meta"].kv is None and t["nbytes"] == h.nbytes for t, h in zip(tickets, sent))
    assert len({t["uuid"] for t in tickets}) == 3
    for ticket, h in zip(reversed(tickets), reversed(sent)):  # any order
        _assert_same(asyncio.run(decode.receive(ticket)), h)
    assert list(decode._connections) == [prefill._server.address()]


def test_a_ticket_of_another_transport_is_refused():
    ticket = DeviceTransport().send(_handover(0))
    with pytest.raises(ValueError, match="expected 'object_store'"):
        asyncio.run(ObjectStoreTransport().receive(ticket))


def test_device_transport_carries_the_nextn_mtp_kv_and_drafts():
    """A NEXTN prefill replica's handover: its MTP KV pages and first drafts arrive too."""
    prefill, decode = DeviceTransport(), DeviceTransport()
    h = _handover(4)
    mtp_kv = np.random.default_rng(5).standard_normal((1, 3, 4, 16, 8))
    h.mtp_kv = mtp_kv.astype(ml_dtypes.bfloat16)
    h.drafts = [11, 12, 13]
    got = asyncio.run(decode.receive(prefill.send(h)))
    _assert_same(got, h)
    assert got.mtp_kv.dtype == h.mtp_kv.dtype and np.array_equal(got.mtp_kv, h.mtp_kv)
    assert got.drafts == [11, 12, 13]



def test_device_transport_carries_the_routed_experts_in_the_ticket():
    """A handover with ``return_routed_experts``: the prompt's routed ids i32[P, M, K] ride in
    the ticket's metadata (not offered as device state) and arrive equal."""
    prefill, decode = DeviceTransport(), DeviceTransport()
    h = _handover(6)
    h.routed_experts = np.random.default_rng(7).integers(0, 64, (3, 4, 2)).astype(np.int32)
    ticket = prefill.send(h)
    assert len(ticket["specs"]) == 3 and ticket["meta"].routed_experts is h.routed_experts
    got = asyncio.run(decode.receive(ticket))
    _assert_same(got, h)
    assert got.routed_experts.dtype == np.int32
    np.testing.assert_array_equal(got.routed_experts, h.routed_experts)


def test_keeper_holds_until_released_or_expired_and_drops_a_late_keep():
    keeper = HandoverKeeper(keep_s=0.2)
    keeper.keep(1, ["a"])
    keeper.keep(2, ["b"])
    keeper.release(1)
    assert keeper.held() == [2]
    keeper.release(3)  # released before its keep arrived (calls of two callers)
    keeper.keep(3, ["c"])
    assert keeper.held() == [2]
    time.sleep(0.3)
    assert keeper.held() == []  # nobody released 2: it expired


def test_keeper_expiry_visits_only_the_expired_heads():
    """Expiry drops the oldest entries in place (deadline order), keeps the rest in order,
    and never rebuilds the dicts (it did on every call, O(held) each)."""
    keeper = HandoverKeeper(keep_s=0.2)
    keeper.keep(1, ["a"])
    keeper.release(9)  # a release whose keep has not arrived
    held, released = keeper._held, keeper._released
    time.sleep(0.3)
    keeper.keep(2, ["b"])
    keeper.keep(3, ["c"])
    assert keeper.held() == [2, 3]
    assert keeper._held is held and keeper._released is released and not released



@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    repo = str(Path(__file__).resolve().parents[2])
    ray.init(num_cpus=6, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "PYTHONPATH": repo}})
    yield ray
    ray.shutdown()


def _held_soon(ray, keeper, keys: list[int], timeout_s: float = 30.0) -> bool:
    """Whether ``keeper`` holds exactly ``keys`` within ``timeout_s``: its calls from other
    callers (keep, release) are not ordered with this one's."""
    deadline = time.monotonic() + timeout_s
    while ray.get(keeper.held.remote()) != keys:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_object_store_ticket_is_held_until_released(ray_cluster):
    """A prefill actor's ticket reaches a decode actor, which gets the state equal; the
    prefill side's keeper holds the state until ``release``."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Prefill:
        def __init__(self):
            self.transport = ObjectStoreTransport()

        def send(self, h):
            return self.transport.send(h)

    @ray.remote(num_cpus=0)
    class Decode:
        async def receive(self, ticket):
            return await ObjectStoreTransport().receive(ticket)

    prefill, decode = Prefill.remote(), Decode.remote()
    sent = [_handover(6), _handover(7)]
    tickets = [ray.get(prefill.send.remote(h)) for h in sent]
    assert tickets[0]["keeper"] == tickets[1]["keeper"]  # one keeper per prefill replica
    keeper = tickets[0]["keeper"]
    assert _held_soon(ray, keeper, [t["key"] for t in tickets])
    for ticket, h in zip(tickets, sent):
        _assert_same(ray.get(decode.receive.remote(ticket)), h)
    release(tickets[0])
    assert _held_soon(ray, keeper, [tickets[1]["key"]])


def test_every_handover_through_serve_arrives_under_load(ray_cluster):
    """The app's path in Serve, without engines: an ingress deployment sends 400 requests,
    200 at a time, to 2 prefill replicas (``send`` of a 1 MiB state, the ticket in the reply)
    and on to 2 decode replicas (``receive``), releasing each ticket after. Every state
    arrives with its own bytes and every keeper ends empty. (Without the keeper, the ref
    nested in the reply lost 80 of 1,000 states this way: ``ReferenceCountingAssertionError``.)"""
    from ray import serve

    @serve.deployment(num_replicas=2, max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})
    class Prefill:
        def __init__(self):
            self.transport = ObjectStoreTransport()

        async def prefill(self, i: int) -> dict:
            await asyncio.sleep(0.01)
            h = _handover(0)
            h.kv = np.full(1 << 20, i % 251, np.uint8)
            return self.transport.send(h)

    @serve.deployment(num_replicas=2, max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})
    class Decode:
        async def decode(self, ticket: dict, i: int) -> bool:
            await asyncio.sleep(0.05)  # the decode replica fetches later than its ticket arrives
            h = await ObjectStoreTransport().receive(ticket)
            return bool((h.kv == i % 251).all())

    @serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
    class Ingress:
        def __init__(self, prefill, decode):
            self.prefill, self.decode = prefill, decode

        async def one(self, i: int) -> tuple[bool | str, Any]:
            """(the state arrived with its bytes, or the error; the ticket's keeper)"""
            ticket = await self.prefill.prefill.remote(i)
            try:
                return await self.decode.decode.remote(ticket, i), ticket["keeper"]
            except Exception as e:  # noqa: BLE001 - the test reports which
                return repr(e), ticket["keeper"]
            finally:
                release(ticket)

        async def run(self, n: int) -> tuple[list, dict]:
            outs = await asyncio.gather(*(self.one(i) for i in range(n)))
            return [ok for ok, _ in outs], {k._actor_id.hex(): k for _, k in outs}

    handle = serve.run(Ingress.bind(Prefill.bind(), Decode.bind()), name="handover", route_prefix=None)
    try:
        keepers = {}
        for _ in range(2):
            outs, ks = handle.run.remote(200).result()
            assert [o for o in outs if o is not True] == []
            keepers.update(ks)
        assert len(keepers) == 2  # one per prefill replica, both used
        assert all(_held_soon(ray_cluster, keeper, []) for keeper in keepers.values())
    finally:
        serve.shutdown()
