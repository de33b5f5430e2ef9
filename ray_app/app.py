"""``serve run ray_app:app [key=value ...]``: the application builder.

With no arguments: the embedded tiny model, colocated (one engine replica), CPU. See
``ray_app/config.py`` for the keys.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from ray_app.config import ENGINE_DEPLOYMENTS, parse_app_args
from ray_app.deployments import EngineServer
from ray_app.ingress import Ingress


def build_app(args: dict[str, Any] | None = None) -> Application:
    cfg = parse_app_args(args)
    sa = cfg.server_args
    engines = {}
    for name in ENGINE_DEPLOYMENTS[cfg.mode]:
        role = "colocated" if name == "engine" else name
        engines[name] = EngineServer.options(**cfg.engine_deployment_options(name)).bind(
            cfg.args_for(name), role=role, transport=cfg.opt("transport", "object_store"),
            stall_timeout_s=cfg.opt("stall_timeout_s", 600.0, name), hosts=cfg.hosts(name),
            host_options={"tpu_chips": cfg.opt("tpu_chips", 0, name),
                          "accelerator_type": cfg.opt("accelerator_type", None, name),
                          "env_vars": cfg.host_env_vars(name)})
    return Ingress.options(
        num_replicas=cfg.opt("ingress_replicas", 1),
        max_ongoing_requests=cfg.opt("max_ongoing_requests", sa.max_running_requests) * 4,
        ray_actor_options={"num_cpus": 0},
    ).bind(sa, affinity_tokens=cfg.affinity_tokens, **engines)
