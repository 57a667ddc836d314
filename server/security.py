"""Who may talk to the server, from where, and what an admin route may touch.

`SecurityConfig` holds the flags; `create_app` wraps the app in, outermost first:

- `OriginGuard`: at most `max_headers` headers of `max_header_bytes` in all (431;
  h11 only bounds headers that arrive in pieces); the `Host` header must name the bound interface when it is a
  loopback one (DNS rebinding); bound to another interface without `--api-key`, the `Host`
  must be an IP address, a loopback name or one of this machine's own names (a DNS-rebound
  page names a host of its own, so its Origin would otherwise pass as same-origin); a request that carries an `Origin` (a browser)
  is served only when that origin is granted for the route: `--cors-origins`
  grants the API routes, admin routes (`/v1/adapters`, `/stats`) only with
  `--cors-admin`. Granted routes get CORS headers (Starlette's CORSMiddleware);
  everything else from a browser is a 403, preflights included.
- `AuthMiddleware`: `--api-key` on every route but `/health`.
- `server.limits.BodyGuard`: body size, read time, JSON depth, prompt characters.

`confine_adapter_dir` resolves an adapter path (symlinks, `..`) and accepts it
only inside one of the `--adapter-dir` roots, with a size limit, answering with
messages that never reveal whether a path outside the roots exists.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from starlette.middleware.cors import CORSMiddleware

from .errors import APIError, bad_request
from .limits import BodyLimits, is_admin_path, reply

DEFAULT_ADAPTER_DIR = "~/.cache/mlx-parity/adapters"
DEFAULT_MAX_ADAPTER_BYTES = 1 << 30
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class SecurityConfig:
    api_key: Optional[str] = None
    cors_origins: tuple = ()               # "*" = any origin (API routes only)
    cors_admin: bool = False               # grant the origins the admin routes too
    allowed_hosts: Optional[tuple] = None  # None = loopback names when bound to loopback
    adapter_dirs: tuple = (DEFAULT_ADAPTER_DIR,)
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES
    max_header_bytes: int = 16 * 1024      # request line + headers (also given to h11)
    max_headers: int = 100
    limits: BodyLimits = field(default_factory=BodyLimits)


def is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> Optional[tuple]:
    """Loopback bind: only loopback Host names (a DNS-rebound page names its own host)."""
    return LOOPBACK_NAMES if is_loopback(bind_host) else None


@functools.lru_cache(maxsize=1)
def machine_names() -> frozenset:
    """This machine's own host names (what a LAN client may type to reach it)."""
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    return frozenset(n for n in names if n)


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _host_name(value: bytes) -> str:
    v = value.decode("latin-1").strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def _same_origin(origin: bytes, host: bytes) -> bool:
    """A page served by this server (the chat page) calling its own API: the
    Origin names the Host it was sent to. (Host names are checked before this.)"""
    o = origin.decode("latin-1").strip().lower()
    for scheme in ("http://", "https://"):
        if o.startswith(scheme):
            return bool(host) and o[len(scheme):].rstrip("/") == host.decode("latin-1").strip().lower()
    return False


