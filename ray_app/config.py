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
  (``object_store``, or ``device``: ``ray_app/handover.py``), ``prefix_affinity_tokens`` (requests whose leading this many tokens,
  in whole pages, are equal go to the same engine / prefill replica, unless it is
  ``affinity_imbalance`` (4) requests busier than the least loaded; default 256, 0: off;
  decode replicas are chosen by free KV room: ``ray_app/routing.py``).
Per role (disaggregated mode): any ``ServerArgs`` field or per-replica key above
(``tpu_chips``, ``num_cpus``, ``accelerator_type``, ``cpu_devices_per_host``, ...) prefixed
by ``prefill_`` or ``decode_`` applies to that role's replicas only; the unprefixed key to
both. E.g. ``prefill_dp_size=4 prefill_ep_size=4 decode_dp_size=2 decode_ep_size=2``: a
request prefilled on one of 4 DP ranks is decoded on the least-loaded of 2.
Multi-host replicas (any role; e.g. ``decode_hosts_per_replica=2``): ``hosts_per_replica``
(default 1) > 1 makes each engine replica span that many hosts: a placement group of one bundle per host (``{"TPU": tpu_chips}``
+ accelerator type each), ``placement_strategy`` (default ``STRICT_SPREAD``: one host per
bundle; ``PACK`` lets a one-node test cluster hold them), the replica leads and one follower
actor per other host follows (``ray_app/multihost.py``); ``dp_size`` / ``ep_size`` must count
every host's devices. ``cpu_devices_per_host`` (tests) gives
each of those processes that many CPU devices (``JAX_PLATFORMS=cpu`` + ``XLA_FLAGS``).
"""

from __future__ import annotations

import dataclasses
import functools
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
    "prefix_affinity_tokens": int, "affinity_imbalance": int,
}
AUTOSCALING_KEYS = ("upscale_delay_s", "downscale_delay_s", "look_back_period_s")
ROLES = ("prefill", "decode")
# App keys that a role prefix may scope to one deployment's replicas.
ROLE_APP_KEYS = tuple(k for k in APP_KEYS if k not in ("mode", "transport", "ingress_replicas",
                                                      "prefix_affinity_tokens"))
DEFAULT_AFFINITY_TOKENS = 256
DECODE_STATS_PERIOD_S = 1.0  # how often decode replicas report their free KV room
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
    server_args: ServerArgs  # the unprefixed keys' (the ingress's tokenizer and limits)
    mode: str = "colocated"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # APP_KEYS values given
    role_args: dict[str, ServerArgs] = dataclasses.field(default_factory=dict)  # prefill/decode

    def opt(self, key: str, default: Any = None, role: str | None = None) -> Any:
        """An app key's value: ``<role>_<key>`` first when ``role`` is given."""
        if role is not None and f"{role}_{key}" in self.options:
            return self.options[f"{role}_{key}"]
        return self.options.get(key, default)

    def args_for(self, name: str) -> ServerArgs:
        """The engine ServerArgs of deployment ``name`` (its role's prefixed keys applied)."""
        return self.role_args.get(name, self.server_args)

    def hosts(self, name: str | None = None) -> int:
        """Hosts (processes) one replica of deployment ``name`` spans."""
        return self.opt("hosts_per_replica", 1, name)

    def host_env_vars(self, name: str | None = None) -> dict[str, str]:
        """Env vars of every process of a replica (``cpu_devices_per_host``)."""
        n = self.opt("cpu_devices_per_host", 0, name)
        if not n:
            return {}
        from ray_app.multihost import cpu_device_env

        return cpu_device_env(n)

    def engine_deployment_options(self, name: str) -> dict[str, Any]:
        """``serve.deployment(...).options`` kwargs for engine deployment ``name``."""
        opt = functools.partial(self.opt, role=name)
        lo, hi = self.opt(f"{name}_min_replicas"), self.opt(f"{name}_max_replicas")
        out: dict[str, Any] = {
            "name": name.capitalize() + "Server",
            "max_ongoing_requests": opt("max_ongoing_requests",
                                        self.args_for(name).max_running_requests),
            "health_check_period_s": opt("health_check_period_s", 10.0),
            "health_check_timeout_s": opt("health_check_timeout_s", 30.0),
            "graceful_shutdown_timeout_s": opt("graceful_shutdown_timeout_s", 60.0),
            "ray_actor_options": {"num_cpus": opt("num_cpus", 1.0)},
        }
        env = self.host_env_vars(name)
        if env:
            out["ray_actor_options"]["runtime_env"] = {"env_vars": env}
        if self.hosts(name) > 1:
            from ray_app.multihost import replica_bundles

            out["placement_group_bundles"] = replica_bundles(
                self.hosts(name), opt("num_cpus", 1.0), opt("tpu_chips", 0),
                opt("accelerator_type"))
            out["placement_group_strategy"] = opt("placement_strategy", "STRICT_SPREAD")
        out["request_router_config"] = self.request_router(name)
        if opt("tpu_chips", 0):
            out["ray_actor_options"]["resources"] = {"TPU": opt("tpu_chips")}
        if opt("accelerator_type"):
            out["ray_actor_options"]["accelerator_type"] = opt("accelerator_type")
        if lo is not None or hi is not None:
            lo = 1 if lo is None else lo
            out["autoscaling_config"] = {
                "min_replicas": lo, "max_replicas": max(lo, hi if hi is not None else lo),
                "initial_replicas": lo,
                "target_ongoing_requests": opt("target_ongoing_requests", 2.0),
                **{k: opt(k) for k in AUTOSCALING_KEYS if opt(k) is not None}}
        else:
            out["num_replicas"] = self.opt(f"{name}_replicas", 1)
        return out


    @property
    def affinity_tokens(self) -> int:
        """Leading prompt tokens that key a request's replica (0: prefix affinity off)."""
        return self.opt("prefix_affinity_tokens", DEFAULT_AFFINITY_TOKENS)

    def request_router(self, name: str) -> Any:
        """Serve's ``RequestRouterConfig`` of deployment ``name`` (``ray_app/routing.py``):
        prefix affinity for engine and prefill replicas, most free KV room for decode ones."""
        from ray.serve.config import RequestRouterConfig

        from ray_app.routing import FreeKVRouter, PrefixAffinityRouter

        if name == "decode":
            return RequestRouterConfig(request_router_class=FreeKVRouter,
                                       request_routing_stats_period_s=DECODE_STATS_PERIOD_S)
        return RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs={
            "imbalance": self.opt("affinity_imbalance", 4, name)})


