"""Fill the weight store on demand: coalesced, verified, retried fetches under a disk budget.

``ModelFetcher.ensure(model, uri)`` makes model ``model`` present in the store, fetching it from
``uri`` when it is missing.  For every scheme alike:

* **Coalescing.** One fetch per model at a time; a second caller for the same model and source
  joins it (another source while one runs is refused: FAILED_PRECONDITION).
* **Staging.** Files land in ``<store>/.warmserve-staging/<dir>/`` and the finished directory is
  renamed into ``<store>/<dir>`` in one step (``<dir>``: the model's one store directory,
  :func:`warmserve.modelref.store_dirname`), so the store never shows a half-fetched model.  A
  listed path is never trusted: checked, then written without following links.
* **Resume.** A download cut off keeps what reached the disk: the next attempt, the next fetch
  of the same model, source and revision, or the first after an agent restart continues each
  file from there (HTTP/S3 ranged reads), and the file is checked whole at the end.
* **Checks.** Every file is checked against the listing (size, and the sha256 / git blob id /
  MD5 the source publishes); a file that fails is deleted and fetched again, up to ``attempts``
  times with exponential backoff; then the fetch fails naming the file and both checksums.  The
  safetensors headers must parse and fit their files before the model is installed.
* **Budget (LRU) and reserve.** Before downloading, room is made under ``budget_bytes`` (the
  whole store: fetched and pre-filled models) and above the disk ``reserve`` (free space a fetch
  never takes, watched during the download too): stale partial downloads go first, then the
  least recently used *fetched* models.  A model with a slot or an instance, being fetched or
  pinned by a call in progress is never evicted; pre-filled models (no manifest) and linked ones
  are never evicted.  If that is not enough the fetch fails with RESOURCE_EXHAUSTED, naming the
  numbers and what is in use.
* **Progress.** Bytes on disk are sampled every ``sample_s``; the rate (EWMA) gives an ETA.  Each
  change is published through ``on_change`` (the agent's Watch stream and Describe) and metrics.

A fetched model carries ``.warmserve-source.json`` (its source, revision and file list); its
modification time is the model's last use (``touch``), which survives agent restarts.

The fetcher holds one object per concept, each handed the others it needs (lower modules never
import upper ones; ``[tool.importlinter]`` in pyproject.toml enforces it)::

    ModelFetcher ─┬─▶ FetchDownload ─┬─▶ StoreBudget ──▶ StoreInstall ─▶ WeightStore
                  │                  ├─▶ FileChecks
                  │                  └─▶ FetchProgress ─┐
                  └──────────────────────────────────────┴─▶ FetchTable (records)

* :mod:`~warmserve_agent.sources.fetch_records`: fetch states, statuses, the failure, file
  names, and :class:`~warmserve_agent.sources.fetch_records.FetchTable`: the fetches in progress
  and finished, the store's generation and the counters, under one lock.
* :mod:`~warmserve_agent.sources.fetch_staging`: safe file creation, partial downloads kept.
* :mod:`~warmserve_agent.sources.disk_reserve`: the disk reserve, checked while writing.
* :mod:`~warmserve_agent.sources.store_install`: staging and the atomic install, retiring copies.
* :mod:`~warmserve_agent.sources.fetch_progress`: status updates, the rate sampler and ETA.
* :mod:`~warmserve_agent.sources.fetch_verify`: per-file checks and the model's check.
* :mod:`~warmserve_agent.sources.store_budget`: LRU eviction under the budget, pins, usage, and
  the guard of the disk reserve.
* :mod:`~warmserve_agent.sources.fetch_download`: one fetch's thread, retries and backoff.
* this module: :class:`ModelFetcher`, which builds them; coalescing (``ensure``), ``inspect``.

WarmServe's testbed keeps every model's weights in host memory (§6) and prewarms from there; the
store a fetch fills is warmserve's addition for clusters whose weights live in a hub, a bucket or
a volume, and its LRU budget keeps the node's disk from filling up.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable

from warmserve_agent.sources import REGISTRY, Registry, SourceError, SourceSettings, open_source
from warmserve_agent.sources.base import ModelFacts, inspect
from warmserve_agent.sources.disk_reserve import DEFAULT_RESERVE, DiskReserve, StatFn, disk_space
from warmserve_agent.sources.fetch_download import FetchDownload
from warmserve_agent.sources.fetch_progress import FetchProgress
from warmserve_agent.sources.fetch_records import (
    TRASH,
    Fetch,
    FetchFailed,
    FetchState,
    FetchStatus,
    FetchTable,
    StoreUsage,
    finished_event,
)
from warmserve_agent.sources.fetch_verify import FileChecks
from warmserve_agent.sources.store_budget import StoreBudget
from warmserve_agent.sources.store_install import StoreInstall
from warmserve_agent.store import WeightStore


class ModelFetcher:
    """The node's model fetcher (see module docstring)."""

    def __init__(
        self,
        store: WeightStore,
        settings: SourceSettings,
        *,
        lock: threading.RLock,
        in_use: Callable[[], set[str]],
        on_change: Callable[[FetchStatus], None] = lambda s: None,
        budget_bytes: int = 0,
        reserve: DiskReserve = DEFAULT_RESERVE,
        disk_space: StatFn = disk_space,
        attempts: int = 3,
        backoff_s: float = 1.0,
        parallel: int = 4,
        sample_s: float = 1.0,
        registry: Registry = REGISTRY,
    ) -> None:
        self.store = store
        self.root = store.root
        self.settings = settings
        self.registry = registry
        self.in_use = in_use
        self._stop = threading.Event()
        self._facts: dict[tuple[str, str], tuple[float, ModelFacts]] = {}
        self.table = FetchTable()
        # ``lock`` is the node core's: installation and eviction never race prewarm admission.
        self.install = StoreInstall(store, settings, registry, core_lock=lock, in_use=in_use)
        self.budget = StoreBudget(
            self.install,
            self.table,
            in_use=in_use,
            budget_bytes=budget_bytes,
            reserve=reserve,
            disk_space=disk_space,
        )
        self.progress = FetchProgress(self.table, on_change, sample_s, self._stop)
        self.download = FetchDownload(
            self.install,
            self.budget,
            FileChecks(self.table.stats),
            self.progress,
            self.table,
            settings=settings,
            registry=registry,
            attempts=attempts,
            backoff_s=backoff_s,
            parallel=parallel,
            stop=self._stop,
        )
        store.upgrade_layout()  # no nested ORG/NAME directory a model's retirement could take
        # A crashed agent's retired copies go; its partial downloads stay for the next fetch.
        shutil.rmtree(self.root / TRASH, ignore_errors=True)
        self._sampler = threading.Thread(
            target=self.progress.sample_loop, daemon=True, name="fetch-progress"
        )
        self._sampler.start()

    # ---- what the service, the metrics and tests read --------------------------------------
    @property
    def generation(self) -> int:
        """Changes when the store's content changes (fetch end, eviction)."""
        return self.table.generation

    @property
    def stats(self) -> Counter[str]:
        """bytes, ok, failed, retries:<reason>, evictions."""
        return self.table.stats

    @property
    def budget_bytes(self) -> int:
        return self.budget.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        self.budget.budget_bytes = value

    def touch(self, model: str) -> None:
        """Mark ``model`` used now (LRU order of eviction)."""
        self.budget.touch(model)

    def pinned(self, model: str) -> contextlib.AbstractContextManager[None]:
        """Never evict ``model`` inside this block (between a fetch and its prewarm)."""
        return self.budget.pinned(model)

    def model_info(self, model: str) -> tuple[str, int, float]:
        """(source, bytes on disk, last use) of a store model; ("", 0, 0) when unmanaged."""
        return self.budget.model_info(model)

    def usage(self) -> StoreUsage:
        return self.budget.usage()

    def statuses(self) -> list[FetchStatus]:
        """Fetches in progress, then the last finished ones (done in the last minute; failed)."""
        return self.table.statuses()

    # ---- public API -----------------------------------------------------------------------
    def ensure(self, model: str, uri: str) -> Fetch:
        """The (possibly finished) fetch that makes ``model`` present (see module docstring)."""
        install, table = self.install, self.table
        path = install.path(model)
        with table.lock:
            cur = table.active.get(model)
            if cur is not None:
                if cur.status.source != uri:
                    raise FetchFailed(
                        "FAILED_PRECONDITION",
                        f"{model} is being fetched from {cur.status.source}; it cannot be fetched "
                        f"from {uri} at the same time",
                    )
                return cur
            have = install.present_source(path)
            if have is not None and (have == "" or have == uri or install.same_link(path, uri)):
                self.touch(model)
                return Fetch(FetchStatus(model, uri, FetchState.DONE), done=finished_event())
            if have is not None and model in self.in_use():
                raise FetchFailed(
                    "FAILED_PRECONDITION",
                    f"{model} in this node's store came from {have}, not {uri}, and it is in use "
                    "(slot or instance); evict them before changing its source",
                )
            fetch = Fetch(FetchStatus(model, uri, FetchState.LISTING, started_unix=time.time()))
            table.active[model] = fetch
        threading.Thread(
            target=self.download.run, args=(fetch,), daemon=True, name=f"fetch:{model}"
        ).start()
        return fetch

    def inspect(self, model: str, uri: str) -> ModelFacts:
        """Layers and bytes of ``model``: from the store if present, else from its source."""
        if self.store.has(model):
            m = self.store.model(model)
            return ModelFacts(m.num_layers, m.weight_bytes, len(m.tensors), m.profile.max_batch)
        key = (model, uri)
        hit = self._facts.get(key)
        if hit is not None and time.time() - hit[0] < 600:
            return hit[1]
        try:
            facts = inspect(open_source(uri, self.settings, self.registry))
        except SourceError as exc:
            code = "UNAVAILABLE" if exc.retryable else "FAILED_PRECONDITION"
            raise FetchFailed(code, str(exc)) from None
        self._facts[key] = (time.time(), facts)
        return facts

    def close(self) -> None:
        self._stop.set()
