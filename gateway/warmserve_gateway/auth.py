"""Optional API keys (bearer tokens) scoped to namespaces, from a mounted Secret or a file.

A tenant is a namespace: a key opens the models of the namespaces it is scoped to (and the
models the admin claimed cluster-wide, :mod:`.names`), nothing else.

``--api-keys PATH``:

* a **directory** holds one key per regular file — a Secret mounted as a volume, one file per
  data key.  The file (data key) name says the scope: ``<namespace>.<id>`` scopes the key to
  ``<namespace>`` (``team-a.alice``, ``team-a.ci-2026``); ``<id>`` is free.  To open several
  namespaces with one token, store the same token under one name per namespace
  (``team-a.ci``, ``team-b.ci``).  Rotating a key is replacing one data key's value (or adding
  the new one and deleting the old).
* a **file** holds one key per line: ``NAMESPACE[,NAMESPACE...] TOKEN``
  (``#`` comments and blank lines ignored).

**Keys of the old format** — a data key name without a ``<namespace>.`` prefix (``team-a``,
``key1``), or a line with a token alone — are scoped to the gateway's default namespaces
(``--anonymous-namespace``, the chart's release namespace), never to every namespace, and
logged once as such at each (re)load.  A name whose part before the first ``.`` is not a
namespace name (DNS label) is such an unscoped key too.

The key's **id** (the file name, or ``FILE:LINE``) — never the token — is what logs and metrics
see.  The kubelet updates a mounted Secret in place, so the keys are re-read when the path
changes (checked at most every ``reload_s`` seconds); a failed re-read keeps the previous keys.

Comparison is constant-time: the presented token and every key are reduced to SHA-256 digests
and compared with :func:`hmac.compare_digest` against *all* keys without stopping at a match, so
the time taken says nothing about which key (or how much of one) matched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .names import NAMESPACE_RE

log = logging.getLogger("warmserve.gateway.auth")


class ApiKeyError(ValueError):
    """The key file/directory cannot be used (the message says why)."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: the key's id ("" without keys) and the namespaces it may use."""

    key_id: str
    namespaces: frozenset[str]


@dataclass(frozen=True, slots=True)
class Key:
    id: str
    namespaces: frozenset[str]
    digest: bytes
    scoped: bool  # False: the old format, scoped to the default namespaces


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def check_namespaces(names: Iterable[str], flag: str) -> tuple[str, ...]:
    out = tuple(n.strip() for n in names if n.strip())
    for n in out:
        if not NAMESPACE_RE.match(n):
            raise ApiKeyError(f"{flag}: {n!r} is not a namespace name")
    return out


def _scope_of_name(name: str, default: frozenset[str]) -> tuple[frozenset[str], bool]:
    ns, dot, rest = name.partition(".")
    if dot and rest and NAMESPACE_RE.match(ns):
        return frozenset({ns}), True
    return default, False


def read_keys(path: Path, default: frozenset[str] = frozenset()) -> list[Key]:
    """Every key at ``path`` with its scope (module docstring); ``default``: the namespaces of
    an unscoped key."""
    keys: list[Key] = []
    if path.is_dir():
        for entry in sorted(path.iterdir()):
            if entry.name.startswith(".") or not entry.is_file():
                continue  # a mounted Secret's ..data links and the like
            token = entry.read_text().strip()
            if token:
                scope, scoped = _scope_of_name(entry.name, default)
                keys.append(Key(entry.name, scope, _digest(token), scoped))
    elif path.is_file():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            first, _, token = text.partition(" ")
            token = token.strip()
            if not token:  # a token alone: the old format
                keys.append(Key(f"{path.name}:{n}", default, _digest(first), False))
                continue
            try:
                scope = check_namespaces(first.split(","), f"{path}:{n}")
            except ApiKeyError as exc:
                raise ApiKeyError(f"API keys: {exc} (want NAMESPACE[,NAMESPACE] TOKEN)") from None
            keys.append(Key(f"{path.name}:{n}", frozenset(scope), _digest(token), True))
    else:
        raise ApiKeyError(f"API keys: {path} is neither a file nor a directory")
    if not keys:
        raise ApiKeyError(f"API keys: {path} holds no key (refusing to run with an empty key set)")
    unscoped = [k.id for k in keys if not k.scoped]
    if unscoped:
        log.warning(
            "event=api_keys_unscoped keys=%s namespaces=%s (name them <namespace>.<id> to scope "
            "them; until then they open the default namespaces only)",
            ",".join(unscoped), ",".join(sorted(default)) or "-",
        )  # fmt: skip
    return keys


class ApiKeys:
    """The accepted keys; :meth:`check` an ``Authorization`` header."""

    def __init__(
        self, path: Path, reload_s: float = 5.0, default_namespaces: Iterable[str] = ()
    ) -> None:
        self.path = Path(path)
        self.reload_s = reload_s
        self.default = frozenset(default_namespaces)
        self._keys = read_keys(self.path, self.default)
        self._stamp = self._fingerprint()
        self._checked = time.monotonic()

    def _fingerprint(self) -> tuple[float, ...]:
        try:
            if self.path.is_dir():
                files = sorted(e for e in self.path.iterdir() if e.is_file())
                return (*(os.stat(e).st_mtime for e in files), self.path.stat().st_mtime)
            return (self.path.stat().st_mtime,)
        except OSError:
            return ()

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_s:
            return
        self._checked = now
        stamp = self._fingerprint()
        if stamp == self._stamp:
            return
        try:
            self._keys = read_keys(self.path, self.default)
            self._stamp = stamp
            log.info("event=api_keys_reloaded keys=%d", len(self._keys))
        except (OSError, ApiKeyError) as exc:
            log.warning(
                "event=api_keys_reload_failed error=%r (keeping the previous keys)", str(exc)
            )

    def check(self, authorization: str | None) -> Caller | None:
        """The caller an ``Authorization: Bearer <key>`` header identifies, else None.  A token
        stored under several names opens the union of their namespaces; its id joins the
        names."""
        self._maybe_reload()
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        presented = _digest(token)
        ids: list[str] = []
        namespaces: set[str] = set()
        for key in self._keys:  # every key, no early exit (module docstring)
            if hmac.compare_digest(presented, key.digest):
                ids.append(key.id)
                namespaces |= key.namespaces
        if not ids:
            return None
        return Caller(",".join(ids), frozenset(namespaces))

    def __len__(self) -> int:
        return len(self._keys)