def parse_app_args(args: dict[str, Any] | None) -> AppConfig:
    """Split builder args into ServerArgs fields and app keys, each unprefixed or for one
    role (``prefill_`` / ``decode_``); unknown keys are an error."""
    fields = {f.name: _field_type(f.type) for f in dataclasses.fields(ServerArgs)}
    server: dict[str, Any] = {}
    per_role: dict[str, dict[str, Any]] = {r: {} for r in ROLES}
    options: dict[str, Any] = {}
    for key, value in dict(args or {}).items():
        role, _, rest = key.partition("_")
        if key in PROXY_KEYS or (role in ROLES and rest in PROXY_KEYS):
            raise ValueError(f"{key}: the Serve proxy's address is the Serve config's "
                             f"http_options.{rest or key} (or serve start --http-{rest or key}), "
                             "not an app argument")
        if key in fields:
            server[key] = _convert(key, value, fields[key])
        elif key in APP_KEYS:
            options[key] = _convert(key, value, APP_KEYS[key])
        elif role in ROLES and rest in fields:
            per_role[role][rest] = _convert(key, value, fields[rest])
        elif role in ROLES and rest in ROLE_APP_KEYS:
            options[key] = _convert(key, value, APP_KEYS[rest])
        else:
            raise ValueError(f"unknown argument {key!r}: expected a ServerArgs field "
                             f"({', '.join(sorted(fields))}) or one of {', '.join(sorted(APP_KEYS))}, "
                             f"either optionally prefixed by {' / '.join(r + '_' for r in ROLES)}")
    mode = options.pop("mode", "colocated")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    from ray_app.handover import TRANSPORTS

    if options.get("transport", "object_store") not in TRANSPORTS:
        raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, "
                         f"got {options['transport']!r}")
    for key, env in KEY_ENV_VARS.items():
        if server.get(key) is None and os.environ.get(env):
            server[key] = os.environ[env]
    sa = ServerArgs(**server)
    if not sa.api_key and not sa.admin_api_key:
        log.warning("SECURITY WARNING: neither api_key nor admin_api_key is set (app arguments, or "
                    "%s / %s): whoever reaches the Serve proxy can generate and call the admin "
                    "routes (/update_weights_from_disk, /start_profile, /flush_cache, abort_all)",
                    *KEY_ENV_VARS.values())
    cfg = AppConfig(server_args=sa, mode=mode, options=options,
                    role_args=_role_args(server, per_role, mode))
    for name in ENGINE_DEPLOYMENTS[mode]:
        _check_multihost(cfg, name)
    return cfg