class OriginGuard:
    """Host check, then per-route CORS: granted origins get headers, the rest a 403."""

    def __init__(self, app, config: SecurityConfig):
        self.app = app
        self.hosts = config.allowed_hosts
        # bound beyond loopback with no key and no --allowed-hosts: refuse DNS names that are not ours
        self.names_only_ours = config.allowed_hosts is None and not config.api_key
        self.max_headers, self.max_header_bytes = config.max_headers, config.max_header_bytes
        origins = tuple(config.cors_origins)
        self.any_origin = "*" in origins
        self.origins = frozenset(o.rstrip("/") for o in origins if o != "*")
        self.admin_too = config.cors_admin
        self.cors = CORSMiddleware(app, allow_origins=list(origins) or [], allow_methods=["*"],
                                   allow_headers=["*"], max_age=600) if origins else None

    def granted(self, origin: str, path: str) -> bool:
        if self.cors is None or (is_admin_path(path) and not self.admin_too):
            return False
        return self.any_origin or origin.rstrip("/") in self.origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope.get("headers") or []
        size = sum(len(k) + len(v) + 4 for k, v in raw) + len(scope.get("raw_path") or b"")
        if len(raw) > self.max_headers or size > self.max_header_bytes:
            return await reply(scope, send, APIError(
                431, f"request headers too large ({len(raw)} headers, {size} bytes; the limits "
                     f"are {self.max_headers} and {self.max_header_bytes} bytes)"),
                {"Connection": "close"})
        headers = dict(raw)
        if self.hosts is not None and "*" not in self.hosts:
            host = _host_name(headers.get(b"host", b""))
            if host not in self.hosts:
                return await reply(scope, send, APIError(
                    403, "Host header not allowed (the server answers to "
                         f"{', '.join(self.hosts)}; see --allowed-hosts)",
                    type="permission_error"))
        if self.names_only_ours:
            host = _host_name(headers.get(b"host", b""))
            if host and not (is_ip_literal(host) or is_loopback(host) or host in machine_names()):
                return await reply(scope, send, APIError(
                    403, "Host header not allowed: a server bound beyond loopback without "
                         "--api-key answers only to IP addresses, localhost and this machine's "
                         "names (DNS rebinding); name the host with --allowed-hosts or set "
                         "--api-key", type="permission_error"))
        origin = headers.get(b"origin")
        if origin is None or _same_origin(origin, headers.get(b"host", b"")):
            return await self.app(scope, receive, send)
        origin = origin.decode("latin-1")
        if not self.granted(origin, scope["path"]):
            return await reply(scope, send, APIError(
                403, "cross-origin request refused: this origin is not granted this route "
                     "(--cors-origins)", type="permission_error"))
        await self.cors(scope, receive, send)


class AuthMiddleware:
    """`--api-key`: every route but the public ones (/health, the chat page: it
    holds no data, its own API calls send the key) needs `Authorization: Bearer
    KEY` or `x-api-key: KEY` (CORS preflights of granted origins pass)."""

    def __init__(self, app, api_key: str, public_paths=("/health",)):
        self.app = app
        self.key = api_key.encode()
        self.public = frozenset(public_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key") or None      # an empty header is no key
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given is not None and hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        msg = "invalid API key" if given is not None else (
            "missing API key: send Authorization: Bearer <key> or x-api-key: <key>")
        await reply(scope, send, APIError(401, msg, type="authentication_error",
                                          code="invalid_api_key"))


def add_security_middleware(app, config: SecurityConfig, public_paths=("/health",)) -> None:
    """The middleware stack of a FastAPI `app` (outermost first: origin, auth, body limits)."""
    from .limits import BodyGuard

    app.add_middleware(BodyGuard, limits=config.limits)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key, public_paths=public_paths)
    app.add_middleware(OriginGuard, config=config)


def adapter_roots(config: SecurityConfig) -> list:
    return [Path(os.path.expanduser(str(d))).resolve() for d in config.adapter_dirs]


def confine_adapter_dir(path: str, config: SecurityConfig) -> str:
    """The resolved adapter directory if it lies inside an `--adapter-dir` root (400 if not).

    A relative path is taken from the first root. The answer for a path outside
    the roots is the same whether it exists or not."""
    roots = adapter_roots(config)
    if not roots:
        raise bad_request("adapter mounting is disabled (no --adapter-dir)", param="path")
    if "\x00" in path:
        raise bad_request("path must not contain NUL characters", param="path")
    p = Path(os.path.expanduser(path))
    if not p.is_absolute():
        p = roots[0] / p
    try:
        resolved = p.resolve()
    except (OSError, RuntimeError):
        resolved = None
    if resolved is None or not any(resolved == r or r in resolved.parents for r in roots):
        raise bad_request("path is outside the adapter directories this server mounts from "
                          "(--adapter-dir)", param="path")
    if not resolved.is_dir():
        raise bad_request("adapter directory does not exist under the adapter directories",
                          param="path")
    for name in ADAPTER_FILES:
        f = resolved / name
        if not f.is_file():
            raise bad_request(f"the adapter directory has no {name}", param="path")
        limit = config.max_adapter_bytes if name.endswith(".safetensors") else \
            MAX_ADAPTER_CONFIG_BYTES
        if f.stat().st_size > limit:
            raise APIError(413, f"{name} is {f.stat().st_size} bytes, over the limit of "
                                f"{limit} bytes (--max-adapter-mb)", type="request_too_large",
                           param="path")
    return str(resolved)
