"""Checks made before a request reaches a route, as pure ASGI middleware (streams pass
untouched): the API key, and the Host header against the names the server answers to."""

from __future__ import annotations

import hmac
import ipaddress

from nanoserve.serve.http_io import CLOSE, error_response
from nanoserve.serve.protocol import APIError, short

OPEN_PATHS = ("/health", "/metrics")  # answered without the API key
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but /health and /metrics. (vLLM guards only
    /v1 routes; here /tokenize and friends need the key too, since they make the server work.)"""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in OPEN_PATHS:
            scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
            given = token.strip() if scheme.lower() == b"bearer" else b""
            if not hmac.compare_digest(given, self.key):
                e = APIError(401, "Incorrect API key provided: pass it as 'Authorization: "
                                  "Bearer <key>'", code="invalid_api_key",
                             headers={"www-authenticate": "Bearer", **CLOSE})
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(value: str) -> str | None:
    """A Host header's name without its port ('[::1]:8000' -> '::1'); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
        ok = bool(sep) and (not rest or (rest.startswith(":") and port.isdigit()))
        return name if ok else None
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    name, _, port = value.partition(":")
    return name if name and (not port or port.isdigit()) else None


def host_allowed(name: str, patterns: list[str]) -> bool:
    """`patterns`: names, '*' for any, '*.example.com' for its subdomains."""
    for p in patterns:
        if p == "*" or p == name or (p.startswith("*.") and name.endswith(p[1:])):
            return True
    return False


class AllowedHostsMiddleware:
    """400 for a request whose Host header names none of `hosts` (any port): a web page that
    rebinds its own name to 127.0.0.1 sends its own name there, so it cannot drive a server
    that answers only to loopback names."""

    def __init__(self, app, hosts: list[str]) -> None:
        self.app = app
        self.hosts = [h.strip().lower().removeprefix("[").removesuffix("]") for h in hosts]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            raw = _header(scope, b"host")
            given = raw.decode("latin-1") if raw is not None else None
            name = host_name(given) if given is not None else None
            if name is None or not host_allowed(name, self.hosts):
                what = f"Host {short(given)}" if given is not None else "a missing Host header"
                e = APIError(400, f"{what} is not allowed: this server answers to "
                                  f"{', '.join(self.hosts)} (--allowed-hosts)",
                             code="invalid_host", headers=CLOSE)
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str, option: str | None = None) -> list[str] | None:
    """The Host names the server answers to (None: any). `option`: comma-separated names ('*'
    for any). By default, a server bound to a loopback address answers only to loopback names
    (and the address it is bound to); one bound to anything else, to any name."""
    if option is not None:
        names = [n.strip() for n in option.split(",") if n.strip()]
        if not names:
            raise ValueError("allowed hosts: give at least one name, or '*' for any")
        return None if "*" in names else names
    if not is_loopback(bind_host):
        return None
    bound = bind_host.strip("[]").lower()
    return list(LOOPBACK_NAMES) + ([bound] if bound not in LOOPBACK_NAMES else [])
