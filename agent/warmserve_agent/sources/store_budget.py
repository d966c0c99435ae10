"""The store's disk budget: least-recently-used eviction of fetched models, pins, usage.

Before downloading, room is made under ``budget_bytes`` (the whole store: fetched and pre-filled
models, partial downloads) and above the disk reserve (the free space a fetch never takes,
:mod:`~warmserve_agent.sources.disk_reserve`): partial downloads of models not being fetched go
first, then the least recently used *fetched* models.  A model with a slot or an instance, being
fetched or pinned by a call in progress is never evicted; pre-filled models (no manifest) and
linked ones are never evicted.  If that is not enough the fetch fails with RESOURCE_EXHAUSTED,
naming the numbers and what is in use.  A fetched model's last use is the
modification time of its manifest (:meth:`StoreBudget.touch`), which survives agent restarts.

:class:`StoreBudget` retires what it evicts through the
:class:`~warmserve_agent.sources.store_install.StoreInstall` it is handed, reads the fetches in
progress from the :class:`~warmserve_agent.sources.fetch_records.FetchTable` and hands the
download the :class:`~warmserve_agent.sources.disk_reserve.DiskGuard` that watches the reserve.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from warmserve.units import format_size
from warmserve_agent.sources.disk_reserve import DiskGuard, DiskReserve, StatFn
from warmserve_agent.sources.fetch_records import MANIFEST, FetchFailed, FetchTable, StoreUsage, du
from warmserve_agent.sources.fetch_staging import remove, stale_partials
from warmserve_agent.sources.store_install import StoreInstall
from warmserve_agent.store import StoreError

log = logging.getLogger("warmserve.agent.fetch")  # one logger for the whole fetcher


class StoreBudget:
    """LRU order, pins and eviction under the budget (see module docstring)."""

    def __init__(
        self,
        install: StoreInstall,
        table: FetchTable,
        *,
        in_use: Callable[[], set[str]],
        budget_bytes: int,
        reserve: DiskReserve,
        disk_space: StatFn,
    ) -> None:
        self._install = install
        self._table = table
        self._in_use = in_use
        self.budget_bytes = budget_bytes
        self.reserve = reserve
        self.disk_space = disk_space  # os.statvfs of the store (a test may pass its own)
        self._pins: Counter[str] = Counter()

    @property
    def root(self) -> Path:
        return self._install.root

    def guard(self, model: str, need: int) -> DiskGuard:
        """What watches the disk reserve while ``model``'s ``need`` bytes are written."""
        return DiskGuard(self.root, self.reserve, model, need, stat=self.disk_space)

    def touch(self, model: str) -> None:
        """Mark ``model`` used now (LRU order of eviction)."""
        with contextlib.suppress(OSError, StoreError):
            os.utime(self._install.path(model) / MANIFEST)

    @contextlib.contextmanager
    def pinned(self, model: str) -> Iterator[None]:
        """Never evict ``model`` inside this block (between a fetch and its prewarm)."""
        with self._table.lock:
            self._pins[model] += 1
        try:
            yield
        finally:
            with self._table.lock:
                self._pins[model] -= 1
                if self._pins[model] <= 0:
                    del self._pins[model]

    def model_info(self, model: str) -> tuple[str, int, float]:
        """(source, bytes on disk, last use) of a store model; ("", 0, 0) when unmanaged."""
        path = self._install.path(model)
        if path.is_symlink():
            return self._install.link_source(model), 0, 0.0
        try:
            m = path / MANIFEST
            doc = json.loads(m.read_text())
            return str(doc.get("source", "")), int(doc.get("bytes", 0)), m.stat().st_mtime
        except (OSError, ValueError):
            return "", 0, 0.0

    def usage(self) -> StoreUsage:
        return StoreUsage(self._used_bytes(), self.budget_bytes, self._table.stats["evictions"])

    # ---- eviction -----------------------------------------------------------------------------
    def _models_on_disk(self) -> list[tuple[str, int, float, bool]]:
        """(name, bytes, last use, evictable) of every model in the store."""
        out = []
        for name in self._install.store.list_models():
            path = self._install.path(name)
            if path.is_symlink():
                continue
            source, nbytes, used = self.model_info(name)
            if source:
                out.append((name, nbytes, used, True))
            else:
                out.append((name, du(path), 0.0, False))
        return out

    def _used_bytes(self) -> int:
        reserved = self._table.reserved_bytes()
        partial = sum(n for _, n in stale_partials(self.root, set(self._table.active)))
        return sum(m[1] for m in self._models_on_disk()) + reserved + partial

    def make_room(self, model: str, total: int, need: int | None = None) -> None:
        """Room for ``model``: its ``total`` bytes under the budget, and the ``need`` bytes it
        has yet to write (``total`` less what an earlier attempt left) above the disk reserve."""
        need = total if need is None else need
        table, install = self._table, self._install
        with table.lock:
            while True:
                models = self._models_on_disk()
                reserved = table.reserved_bytes(other_than=model)
                partials = stale_partials(self.root, set(table.active))
                used = sum(m[1] for m in models) + reserved + sum(n for _, n in partials)
                space = self.disk_space(self.root)
                usable = space.free - reserved - self.reserve.bytes_for(space.total)
                over_budget = self.budget_bytes and used + total > self.budget_bytes
                if not over_budget and need <= usable:
                    return
                if partials:  # the cheapest room: downloads nobody is resuming now
                    path, nbytes = partials[0]
                    remove(path)
                    log.info(
                        "event=store_partial_removed dir=%s bytes=%d for=%s", path, nbytes, model
                    )
                    continue
                busy = self._in_use() | set(self._pins) | set(table.active)
                cold = sorted((m for m in models if m[3] and m[0] not in busy), key=lambda m: m[2])
                if not cold:
                    held = sorted(m[0] for m in models if m[0] in busy) or ["none"]
                    if over_budget:
                        limit = (
                            f"the store budget {format_size(self.budget_bytes)} "
                            f"({format_size(used)} used) allows"
                        )
                        fix = "raise --store-budget (agent.modelCache.budget) or free disk"
                    else:
                        limit = (
                            f"the disk allows: {format_size(space.free)} free of "
                            f"{format_size(space.total)}, keeping a "
                            f"{self.reserve.describe(space.total)} (--store-reserve), "
                            f"{format_size(max(usable, 0))} usable"
                        )
                        fix = "free disk or lower --store-reserve (agent.modelCache.reserve)"
                    raise FetchFailed(
                        "RESOURCE_EXHAUSTED",
                        f"{model} needs {format_size(need if not over_budget else total)}, more "
                        f"than {limit}, and no cold model can be evicted (in use, pinned or "
                        f"fetching: {', '.join(held)}; pre-filled models are never evicted); "
                        f"{fix}",
                    )
                victim = cold[0]
                with install.core_lock:
                    if victim[0] in self._in_use():  # became busy meanwhile: look again
                        continue
                    trash = install.retire(victim[0])
                    install.store.forget(victim[0])
                install.discard(trash, wait=True)  # its space counts only once it is gone
                table.stats["evictions"] += 1
                table.generation += 1
                log.info(
                    "event=store_evicted model=%s bytes=%d last_used=%.0f for=%s",
                    victim[0],
                    victim[1],
                    victim[2],
                    model,
                )
