"""Refit from a trainer process: SGLang's weights update group, device to device.

SGLang's trainer (rank 0) and its rollout engines (ranks ``rank_offset ..``) join one NCCL
group (``init_weights_update_group``); for each refit the trainer broadcasts the tensors and
every engine receives them by name, dtype and shape (``update_weights_from_distributed``).
On TPUs the same calls run over ``jax.experimental.transfer`` (the transport the PD handover
uses): the trainer's ``WeightSender`` runs a transfer server at ``master_address:
master_port`` and offers each refit's arrays once per engine rank; each engine's
``WeightReceiver`` connects to it and pulls them straight into its own device (no host
round trip on a TPU), then applies them as ``update_weights_from_tensor`` does (checkpoint
names, partial updates, validated before anything changes).

The two ends count refits: the n-th ``send`` offers the arrays to engine rank r under the
transfer id ``n * world_size + r``, and the engine's n-th ``update_weights_from_distributed``
pulls that id, so the driver only passes the names, dtypes and shapes, as with SGLang. A
refit that the engine refuses (an unknown name, a wrong shape) still consumes its id.

The host fallback is ``update_weights_from_tensor`` (numpy arrays through the caller, or
HTTP's base64 safetensors payload). ``backend`` other than ``"jax_transfer"`` (SGLang's
``"nccl"`` / ``"gloo"``) is refused, naming the field.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

BACKEND = "jax_transfer"
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group name


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # bf16 / fp8 names

    name = name.removeprefix("torch.")
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def transfer_id(refit: int, rank: int, world_size: int) -> int:
    """The transfer id of engine rank ``rank``'s arrays of the ``refit``-th refit."""
    return refit * world_size + rank


class WeightSender:
    """The trainer's end: a transfer server on ``address`` ("ip:port", port 0 = any free
    one) over ``device`` (default this process's first); ``world_size`` counts the trainer
    (rank 0) and every engine rank."""

    def __init__(self, world_size: int, address: str = "127.0.0.1:0", device: Any = None):
        from jax.experimental import transfer

        if world_size < 2:
            raise ValueError(f"world_size {world_size}: the trainer and at least one engine")
        self.world_size, self.refits = world_size, 0
        self.device = device or jax.local_devices()[0]
        host = address.rsplit(":", 1)[0]
        self.server = transfer.start_transfer_server(self.device.client, address, [f"{host}:0"])

    @property
    def address(self) -> tuple[str, int]:
        """(master_address, master_port) for the engines' ``init_weights_update_group``."""
        host, port = self.server.address().rsplit(":", 1)
        return host, int(port)

    def send(self, named_arrays: Sequence[tuple[str, Any]]) -> dict[str, list]:
        """Offer ``[(checkpoint name, array), ...]`` to every engine rank for the next refit;
        returns the ``names`` / ``dtypes`` / ``shapes`` the engines' calls take."""
        names = [n for n, _ in named_arrays]
        arrays = [jax.device_put(a, self.device) for _, a in named_arrays]
        for rank in range(1, self.world_size):
            self.server.await_pull(transfer_id(self.refits, rank, self.world_size), arrays)
        self.refits += 1
        return {"names": names, "dtypes": [str(a.dtype) for a in arrays],
                "shapes": [list(a.shape) for a in arrays]}


class WeightReceiver:
    """An engine rank's end of one group: connected to the trainer's server."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int):
        from jax.experimental import transfer

        if not 1 <= rank < world_size:
            raise ValueError(f"rank_offset {rank} must be in 1..{world_size - 1} "
                             f"(rank 0 is the trainer)")
        self.rank, self.world_size, self.refits = rank, world_size, 0
        self.device = jax.local_devices()[0]
        self.server = transfer.start_transfer_server(self.device.client, "127.0.0.1:0",
                                                     ["127.0.0.1:0"])
        self.connection = self.server.connect(f"{master_address}:{master_port}")
        self.lock = threading.Lock()

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
                ) -> tuple[list[tuple[str, jax.Array]], float]:
        """Pull the next refit's arrays onto this engine's device: ``([(name, array)], seconds)``."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes differ in length "
                             f"({len(names)}, {len(dtypes)}, {len(shapes)})")
        where = jax.sharding.SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct(tuple(s), _dtype(d), sharding=where)
                 for d, s in zip(dtypes, shapes)]
        with self.lock:
            uuid = transfer_id(self.refits, self.rank, self.world_size)
            self.refits += 1
            t0 = time.perf_counter()
            arrays = jax.block_until_ready(self.connection.pull(uuid, specs))
        return list(zip(names, arrays)), time.perf_counter() - t0


class WeightGroups:
    """An engine's weights update groups by name (SGLang's calls; ``Engine`` delegates)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.groups: dict[str, WeightReceiver] = {}

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str = DEFAULT_GROUP, backend: str = BACKEND) -> dict:
        if backend != BACKEND:
            return {"success": False, "message": f"backend {backend!r}: this server refits "
                    f"over {BACKEND!r} (device to device); update_weights_from_tensor is the "
                    "host path"}
        if group_name in self.groups:
            return {"success": False, "message": f"group_name {group_name!r} exists"}
        try:
            self.groups[group_name] = WeightReceiver(master_address, int(master_port),
                                                     int(rank_offset), int(world_size))
        except Exception as e:  # a bad address or rank: the caller's error, named
            return {"success": False, "message": f"init_weights_update_group: {e}"}
        return {"success": True, "message": f"joined {group_name!r} as rank {rank_offset}"}

    def update(self, names, dtypes, shapes, group_name: str = DEFAULT_GROUP,
               flush_cache: bool = True, weight_version: str | None = None) -> dict:
        group = self.groups.get(group_name)
        if group is None:
            return {"success": False, "message": f"group_name {group_name!r}: no such group "
                    "(init_weights_update_group first)"}
        try:
            named, seconds = group.receive(names, dtypes, shapes)
        except Exception as e:
            return {"success": False, "message": f"update_weights_from_distributed: {e}"}
        result = self.engine.update_weights_from_tensor(named, flush_cache=flush_cache,
                                                        weight_version=weight_version)
        gb = sum(a.nbytes for _, a in named) / 1e9
        return {**result, "transfer_seconds": seconds, "transfer_gb": gb,
                "transfer_gb_per_s": gb / seconds if seconds > 0 else float("inf")}

    def destroy(self, group_name: str = DEFAULT_GROUP) -> dict:
        if self.groups.pop(group_name, None) is None:
            return {"success": False, "message": f"group_name {group_name!r}: no such group"}
        return {"success": True, "message": f"left {group_name!r}"}
