"""How a prefill replica's ``RequestHandover`` reaches a decode replica.

A transport turns a handover (numpy KV pages + GDN states, see
``sglang_tpu_backend.managers.handover``) into a small picklable ticket that travels through
the ingress, and a ticket back into the handover on the receiving replica:
  object_store  (default) the state in Ray's object store; the decode replica pulls it from
                the prefill replica's node. A keeper actor beside the prefill replica holds
                it until the ingress releases the ticket.
  device        ``jax.experimental.transfer``: the prefill replica's transfer server offers
                the state as device buffers and the decode replica's server pulls them
                straight into its own device (no object store; on TPU the runtime's
                device-to-device path over the network). The ticket names the server and
                the transfer id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from sglang_tpu_backend.managers.handover import RequestHandover


class Transport(Protocol):
    name: str

    def send(self, h: RequestHandover) -> dict[str, Any]:
        """Make ``h`` available to another replica; returns the ticket (small, picklable)."""

    async def receive(self, ticket: dict[str, Any]) -> RequestHandover:
        """The handover a ticket names (on the receiving replica)."""


def release(ticket: dict[str, Any]) -> None:
    """The carrier of ``ticket`` (the ingress) is done with it: the receiving replica has its
    state, or never will. Idempotent, returns at once; a no-op for the device transport (its
    server drops an offer once pulled)."""
    keeper = ticket.get("keeper")
    if keeper is not None:
        keeper.release.remote(ticket["key"])


STATE_ARRAYS = ("kv", "conv", "rec")  # the handover's cache state (numpy, any dtype)


def state_buffers(h: RequestHandover) -> dict[str, Any]:
    """``h``'s state arrays as flat byte buffers + their dtype names and shapes: what Ray's
    serializer passes zero-copy (a bfloat16 array would be pickled in-band, copied)."""
    return {name: (str(a.dtype), a.shape, np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            for name in STATE_ARRAYS for a in [getattr(h, name)]}


def state_arrays(buffers: dict[str, Any]) -> dict[str, np.ndarray]:
    """Inverse of :func:`state_buffers` (views of the received buffers, no copy)."""
    return {name: buf.view(_dtype(dtype)).reshape(shape)
            for name, (dtype, shape, buf) in buffers.items()}


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


KEEP_S = 600.0  # how long a keeper holds a ticket's state that nobody released


class HandoverKeeper:
    """Holds the object-store refs of the tickets its prefill replica sent until the ingress
    releases them (``release``) or ``keep_s`` passes (an ingress that died never releases).

    Why: the ref travels nested in the prefill call's reply through Serve to the ingress and
    on to the decode replica. Under load (48 concurrent handovers) that chain of borrows once
    let Ray free the object before the decode replica fetched it
    (``ReferenceCountingAssertionError``). The keeper borrows each ref the plain way, as an
    actor call's argument, so the owner (the prefill replica) keeps the object at least until
    the release. A Ray actor (``ray.remote(HandoverKeeper)``), started by the prefill
    replica's transport on its node; it dies with that replica, as does the state it owns.
    """

    def __init__(self, keep_s: float = KEEP_S):
        self.keep_s = keep_s
        self._held: dict[int, tuple[list, float]] = {}  # key -> (refs, monotonic deadline)
        # Keys released before their ``keep`` arrived (the two come from different callers,
        # whose calls Ray does not order): that ``keep`` is dropped.
        self._released: dict[int, float] = {}

    def keep(self, key: int, refs: list) -> None:
        self._expire()
        if self._released.pop(key, None) is None:
            self._held[key] = (refs, time.monotonic() + self.keep_s)

    def release(self, key: int) -> None:
        self._expire()
        if self._held.pop(key, None) is None:
            self._released[key] = time.monotonic() + self.keep_s

    def held(self) -> list[int]:
        self._expire()
        return sorted(self._held)

    def _expire(self) -> None:
        """Drop what is past its deadline. Both dicts are in deadline order (entries are
        added with now + keep_s and never updated), so only their expired heads are visited:
        O(expired) a call, not O(held)."""
        now = time.monotonic()
        while self._held and next(iter(self._held.values()))[1] < now:
            del self._held[next(iter(self._held))]
        while self._released and next(iter(self._released.values())) < now:
            del self._released[next(iter(self._released))]


class ObjectStoreTransport:
    """Ray object store: ``ray.put`` on the prefill replica, ``await ref`` on the decode one.

    The state arrays travel as one object of flat byte buffers (zero-copy in and out of the
    store); the rest of the handover (the request, its ids and logprobs: small) rides in the
    ticket. The ref is nested in the ticket (a list), so Ray does not resolve it on the way
    through the ingress. The prefill replica owns the object (it is lost if that replica dies
    before the decode replica fetched it); its ``HandoverKeeper`` holds it until
    :func:`release`.
    """

    name = "object_store"

    def __init__(self, keep_s: float = KEEP_S):
        self.keep_s = keep_s
        self._keeper = None
        self._keys = itertools.count(1)

    def send(self, h: RequestHandover) -> dict[str, Any]:
        import ray

        meta = dataclasses.replace(h, **{name: None for name in STATE_ARRAYS})
        refs, key, keeper = [ray.put(state_buffers(h))], next(self._keys), self._start_keeper()
        # A release may still reach the keeper before this keep (the keeper then drops it).
        keeper.keep.remote(key, refs)
        return {"transport": self.name, "refs": refs, "keeper": keeper, "key": key,
                "meta": meta, "nbytes": h.nbytes}

    async def receive(self, ticket: dict[str, Any]) -> RequestHandover:
        if ticket.get("transport") != self.name:
            raise ValueError(f"ticket of transport {ticket.get('transport')!r}, expected {self.name!r}")
        buffers = await ticket["refs"][0]
        return dataclasses.replace(ticket["meta"], **state_arrays(buffers))

    def _start_keeper(self):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._keeper is None:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
            self._keeper = ray.remote(HandoverKeeper).options(
                num_cpus=0, scheduling_strategy=here).remote(self.keep_s)
        return self._keeper


class DeviceTransport:
    """Device-to-device through ``jax.experimental.transfer`` (one transfer server per replica,
    started on first use, listening on the node's IP).

    ``send`` uploads the state arrays to this replica's first device and offers them under a
    fresh transfer id (``await_pull``); the ticket carries the server's address, the id and
    the arrays' dtypes and shapes. ``receive`` connects to that server (once per peer) and
    pulls the arrays into its own first device; the engine installs them from there. The
    server holds an offered request until it is pulled: a ticket that is never received (the
    client went away between prefill and decode) keeps its buffers until the prefill
    replica stops.
    """

    name = "device"

    def __init__(self):
        self._server = None
        self._connections: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _start(self):
        import jax
        from jax.experimental import transfer

        with self._lock:
            if self._server is None:
                ip = _node_ip()
                self._server = transfer.start_transfer_server(
                    jax.local_devices()[0].client, f"{ip}:0", [f"{ip}:0"])
            return self._server

    def send(self, h: RequestHandover) -> dict[str, Any]:
        import jax

        server = self._start()
        arrays = [getattr(h, name) for name in STATE_ARRAYS]
        device = jax.local_devices()[0]
        on_device = [jax.device_put(np.ascontiguousarray(a), device) for a in arrays]
        with self._lock:
            uuid = next(self._ids)
        server.await_pull(uuid, on_device)
        meta = dataclasses.replace(h, **{name: None for name in STATE_ARRAYS})
        return {"transport": self.name, "address": server.address(), "uuid": uuid,
                "specs": [(str(a.dtype), a.shape) for a in arrays], "meta": meta,
                "nbytes": h.nbytes}

    async def receive(self, ticket: dict[str, Any]) -> RequestHandover:
        if ticket.get("transport") != self.name:
            raise ValueError(f"ticket of transport {ticket.get('transport')!r}, expected {self.name!r}")
        arrays = await asyncio.to_thread(self._pull, ticket)
        return dataclasses.replace(ticket["meta"], **dict(zip(STATE_ARRAYS, arrays)))

    def _pull(self, ticket: dict[str, Any]) -> list[np.ndarray]:
        import jax

        server, address = self._start(), ticket["address"]
        with self._lock:
            if address not in self._connections:
                self._connections[address] = server.connect(address)
            connection = self._connections[address]
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        specs = [jax.ShapeDtypeStruct(tuple(shape), _dtype(dtype), sharding=device)
                 for dtype, shape in ticket["specs"]]
        return [np.asarray(a) for a in connection.pull(ticket["uuid"], specs)]


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - ray is a dependency of ray_app
        pass
    return "127.0.0.1"


TRANSPORTS = {"object_store": ObjectStoreTransport, "device": DeviceTransport}


def make_transport(name: str) -> Transport:
    return TRANSPORTS[name]()
