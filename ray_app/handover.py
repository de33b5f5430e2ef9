"""How a prefill replica's ``RequestHandover`` reaches a decode replica.

A transport turns a handover (numpy KV pages + GDN states, see
``sglang_tpu_backend.managers.handover``) into a small picklable ticket that travels through
the ingress, and a ticket back into the handover on the receiving replica. The default puts
the handover in Ray's object store (the decode replica pulls it from the prefill replica's
node); a device-to-device transport (e.g. TPU ICI / DCN transfers of the page arrays) would
return a ticket naming remote buffers instead, with the same two calls.
"""

from __future__ import annotations

from typing import Any, Protocol

from sglang_tpu_backend.managers.handover import RequestHandover


class Transport(Protocol):
    name: str

    def send(self, h: RequestHandover) -> dict[str, Any]:
        """Make ``h`` available to another replica; returns the ticket (small, picklable)."""

    async def receive(self, ticket: dict[str, Any]) -> RequestHandover:
        """The handover a ticket names (on the receiving replica)."""


class ObjectStoreTransport:
    """Ray object store: ``ray.put`` on the prefill replica, ``await ref`` on the decode one.

    The ref is nested in the ticket (a list), so Ray does not resolve it on the way through
    the ingress; the prefill replica owns the object until the ticket is dropped.
    """

    name = "object_store"

    def send(self, h: RequestHandover) -> dict[str, Any]:
        import ray

        return {"transport": self.name, "refs": [ray.put(h)], "nbytes": h.nbytes}

    async def receive(self, ticket: dict[str, Any]) -> RequestHandover:
        if ticket.get("transport") != self.name:
            raise ValueError(f"ticket of transport {ticket.get('transport')!r}, expected {self.name!r}")
        return await ticket["refs"][0]


TRANSPORTS = {"object_store": ObjectStoreTransport}


def make_transport(name: str) -> Transport:
    return TRANSPORTS[name]()
