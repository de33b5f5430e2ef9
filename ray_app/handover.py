"""How a prefill replica's ``RequestHandover`` reaches a decode replica.

A transport turns a handover (numpy KV pages + GDN states, see
``sglang_tpu_backend.managers.handover``) into a small picklable ticket that travels through
the ingress, and a ticket back into the handover on the receiving replica. The default puts
the handover in Ray's object store (the decode replica pulls it from the prefill replica's
node); a device-to-device transport (e.g. TPU ICI / DCN transfers of the page arrays) would
return a ticket naming remote buffers instead, with the same two calls.
"""

from __future__ import annotations

import dataclasses
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


class ObjectStoreTransport:
    """Ray object store: ``ray.put`` on the prefill replica, ``await ref`` on the decode one.

    The state arrays travel as one object of flat byte buffers (zero-copy in and out of the
    store); the rest of the handover (the request, its ids and logprobs: small) rides in the
    ticket. The ref is nested in the ticket (a list), so Ray does not resolve it on the way
    through the ingress; the prefill replica owns the object until the ticket is dropped.
    """

    name = "object_store"

    def send(self, h: RequestHandover) -> dict[str, Any]:
        import ray

        meta = dataclasses.replace(h, **{name: None for name in STATE_ARRAYS})
        return {"transport": self.name, "refs": [ray.put(state_buffers(h))], "meta": meta,
                "nbytes": h.nbytes}

    async def receive(self, ticket: dict[str, Any]) -> RequestHandover:
        if ticket.get("transport") != self.name:
            raise ValueError(f"ticket of transport {ticket.get('transport')!r}, expected {self.name!r}")
        buffers = await ticket["refs"][0]
        return dataclasses.replace(ticket["meta"], **state_arrays(buffers))


TRANSPORTS = {"object_store": ObjectStoreTransport}


def make_transport(name: str) -> Transport:
    return TRANSPORTS[name]()
