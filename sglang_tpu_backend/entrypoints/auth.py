"""Who may call which route: SGLang's ``--api-key`` / ``--admin-api-key`` semantics.

Every route has one access level (the ``@admin_route`` marker, else by path):

* ``OPEN``: ``/health``, ``/health_generate``, ``/metrics``: no key ever, so Kubernetes probes and
  Prometheus scrapers need no secret.
* ``NORMAL`` (generation, model info, ...): ``api_key`` when it is set, else open. The admin key
  does not unlock them (as in SGLang).
* ``ADMIN`` (state-changing control: weight updates, profiling, cache flush, abort of every
  request): ``admin_api_key`` when it is set, and then ONLY it (the plain ``api_key`` is refused,
  401); with no admin key, ``api_key`` when it is set; with neither key, open. This is SGLang's
  ``AuthLevel.ADMIN_OPTIONAL`` (``sglang/srt/utils/auth.py``); SGLang's ``ADMIN_FORCE`` level
  (refused outright without an admin key) has no route here.

``/abort_request`` is NORMAL for one ``rid`` and ADMIN with ``abort_all`` (``@access_in_route``:
checked once the body is read; SGLang marks the whole route admin, here a client may cancel a
request it knows the rid of). Keys travel as
``Authorization: Bearer <key>``, compared in constant time. A server that binds a non-loopback
address with neither key logs :func:`exposure_warning` at start-up.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
from typing import Any, Callable

from starlette.requests import Request

from sglang_tpu_backend.entrypoints.request_fields import APIError

OPEN_PATHS = ("/health", "/health_generate", "/metrics")


class Access(enum.Enum):
    OPEN = "open"
    NORMAL = "normal"
    ADMIN = "admin"
    IN_ROUTE = "in_route"  # the level depends on the body: the route calls ``authorize`` itself


def admin_route(fn: Callable) -> Callable:
    """Mark a route handler as an ADMIN route (put it under the ``@router`` decorators)."""
    fn.access = Access.ADMIN
    return fn


def access_in_route(fn: Callable) -> Callable:
    """Mark a route handler that checks access itself, once it knows what is asked."""
    fn.access = Access.IN_ROUTE
    return fn


def route_access(request: Request) -> Access:
    """The access level of the route ``request`` was routed to."""
    route = request.scope.get("route")
    if getattr(route, "path", request.url.path) in OPEN_PATHS:
        return Access.OPEN
    return getattr(getattr(route, "endpoint", None), "access", Access.NORMAL)


def accepted_keys(access: Access, api_key: str | None, admin_api_key: str | None) -> tuple[str, ...]:
    """The keys that unlock a route of ``access`` (empty: no key needed)."""
    if access in (Access.OPEN, Access.IN_ROUTE):
        return ()
    if access is Access.ADMIN and admin_api_key:
        return (admin_api_key,)
    return (api_key,) if api_key else ()


def check_bearer(request: Request, keys: tuple[str, ...], what: str = "API key") -> None:
    """Raise APIError 401 (``param`` ``authorization``) unless ``request`` carries one of
    ``keys`` as its Bearer token; no keys: nothing to check."""
    if not keys:
        return
    auth = request.headers.get("authorization")
    if auth is None:
        raise APIError(f"Missing {what}: send 'Authorization: Bearer <key>'", "authorization", 401)
    scheme, _, token = auth.partition(" ")
    token_bytes = token.strip().encode()
    # Every key is compared (no early exit), so timing does not tell which one was close.
    ok = [hmac.compare_digest(token_bytes, k.encode()) for k in keys]
    if scheme.lower() != "bearer" or not any(ok):
        raise APIError(f"Invalid {what}", "authorization", 401)


def authorize(request: Request, args: Any, access: Access | None = None) -> None:
    """Check ``request`` against the keys of ``args`` for ``access`` (default: its route's)."""
    access = route_access(request) if access is None else access
    keys = accepted_keys(access, getattr(args, "api_key", None), getattr(args, "admin_api_key", None))
    check_bearer(request, keys, "admin API key" if access is Access.ADMIN and
                 getattr(args, "admin_api_key", None) else "API key")


def is_loopback(host: str) -> bool:
    """``host`` only reachable from this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposure_warning(host: str, api_key: str | None, admin_api_key: str | None) -> str | None:
    """The start-up warning for a server on ``host`` with no key, or None when it is keyed or
    only reachable from this machine."""
    if api_key or admin_api_key or is_loopback(host):
        return None
    bar = "!" * 78
    return (f"\n{bar}\nSECURITY WARNING: serving on {host} with neither --api-key nor "
            "--admin-api-key.\nAnyone who reaches this port can generate, and can call the "
            "admin routes:\n/update_weights_from_disk (any path on this host), /start_profile, "
            "/flush_cache,\n/abort_request with abort_all. Set --api-key and --admin-api-key, "
            f"or bind 127.0.0.1.\n{bar}")
