"""Installing a fetched model into the weight store atomically, and retiring the copy it replaces.

Files land in ``<store>/.warmserve-staging/<dir>/`` and the finished directory is renamed into
``<store>/<dir>`` in one step (``<dir>``: :func:`warmserve.modelref.store_dirname`, through
:meth:`~warmserve_agent.store.WeightStore.model_path`; an in-place source, ``pvc://`` or
``file://``, is linked the same way), so the store never shows a half-fetched model.  A copy in
use by a prewarm slot or an instance is never swapped under it; the copy replaced (or evicted)
moves to the trash and is deleted (in the background, or at once when eviction makes room).
Retiring a model removes its own directory or link and nothing else: no model's directory holds
another's, and a directory at a model's place that is not a model (no ``config.json``) is
refused rather than removed.  All of it under the node core's lock, so that installation and
eviction never race prewarm admission.

A layer of :class:`~warmserve_agent.sources.fetcher.ModelFetcher` (see that module's docstring).
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


class StoreInstall:
    """Where models live in the store and how a new copy replaces the old (see module
    docstring); the state is set by :class:`~warmserve_agent.sources.fetcher.ModelFetcher`."""

    store: WeightStore
    root: Path
    settings: SourceSettings
    registry: Registry
    core_lock: threading.RLock
    in_use: Callable[[], set[str]]

    # ---- store layout -----------------------------------------------------------------------
    def _path(self, model: str) -> Path:
        return self.store.model_path(model)

    def _present_source(self, path: Path) -> str | None:
        """None if absent; the recorded source ("" for a pre-filled model) if present."""
        if path.is_symlink():
            return "link:" + os.readlink(path)
        if not (path / "config.json").is_file():
            return None
        with contextlib.suppress(OSError, ValueError):
            return str(json.loads((path / MANIFEST).read_text()).get("source", ""))
        return ""

    def _same_link(self, path: Path, uri: str) -> bool:
        if not path.is_symlink():
            return False
        try:
            src = open_source(uri, self.settings, self.registry)
        except SourceError:
            return False
        return src.in_place and os.path.realpath(path) == str(src.location())

    def _check_replaceable(self, model: str) -> None:
        """Caller holds core_lock: a copy in use (slot, instance) is never swapped under it."""
        path = self._path(model)
        if (path.exists() or path.is_symlink()) and model in self.in_use():
            raise FetchFailed(
                "FAILED_PRECONDITION",
                f"{model} was prewarmed or started from its previous copy while the new one was "
                "fetched; evict it and retry",
            )

    def _install_dir(self, model: str, staging: Path) -> None:
        final = self._path(model)
        final.parent.mkdir(parents=True, exist_ok=True)
        with self.core_lock:
            self._check_replaceable(model)
            trash = self._retire(model)
            os.rename(staging, final)
            self.store.forget(model)
        self._discard(trash)

    def _install_link(self, model: str, target: Path) -> None:
        final = self._path(model)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.link"
        os.symlink(target, tmp)
        with self.core_lock:
            try:
                self._check_replaceable(model)
                trash = self._retire(model)
            except FetchFailed:
                tmp.unlink()
                raise
            os.rename(tmp, final)
            self.store.forget(model)
        self._discard(trash)

    def _retire(self, model: str) -> Path | None:
        """Move the current copy of ``model`` (if any) out of the store; caller holds core_lock.
        The trash directory to delete (:meth:`_discard`), None when there is none."""
        path = self._path(model)
        if path.is_symlink():
            path.unlink()
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
    def _discard(trash: Path | None, *, wait: bool = False) -> None:
        """Delete a retired copy: now (``wait``: its space is needed) or in the background."""
        if trash is None:
            return
        if wait:
            shutil.rmtree(trash, ignore_errors=True)
        else:
            threading.Thread(target=shutil.rmtree, args=(trash, True), daemon=True).start()
