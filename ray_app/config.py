"""``serve run ray_app:app key=value ...`` arguments -> engine ServerArgs + deployment options.

Keys (values arrive as strings from the command line, typed from a Serve config file):
  any ``ServerArgs`` field under its own name (``model_path``, ``dtype``, ``page_size``, ...);
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
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from sglang_tpu_backend.server_args import ServerArgs

MODES = ("colocated", "disaggregated")
ENGINE_DEPLOYMENTS = {"colocated": ("engine",), "disaggregated": ("prefill", "decode")}
APP_KEYS = {
    "mode": str, "target_ongoing_requests": float, "max_ongoing_requests": int,
    "ingress_replicas": int, "tpu_chips": int, "num_cpus": float, "health_check_period_s": float,
    "health_check_timeout_s": float, "stall_timeout_s": float, "graceful_shutdown_timeout_s": float,
    "transport": str, "accelerator_type": str,
    "upscale_delay_s": float, "downscale_delay_s": float, "look_back_period_s": float,
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
    sa = ServerArgs(**server)
    if mode == "disaggregated" and (sa.dp_size != 1 or sa.tp_size != 1):
        raise ValueError("mode=disaggregated needs dp_size == tp_size == 1 per replica")
    return AppConfig(server_args=sa, mode=mode, options=options)
