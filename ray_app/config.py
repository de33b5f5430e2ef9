"""``serve run ray_app:app key=value ...`` arguments -> engine ServerArgs + deployment options.

Keys (values arrive as strings from the command line, typed from a Serve config file):
  any ``ServerArgs`` field under its own name (``model_path``, ``dtype``, ``page_size``, ...)
  except ``host`` / ``port``: the Serve proxy listens where the Serve config's
  ``http_options`` (or ``serve start --http-host/--http-port``) say, so they are refused here.
  ``api_key`` / ``admin_api_key`` (``entrypoints/auth.py``) default to the environment's
  ``SGLANG_API_KEY`` / ``SGLANG_ADMIN_API_KEY`` (the deploy manifests set them from a
  Kubernetes Secret, so no key is written in a Serve config); with neither, the builder logs
  a warning: every route, the admin routes too, is open to whoever reaches the proxy;
  ``mode``: ``colocated`` (default: one engine deployment) or ``disaggregated`` (prefill and
  decode deployments, KV pages + GDN state handed over per request);
  per engine deployment ``<d>`` in ``engine`` / ``prefill`` / ``decode``: ``<d>_replicas``
  (fixed count, default 1) or ``<d>_min_replicas`` + ``<d>_max_replicas`` (autoscaling);
  ``target_ongoing_requests`` (autoscaling target, default 2), ``upscale_delay_s`` /
  ``downscale_delay_s`` / ``look_back_period_s`` (Serve's defaults), ``max_ongoing_requests``
  (per replica, default ``max_running_requests``), ``ingress_replicas`` (default 1),
  ``tpu_chips`` (``{"TPU": n}`` per engine replica, default 0: none), ``accelerator_type``
  (Ray's name, e.g. ``TPU-V7X``: only nodes of that type), ``num_cpus`` per engine
  replica (default 1), ``health_check_period_s`` (10), ``health_check_timeout_s`` (30),
  ``stall_timeout_s`` (a replica whose engine loop has work but finished no step for this
  long is unhealthy; default 600: first compiles are slow), ``graceful_shutdown_timeout_s``
  (how long a stopping replica drains running requests, default 60), ``transport``
  (``object_store``).
Multi-host replicas (colocated mode): ``hosts_per_replica`` (default 1) > 1 makes each engine
replica span that many hosts: a placement group of one bundle per host (``{"TPU": tpu_chips}``
+ accelerator type each), ``placement_strategy`` (default ``STRICT_SPREAD``: one host per
bundle; ``PACK`` lets a one-node test cluster hold them), the replica leads and one follower
actor per other host follows (``ray_app/multihost.py``); ``dp_size`` / ``ep_size`` must count
every host's devices and ``disable_radix_cache=true``. ``cpu_devices_per_host`` (tests) gives
each of those processes that many CPU devices (``JAX_PLATFORMS=cpu`` + ``XLA_FLAGS``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from typing import Any

from sglang_tpu_backend.server_args import ServerArgs

log = logging.getLogger(__name__)
KEY_ENV_VARS = {"api_key": "SGLANG_API_KEY", "admin_api_key": "SGLANG_ADMIN_API_KEY"}
PROXY_KEYS = ("host", "port")  # ServerArgs fields the Serve proxy's http_options replace
MODES = ("colocated", "disaggregated")
ENGINE_DEPLOYMENTS = {"colocated": ("engine",), "disaggregated": ("prefill", "decode")}
APP_KEYS = {
    "mode": str, "target_ongoing_requests": float, "max_ongoing_requests": int,
    "ingress_replicas": int, "tpu_chips": int, "num_cpus": float, "health_check_period_s": float,
    "health_check_timeout_s": float, "stall_timeout_s": float, "graceful_shutdown_timeout_s": float,
    "transport": str, "accelerator_type": str,
    "upscale_delay_s": float, "downscale_delay_s": float, "look_back_period_s": float,
    "hosts_per_replica": int, "placement_strategy": str, "cpu_devices_per_host": int,
}
AUTOSCALING_KEYS = ("upscale_delay_s", "downscale_delay_s", "look_back_period_s")
for _d in ("engine", "prefill", "decode"):
    APP_KEYS.update({f"{_d}_replicas": int, f"{_d}_min_replicas": int, f"{_d}_max_replicas": int})


def _field_type(tp: Any) -> type:
    """``int | None`` -> int (ServerArgs annotations are strings under __future__ annotations)."""
    if isinstance(tp, str):
        tp = eval(tp, {"int": int, "str": str, "bool": bool, "float": float, "None": None})  # noqa: S307
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _convert(key: str, value: Any, tp: type) -> Any:
    if value is None or not isinstance(value, str) or tp is str:
        return value
    if value.lower() in ("none", "null"):
        return None
    if tp is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}: expected a boolean, got {value!r}")
    try:
        return tp(value)
    except ValueError as e:
        raise ValueError(f"{key}: expected {tp.__name__}, got {value!r}") from e


@dataclasses.dataclass(frozen=True)
class AppConfig:
    server_args: ServerArgs
    mode: str = "colocated"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # APP_KEYS values given

    def opt(self, key: str, default: Any = None) -> Any:
        return self.options.get(key, default)

    @property
    def hosts(self) -> int:
        """Hosts (processes) one engine replica spans."""
        return self.opt("hosts_per_replica", 1)

    def host_env_vars(self) -> dict[str, str]:
        """Env vars of every process of a replica (``cpu_devices_per_host``)."""
        n = self.opt("cpu_devices_per_host", 0)
        if not n:
            return {}
        from ray_app.multihost import cpu_device_env

        return cpu_device_env(n)

    def engine_deployment_options(self, name: str) -> dict[str, Any]:
        """``serve.deployment(...).options`` kwargs for engine deployment ``name``."""
        lo, hi = self.opt(f"{name}_min_replicas"), self.opt(f"{name}_max_replicas")
        out: dict[str, Any] = {
            "name": name.capitalize() + "Server",
            "max_ongoing_requests": self.opt("max_ongoing_requests",
                                             self.server_args.max_running_requests),
            "health_check_period_s": self.opt("health_check_period_s", 10.0),
            "health_check_timeout_s": self.opt("health_check_timeout_s", 30.0),
            "graceful_shutdown_timeout_s": self.opt("graceful_shutdown_timeout_s", 60.0),
            "ray_actor_options": {"num_cpus": self.opt("num_cpus", 1.0)},
        }
        env = self.host_env_vars()
        if env:
            out["ray_actor_options"]["runtime_env"] = {"env_vars": env}
        if self.hosts > 1:
            from ray_app.multihost import replica_bundles

            out["placement_group_bundles"] = replica_bundles(
                self.hosts, self.opt("num_cpus", 1.0), self.opt("tpu_chips", 0),
                self.opt("accelerator_type"))
            out["placement_group_strategy"] = self.opt("placement_strategy", "STRICT_SPREAD")
        if self.opt("tpu_chips", 0):
            out["ray_actor_options"]["resources"] = {"TPU": self.opt("tpu_chips")}
        if self.opt("accelerator_type"):
            out["ray_actor_options"]["accelerator_type"] = self.opt("accelerator_type")
        if lo is not None or hi is not None:
            lo = 1 if lo is None else lo
            out["autoscaling_config"] = {
                "min_replicas": lo, "max_replicas": max(lo, hi if hi is not None else lo),
                "initial_replicas": lo,
                "target_ongoing_requests": self.opt("target_ongoing_requests", 2.0),
                **{k: self.options[k] for k in AUTOSCALING_KEYS if k in self.options}}
        else:
            out["num_replicas"] = self.opt(f"{name}_replicas", 1)
        return out


def parse_app_args(args: dict[str, Any] | None) -> AppConfig:
    """Split builder args into ServerArgs fields and app keys; unknown keys are an error."""
    args = dict(args or {})
    fields = {f.name: _field_type(f.type) for f in dataclasses.fields(ServerArgs)}
    server, options = {}, {}
    for key, value in args.items():
        if key in PROXY_KEYS:
            raise ValueError(f"{key}: the Serve proxy's address is the Serve config's "
                             f"http_options.{key} (or serve start --http-{key}), not an app argument")
        if key in fields:
            server[key] = _convert(key, value, fields[key])
        elif key in APP_KEYS:
            options[key] = _convert(key, value, APP_KEYS[key])
        else:
            raise ValueError(f"unknown argument {key!r}: expected a ServerArgs field "
                             f"({', '.join(sorted(fields))}) or one of {', '.join(sorted(APP_KEYS))}")
    mode = options.pop("mode", "colocated")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if options.get("transport", "object_store") != "object_store":
        raise ValueError(f"transport must be 'object_store', got {options['transport']!r}")
    for key, env in KEY_ENV_VARS.items():
        if server.get(key) is None and os.environ.get(env):
            server[key] = os.environ[env]
    sa = ServerArgs(**server)
    if not sa.api_key and not sa.admin_api_key:
        log.warning("SECURITY WARNING: neither api_key nor admin_api_key is set (app arguments, or "
                    "%s / %s): whoever reaches the Serve proxy can generate and call the admin "
                    "routes (/update_weights_from_disk, /start_profile, /flush_cache, abort_all)",
                    *KEY_ENV_VARS.values())
    if mode == "disaggregated" and (sa.dp_size != 1 or sa.tp_size != 1):
        raise ValueError("mode=disaggregated needs dp_size == tp_size == 1 per replica")
    _check_multihost(sa, mode, options)
    return AppConfig(server_args=sa, mode=mode, options=options)


def _check_multihost(sa: ServerArgs, mode: str, options: dict[str, Any]) -> None:
    """Multi-host keys: usable values, and ServerArgs a multi-node engine accepts."""
    from ray_app.multihost import STRATEGIES

    hosts = options.get("hosts_per_replica", 1)
    if hosts < 1:
        raise ValueError(f"hosts_per_replica must be >= 1, got {hosts}")
    if options.get("placement_strategy", "STRICT_SPREAD") not in STRATEGIES:
        raise ValueError(f"placement_strategy must be one of {STRATEGIES}, "
                         f"got {options['placement_strategy']!r}")
    if options.get("cpu_devices_per_host", 0) < 0:
        raise ValueError("cpu_devices_per_host must be >= 0")
    if hosts == 1:
        return
    if mode != "colocated":
        raise ValueError("hosts_per_replica > 1 needs mode=colocated")
    if sa.nnodes != 1 or sa.node_rank != 0 or sa.dist_init_addr is not None:
        raise ValueError("hosts_per_replica sets nnodes / node_rank / dist_init_addr itself")
    try:  # what the replica's engine will be given (the address is the replica's own)
        dataclasses.replace(sa, nnodes=hosts, dist_init_addr="leader:1")
    except ValueError as e:
        raise ValueError(f"hosts_per_replica={hosts}: {e}") from None