def _role_args(server: dict[str, Any], per_role: dict[str, dict[str, Any]], mode: str
               ) -> dict[str, ServerArgs]:
    """Each role's ServerArgs: the unprefixed fields, its prefixed ones on top."""
    given = [f"{r}_{k}" for r, kv in per_role.items() for k in kv]
    if mode != "disaggregated":
        if given:
            raise ValueError(f"{given[0]}: role-prefixed keys need mode=disaggregated")
        return {}
    out = {}
    for role, extra in per_role.items():
        try:
            out[role] = ServerArgs(**{**server, **extra})
        except ValueError as e:
            raise ValueError(f"{role} replicas: {e}") from None
    mtp = ("NEXTN", "EAGLE")
    if (out["decode"].speculative_algorithm in mtp
            and out["prefill"].speculative_algorithm not in mtp):
        raise ValueError(f"decode replicas: --speculative-algorithm "
                         f"{out['decode'].speculative_algorithm} drafts from the MTP KV cache the "
                         "handover carries; the prefill replicas must run NEXTN too "
                         "(speculative_algorithm unprefixed, or prefill_speculative_algorithm)")
    routed = {role: out[role].enable_return_routed_experts for role in ("prefill", "decode")}
    if routed["prefill"] != routed["decode"]:
        on = "prefill" if routed["prefill"] else "decode"
        raise ValueError(f"enable_return_routed_experts is on for the {on} replicas only: the "
                         "prompt's routed experts come from the prefill replica through the "
                         "handover and the output's from the decode replica (set it unprefixed)")
    return out


def _check_multihost(cfg: AppConfig, name: str) -> None:
    """Multi-host keys of deployment ``name``: usable values, and ServerArgs a multi-node
    engine accepts."""
    from ray_app.multihost import STRATEGIES

    opt, sa = functools.partial(cfg.opt, role=name), cfg.args_for(name)
    hosts = cfg.hosts(name)
    if hosts < 1:
        raise ValueError(f"hosts_per_replica must be >= 1, got {hosts}")
    if opt("placement_strategy", "STRICT_SPREAD") not in STRATEGIES:
        raise ValueError(f"placement_strategy must be one of {STRATEGIES}, "
                         f"got {opt('placement_strategy', None)!r}")
    if opt("cpu_devices_per_host", 0) < 0:
        raise ValueError("cpu_devices_per_host must be >= 0")
    if hosts == 1:
        return
    if sa.nnodes != 1 or sa.node_rank != 0 or sa.dist_init_addr is not None:
        raise ValueError("hosts_per_replica sets nnodes / node_rank / dist_init_addr itself")
    try:  # what the replica's engine will be given (the address is the replica's own)
        dataclasses.replace(sa, nnodes=hosts, dist_init_addr="leader:1")
    except ValueError as e:
        raise ValueError(f"{name} replicas: hosts_per_replica={hosts}: {e}") from None
