"""API keys and the tenants they name (`metatp serve --api-key K ... --api-key-file F`).

Each key is a tenant: a request's tenant keys the prefix-cache blocks it may reuse
(`metatp.prefix_cache.Namespace`), so a prompt one tenant sent is never a cache hit for another,
and /metrics counts requests and tokens per tenant. No key configured: one anonymous tenant
(None), every request accepted, as before keys existed.

The keys themselves are kept only as SHA-256 digests and never appear in a message, a log line
or /metrics; a tenant is known by its name (given in the key file, else `tenant-<n>`).

Key file format: one key a line, optionally followed by whitespace and the tenant's name
(`KEY` or `KEY NAME`); blank lines and lines starting with `#` are skipped. Several keys may
name one tenant (a key being rotated). A name is 1-64 letters, digits, `_`, `.`, `-`, starting
with a letter or digit; `tenant-<n>` is reserved for unnamed keys.

The route handler's tenant reaches the requests it queues through a context variable
(`bind_request_tenant` in the app's auth check, `request_tenant` where requests are made): a
handler's coroutines, and threads started with `asyncio.to_thread`, share its context, so no
route has to pass the tenant along by hand.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from metatp.ir.errors import ConfigError

__all__ = ["Tenants", "AuthError", "bind_request_tenant", "request_tenant", "tenants_of"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_AUTO_NAME = re.compile(r"tenant-[0-9]+")
_KEY = re.compile(r"[\x21-\x7e]+")           # printable ASCII without spaces: what a Bearer header carries

_REQUEST_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("metatp_request_tenant", default=None)


class AuthError(Exception):
    """A request without a valid API key (the server answers 401, naming nothing secret)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class Tenants:
    """The server's API keys (as digests) and the tenant each names."""

    by_digest: Mapping[bytes, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_keys(cls, keys: Sequence[str] = (), key_file: str | None = None) -> "Tenants":
        """The tenants of `keys` (--api-key, each unnamed) and of `key_file` (--api-key-file);
        a ConfigError naming the flag or file line for a bad key, name or repeated key."""
        entries: list[tuple[str, str | None, str]] = [(k, None, f"--api-key #{i + 1}") for i, k in enumerate(keys)]
        if key_file is not None:
            entries += _read_key_file(key_file)
        by_digest: dict[bytes, str] = {}
        where_of: dict[bytes, str] = {}
        for n, (key, name, where) in enumerate(entries, 1):
            if not _KEY.fullmatch(key):
                raise ConfigError(f"{where}: an API key must be printable ASCII without spaces")
            d = _digest(key)
            if d in by_digest:
                raise ConfigError(f"{where}: this API key was already given ({where_of[d]})")
            by_digest[d], where_of[d] = name or f"tenant-{n}", where
        return cls(by_digest)

    @property
    def required(self) -> bool:
        """Does every request need a key (no key configured: one anonymous tenant)?"""
        return bool(self.by_digest)

    @property
    def names(self) -> list[str]:
        return sorted(set(self.by_digest.values()))

    def authenticate(self, authorization: str) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` header value (None: the anonymous one,
        when no key is configured); AuthError for a missing or unknown key."""
        if not self.required:
            return None
        scheme, _, key = authorization.partition(" ")
        name = self.by_digest.get(_digest(key.strip())) if scheme.lower() == "bearer" else None
        if name is None:
            raise AuthError("invalid or missing API key (Authorization: Bearer <key>)")
        return name


def _read_key_file(path: str) -> list[tuple[str, str | None, str]]:
    """(key, name or None, where) for each key line of `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--api-key-file {path}: not UTF-8 text") from None
    out = []
    for no, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path}:{no}"
        parts = text.split()
        if len(parts) > 2:
            raise ConfigError(f"{where}: expected 'KEY' or 'KEY NAME', got {len(parts)} words")
        name = parts[1] if len(parts) == 2 else None
        if name is not None and (not _NAME.fullmatch(name) or _AUTO_NAME.fullmatch(name)):
            raise ConfigError(f"{where}: a tenant name is 1-64 letters, digits, '_', '.' or '-' starting with a "
                              f"letter or digit, and not tenant-<n> (the unnamed keys' names), got {name[:70]!r}")
        out.append((parts[0], name, where))
    if not out:
        raise ConfigError(f"--api-key-file {path}: no key in it (one key a line, optionally 'KEY NAME')")
    return out


def bind_request_tenant(name: str | None) -> None:
    """The current route handler's requests are `name`'s (called by the app's auth check)."""
    _REQUEST_TENANT.set(name)


def request_tenant() -> str | None:
    """The tenant of the route handler running now (None: anonymous)."""
    return _REQUEST_TENANT.get()


def tenants_of(keys: "Tenants | Iterable[str] | str | None") -> Tenants:
    """`create_app`'s api_key argument as Tenants: Tenants, one key, several, or None or ""
    (no key: anonymous)."""
    if isinstance(keys, Tenants):
        return keys
    if not keys:
        return Tenants()
    return Tenants.from_keys([keys] if isinstance(keys, str) else list(keys))
