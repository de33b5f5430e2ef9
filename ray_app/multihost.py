"""Engine replicas spanning several hosts: the replica leads, one follower actor per other host.

A replica with ``hosts_per_replica`` H > 1 is placed by Serve in a placement group of H
bundles (``replica_bundles``; strategy ``STRICT_SPREAD`` on a real cluster: one host each,
the hosts of one slice), the replica itself in bundle 0. Its ``EngineServer`` starts a
``NodeFollower`` actor in each other bundle (``start_followers``), each asking for the same
``{"TPU": chips}`` (+ accelerator type), and hands them a coordinator address (the leader's
IP and a free port). Then the leader's Engine (``--nnodes H --node-rank 0``) and every
follower's ``parallel.node.run_follower`` (``--node-rank k``) join one jax.distributed group and
form one mesh: the leader schedules and samples, the followers run its steps.

Failure: a follower that stops (killed, its host gone) ends its ``run`` call; the replica's
health check sees that (``dead_followers``) and fails, so Serve replaces the replica (a
peer lost in a collective also makes jax's coordination service end the survivors within
its heartbeat timeout). The followers are the replica's child actors: they die with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import uuid
from typing import Any

import ray

from sglang_tpu_backend.server_args import ServerArgs

log = logging.getLogger(__name__)
STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
FOLLOWER_PREFIX = "stb-follower-"  # follower actor names: FOLLOWER_PREFIX + replica tag + node


def cpu_device_env(devices: int) -> dict[str, str]:
    """Env vars giving a process ``devices`` CPU devices (tests: CPU stand-ins for hosts)."""
    return {"JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def bundle(num_cpus: float, tpu_chips: int, accelerator_type: str | None) -> dict[str, float]:
    """One host's resources: CPUs, ``{"TPU": chips}`` and Ray's accelerator-type marker."""
    out: dict[str, float] = {"CPU": num_cpus}
    if tpu_chips:
        out["TPU"] = tpu_chips
    if accelerator_type:
        out[f"accelerator_type:{accelerator_type}"] = 0.001
    return out


def replica_bundles(hosts: int, num_cpus: float, tpu_chips: int,
                    accelerator_type: str | None) -> list[dict[str, float]]:
    """Placement group bundles of a replica spanning ``hosts`` hosts (the replica in the
    first, a follower with 1 CPU in each other)."""
    return ([bundle(num_cpus, tpu_chips, accelerator_type)]
            + [bundle(1, tpu_chips, accelerator_type) for _ in range(hosts - 1)])


def coordinator_address() -> str:
    """``ip:port`` for jax.distributed's coordinator on this (the leader's) node: its Ray IP
    and a port free now."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


@ray.remote(num_cpus=0, max_concurrency=2)  # ``placement`` answers while ``run`` runs
class NodeFollower:
    """One follower host of a multi-host replica: ``run`` is its whole life."""

    def __init__(self, server_args: ServerArgs):
        self.args = server_args

    def run(self) -> int:
        """Join the leader's group and run its steps until it stops; the steps run."""
        from sglang_tpu_backend.parallel.node import run_follower

        logging.basicConfig(level=self.args.log_level.upper())
        return run_follower(self.args)

    def placement_group_id(self) -> str | None:
        """Hex id of the placement group this actor runs in (None outside one)."""
        return ray.get_runtime_context().get_placement_group_id()


@dataclasses.dataclass
class Followers:
    """A replica's follower actors and their ``run`` calls (ObjectRefs, ready once ended)."""

    actors: list[Any]
    runs: list[Any]
    names: list[str]

    def dead(self) -> list[str]:
        """Names of followers whose ``run`` ended (a finished run while serving is a failure)."""
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return [n for n, r in zip(self.names, self.runs) if r in done]

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass


def start_followers(server_args: ServerArgs, hosts: int, *, tpu_chips: int = 0,
                    accelerator_type: str | None = None,
                    env_vars: dict[str, str] | None = None) -> tuple[ServerArgs, Followers]:
    """Start ``hosts - 1`` followers in this replica's placement group (bundles 1..hosts-1;
    outside one -- a replica without bundles -- wherever Ray puts them). Returns the leader's
    ServerArgs (``nnodes``, ``node_rank`` 0, ``dist_init_addr``) and the followers."""
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    coord = coordinator_address()
    leader = dataclasses.replace(server_args, nnodes=hosts, node_rank=0, dist_init_addr=coord)
    pg = get_current_placement_group()
    env = dict(env_vars or {})
    if os.environ.get("PYTHONPATH"):
        env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
    tag = uuid.uuid4().hex[:8]
    actors, runs, names = [], [], []
    for k in range(1, hosts):
        opts: dict[str, Any] = {"num_cpus": 1, "name": f"{FOLLOWER_PREFIX}{tag}-{k}",
                                "runtime_env": {"env_vars": env}}
        if tpu_chips:
            opts["resources"] = {"TPU": tpu_chips}
        if accelerator_type:
            opts["accelerator_type"] = accelerator_type
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=k)
        a = NodeFollower.options(**opts).remote(dataclasses.replace(leader, node_rank=k))
        actors.append(a)
        runs.append(a.run.remote())
        names.append(opts["name"])
    log.info("started %d followers (coordinator %s)", hosts - 1, coord)
    return leader, Followers(actors, runs, names)
