"""Installing a fetched model into the weight store atomically, and retiring the copy it replaces.

Files land in ``<store>/.warmserve-staging/<dir>/`` and the finished directory is renamed into
``<store>/<dir>`` in one step (``<dir>``: :func:`warmserve.modelref.store_dirname`, through
:meth:`~warmserve_agent.store.WeightStore.model_path`; an in-place source, ``pvc://`` or
``file://``, is linked the same way), so the store never shows a half-fetched model.  A copy in
use by a prewarm slot or an instance is never swapped under it; the copy replaced (or evicted)
moves to the trash and is deleted (in the background, or at once when eviction makes room).
Retiring a model removes its own directory or link and nothing else: no model's directory holds
another's, and a directory at a model's place that is not a model (no ``config.json``) is
refused rather than removed.  The URI of each link the agent made is recorded in ``<store>/
.warmserve-links.json`` (a link holds only its target's path), so Describe reports the source a
deployment named, which the operator's per-namespace source rules compare.  All of it under the
node core's lock, so that installation and
eviction never race prewarm admission.

:class:`StoreInstall` is handed the store, the node core's lock and what the core uses; the
fetcher holds it and hands it to the budget (which retires what it evicts) and the download.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from warmserve_agent.sources import Registry, SourceError, SourceSettings, open_source
from warmserve_agent.sources.fetch_records import MANIFEST, TRASH, FetchFailed
from warmserve_agent.store import WeightStore

LINKS = ".warmserve-links.json"  # store dir name -> {"source": URI, "target": path}


class StoreInstall:
    """Where models live in the store and how a new copy replaces the old (see module
    docstring)."""

    def __init__(
        self,
        store: WeightStore,
        settings: SourceSettings,
        registry: Registry,
        *,
        core_lock: threading.RLock,
        in_use: Callable[[], set[str]],
    ) -> None:
        self.store = store
        self.root = store.root
        self._settings = settings
        self._registry = registry
        self.core_lock = core_lock  # the node core's lock: installation vs. prewarm admission
        self._in_use = in_use

    # ---- store layout -----------------------------------------------------------------------
    def path(self, model: str) -> Path:
        return self.store.model_path(model)

    def present_source(self, path: Path) -> str | None:
        """None if absent; the recorded source ("" for a pre-filled model) if present."""
        if path.is_symlink():
            return "link:" + os.readlink(path)
        if not (path / "config.json").is_file():
            return None
        with contextlib.suppress(OSError, ValueError):
            return str(json.loads((path / MANIFEST).read_text()).get("source", ""))
        return ""

    def same_link(self, path: Path, uri: str) -> bool:
        if not path.is_symlink():
            return False
        try:
            src = open_source(uri, self._settings, self._registry)
        except SourceError:
            return False
        return src.in_place and os.path.realpath(path) == str(src.location())

    def _check_replaceable(self, model: str) -> None:
        """Caller holds core_lock: a copy in use (slot, instance) is never swapped under it."""
        path = self.path(model)
        if (path.exists() or path.is_symlink()) and model in self._in_use():
            raise FetchFailed(
                "FAILED_PRECONDITION",
                f"{model} was prewarmed or started from its previous copy while the new one was "
                "fetched; evict it and retry",
            )

    def install_dir(self, model: str, staging: Path) -> None:
        final = self.path(model)
        final.parent.mkdir(parents=True, exist_ok=True)
        with self.core_lock:
            self._check_replaceable(model)
            trash = self.retire(model)
            os.rename(staging, final)
            self.store.forget(model)
        self.discard(trash)

    def install_link(self, model: str, target: Path, source: str) -> None:
        final = self.path(model)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.link"
        os.symlink(target, tmp)
        with self.core_lock:
            try:
                self._check_replaceable(model)
                trash = self.retire(model)
            except FetchFailed:
                tmp.unlink()
                raise
            os.rename(tmp, final)
            links = self._links()
            links[final.name] = {"source": source, "target": str(target)}
            self._write_links(links)
            self.store.forget(model)
        self.discard(trash)

    def link_source(self, model: str) -> str:
        """The URI the link of ``model`` was made from; "" for a link the agent did not make (or
        one changed since), which is reported as unmanaged, like a pre-filled directory."""
        path = self.path(model)
        rec = self._links().get(path.name)
        with contextlib.suppress(OSError):
            if isinstance(rec, dict) and rec.get("target") == os.readlink(path):
                return str(rec.get("source", ""))
        return ""

    def _links(self) -> dict[str, object]:
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads((self.root / LINKS).read_text())
            if isinstance(doc, dict):
                return doc
        return {}

    def _write_links(self, links: dict[str, object]) -> None:
        """Caller holds core_lock: written whole and renamed into place."""
        tmp = self.root / f"{LINKS}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_text(json.dumps(links, sort_keys=True))
        os.replace(tmp, self.root / LINKS)

    def retire(self, model: str) -> Path | None:
        """Move the current copy of ``model`` (if any) out of the store; caller holds core_lock.
        The trash directory to delete (:meth:`discard`), None when there is none."""
        path = self.path(model)
        if path.is_symlink():
            path.unlink()
            links = self._links()
            if links.pop(path.name, None) is not None:
                self._write_links(links)
            return None
        if not path.exists():
            return None
        if not (path / "config.json").exists() and not (path / MANIFEST).exists():
            raise FetchFailed(
                "FAILED_PRECONDITION",
                f"{path} in the weight store is not a model directory (no config.json): it is "
                f"not removed to make way for {model}; move it out of the store",
            )
        trash = self.root / TRASH / uuid.uuid4().hex
        trash.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.rename(path, trash)
        return trash

    @staticmethod
    def discard(trash: Path | None, *, wait: bool = False) -> None:
        """Delete a retired copy: now (``wait``: its space is needed) or in the background."""
        if trash is None:
            return
        if wait:
            shutil.rmtree(trash, ignore_errors=True)
        else:
            threading.Thread(target=shutil.rmtree, args=(trash, True), daemon=True).start()
