"""Optional API keys (bearer tokens), read from a mounted Kubernetes Secret or a file.

``--api-keys PATH``: a directory holds one key per regular file (the layout of a Secret mounted
as a volume: one file per data key; the file name names the key, e.g. ``team-a``), a file holds
one key per line (``#`` comments and blank lines ignored).  The kubelet updates a mounted Secret
in place, so the keys are re-read when the path changes (checked at most every
``reload_s`` seconds); a failed re-read keeps the previous keys and is logged.

Comparison is constant-time: the presented token and every key are reduced to SHA-256 digests
and compared with :func:`hmac.compare_digest` against *all* keys without stopping at a match, so
the time taken says nothing about which key (or how much of one) matched.  Keys are never
logged; the name of the key that matched is (for audit).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("warmserve.gateway.auth")


class ApiKeyError(ValueError):
    """The key file/directory cannot be used (the message says why)."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def read_keys(path: Path) -> dict[str, bytes]:
    """Key name -> SHA-256 digest of the key."""
    keys: dict[str, bytes] = {}
    if path.is_dir():
        for entry in sorted(path.iterdir()):
            if entry.name.startswith(".") or not entry.is_file():
                continue  # a mounted Secret's ..data links and the like
            token = entry.read_text().strip()
            if token:
                keys[entry.name] = _digest(token)
    elif path.is_file():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            token = line.strip()
            if token and not token.startswith("#"):
                keys[f"{path.name}:{n}"] = _digest(token)
    else:
        raise ApiKeyError(f"API keys: {path} is neither a file nor a directory")
    if not keys:
        raise ApiKeyError(f"API keys: {path} holds no key (refusing to run with an empty key set)")
    return keys


class ApiKeys:
    """The accepted keys; :meth:`check` an ``Authorization`` header."""

    def __init__(self, path: Path, reload_s: float = 5.0) -> None:
        self.path = Path(path)
        self.reload_s = reload_s
        self._keys = read_keys(self.path)
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
            self._keys = read_keys(self.path)
            self._stamp = stamp
            log.info("event=api_keys_reloaded keys=%d", len(self._keys))
        except (OSError, ApiKeyError) as exc:
            log.warning(
                "event=api_keys_reload_failed error=%r (keeping the previous keys)", str(exc)
            )

    def check(self, authorization: str | None) -> str | None:
        """The name of the key an ``Authorization: Bearer <key>`` header carries, else None."""
        self._maybe_reload()
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        presented = _digest(token)
        matched: str | None = None
        for name, digest in self._keys.items():
            if hmac.compare_digest(presented, digest) and matched is None:
                matched = name
        return matched

    def __len__(self) -> int:
        return len(self._keys)
