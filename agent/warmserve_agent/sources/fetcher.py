"""Fill the weight store on demand: coalesced, verified, retried fetches under a disk budget.

``ModelFetcher.ensure(model, uri)`` makes model ``model`` present in the store, fetching it from
``uri`` when it is missing.  For every scheme alike:

* **Coalescing.** One fetch per model at a time; a second caller for the same model and source
  joins it (another source while one runs is refused: FAILED_PRECONDITION).
* **Staging.** Files land in ``<store>/.warmserve-staging/<id>/`` and the finished directory is
  renamed into ``<store>/<model>`` in one step, so the store never shows a half-fetched model;
  leftovers of a crashed agent are removed at start.
* **Checks.** Every file is checked against the listing (size, and the sha256 / git blob id /
  MD5 the source publishes); a file that fails is deleted and fetched again, up to ``attempts``
  times with exponential backoff; then the fetch fails naming the file and both checksums.  The
  safetensors headers must parse and fit their files before the model is installed.
* **Budget (LRU).** Before downloading, room is made under ``budget_bytes`` (the whole store:
  fetched and pre-filled models) and the disk's free space: the least recently used *fetched*
  models are evicted first.  A model with a slot or an instance, being fetched or pinned by a
  call in progress is never evicted; pre-filled models (no manifest) and linked ones are never
  evicted.  If that is not enough the fetch fails with RESOURCE_EXHAUSTED, saying what is in use.
* **Progress.** Bytes on disk are sampled every ``sample_s``; the rate (EWMA) gives an ETA.  Each
  change is published through ``on_change`` (the agent's Watch stream and Describe) and metrics.

A fetched model carries ``.warmserve-source.json`` (its source, revision and file list); its
modification time is the model's last use (``touch``), which survives agent restarts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from warmserve.units import format_size
from warmserve_agent.sources import REGISTRY, Registry, SourceError, SourceSettings, open_source
from warmserve_agent.sources.base import Listing, ModelFacts, RemoteFile, inspect, verify_file
from warmserve_agent.store import (
    StoreError,
    WeightStore,
    config_num_layers,
    read_safetensors_header,
)

log = logging.getLogger("warmserve.agent.fetch")

MANIFEST = ".warmserve-source.json"
RATE_WINDOW_S = 5.0
MIN_RATE_SPAN_S = 2.0
STAGING = ".warmserve-staging"
TRASH = ".warmserve-trash"


class FetchState(StrEnum):
    LISTING = "listing"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    DONE = "done"
    FAILED = "failed"


class FetchFailed(Exception):
    """A fetch that did not produce the model; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class FetchStatus:
    model: str
    source: str
    state: FetchState
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_per_s: float = 0.0
    eta_s: float = 0.0
    attempt: int = 0
    message: str = ""
    started_unix: float = 0.0
    finished_unix: float = 0.0


@dataclass
class Fetch:
    """One fetch in progress (or finished); callers ``wait`` on it."""

    status: FetchStatus
    staging: Path | None = None
    download_started: float = 0.0
    error: FetchFailed | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


@dataclass(frozen=True, slots=True)
class StoreUsage:
    used_bytes: int
    budget_bytes: int
    evictions: int


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


class ModelFetcher:
    def __init__(
        self,
        store: WeightStore,
        settings: SourceSettings,
        *,
        lock: threading.RLock,
        in_use: Callable[[], set[str]],
        on_change: Callable[[FetchStatus], None] = lambda s: None,
        budget_bytes: int = 0,
        attempts: int = 3,
        backoff_s: float = 1.0,
        parallel: int = 4,
        sample_s: float = 1.0,
        registry: Registry = REGISTRY,
    ) -> None:
        self.store = store
        self.root = store.root
        self.settings = settings
        self.core_lock = lock  # the node core's lock: eviction vs. prewarm admission
        self.in_use = in_use
        self.on_change = on_change
        self.budget_bytes = budget_bytes
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.parallel = max(1, parallel)
        self.sample_s = sample_s
        self.registry = registry
        self._lock = threading.RLock()
        self._active: dict[str, Fetch] = {}
        self._recent: dict[str, Fetch] = {}  # finished, newest last; for status
        self._pins: Counter[str] = Counter()
        self._facts: dict[tuple[str, str], tuple[float, ModelFacts]] = {}
        self._stop = threading.Event()
        self.stats: Counter[str] = Counter()  # bytes, ok, failed, retries:<reason>, evictions
        self.generation = 0  # changes when the store's content changes (fetch end, eviction)
        for d in (STAGING, TRASH):
            shutil.rmtree(self.root / d, ignore_errors=True)  # a crashed agent's leftovers
        self._sampler = threading.Thread(
            target=self._sample_loop, daemon=True, name="fetch-progress"
        )
        self._sampler.start()

    # ---- public API -----------------------------------------------------------------------
    def ensure(self, model: str, uri: str) -> Fetch:
        """The (possibly finished) fetch that makes ``model`` present (see module docstring)."""
        path = self._path(model)
        with self._lock:
            cur = self._active.get(model)
            if cur is not None:
                if cur.status.source != uri:
                    raise FetchFailed(
                        "FAILED_PRECONDITION",
                        f"{model} is being fetched from {cur.status.source}; it cannot be fetched "
                        f"from {uri} at the same time",
                    )
                return cur
            have = self._present_source(path)
            if have is not None and (have == "" or have == uri or self._same_link(path, uri)):
                self.touch(model)
                return Fetch(FetchStatus(model, uri, FetchState.DONE), done=_set_event())
            if have is not None and model in self.in_use():
                raise FetchFailed(
                    "FAILED_PRECONDITION",
                    f"{model} in this node's store came from {have}, not {uri}, and it is in use "
                    "(slot or instance); evict them before changing its source",
                )
            fetch = Fetch(FetchStatus(model, uri, FetchState.LISTING, started_unix=time.time()))
            self._active[model] = fetch
        threading.Thread(
            target=self._run, args=(fetch,), daemon=True, name=f"fetch:{model}"
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

    def touch(self, model: str) -> None:
        """Mark ``model`` used now (LRU order of eviction)."""
        with contextlib.suppress(OSError, StoreError):
            os.utime(self._path(model) / MANIFEST)

    @contextlib.contextmanager
    def pinned(self, model: str) -> Iterator[None]:
        """Never evict ``model`` inside this block (between a fetch and its prewarm)."""
        with self._lock:
            self._pins[model] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[model] -= 1
                if self._pins[model] <= 0:
                    del self._pins[model]

    def statuses(self) -> list[FetchStatus]:
        """Fetches in progress, then the last finished ones (done in the last minute; failed)."""
        now = time.time()
        with self._lock:
            act = [f.status for f in self._active.values()]
            old = [
                f.status
                for f in self._recent.values()
                if f.status.state == FetchState.FAILED or now - f.status.finished_unix < 60
            ]
        return act + old

    def model_info(self, model: str) -> tuple[str, int, float]:
        """(source, bytes on disk, last use) of a store model; ("", 0, 0) when unmanaged."""
        path = self._path(model)
        if path.is_symlink():
            return os.readlink(path), 0, 0.0
        try:
            m = path / MANIFEST
            doc = json.loads(m.read_text())
            return str(doc.get("source", "")), int(doc.get("bytes", 0)), m.stat().st_mtime
        except (OSError, ValueError):
            return "", 0, 0.0

    def usage(self) -> StoreUsage:
        return StoreUsage(self._used_bytes(), self.budget_bytes, self.stats["evictions"])

    def close(self) -> None:
        self._stop.set()

    # ---- the fetch ------------------------------------------------------------------------
    def _run(self, fetch: Fetch) -> None:
        model, uri = fetch.status.model, fetch.status.source
        err: FetchFailed | None = None
        total = 0
        try:
            src = open_source(uri, self.settings, self.registry)
            listing = self._retrying(fetch, src.list_files)
            total = listing.total_bytes
            if src.in_place:
                self._check_model_dir(src.location(), listing, uri)
                self._install_link(model, src.location())
            else:
                self._download(fetch, src, listing)
        except Exception as exc:  # every failure must finish the fetch, or callers wait forever
            if isinstance(exc, FetchFailed):
                err = exc
            elif isinstance(exc, SourceError | StoreError | OSError):
                code = "UNAVAILABLE" if getattr(exc, "retryable", False) else "FAILED_PRECONDITION"
                err = FetchFailed(code, str(exc))
            else:
                log.exception("event=model_fetch_bug model=%s", model)
                err = FetchFailed("INTERNAL", f"fetching {model} failed: {exc!r}")
        finally:
            if fetch.staging is not None:
                shutil.rmtree(fetch.staging, ignore_errors=True)
                fetch.staging = None
        if err is None:
            self.stats["ok"] += 1
            log.info(
                "event=model_fetched model=%s source=%s bytes=%d seconds=%.1f",
                model,
                uri,
                total,
                time.time() - fetch.status.started_unix,
            )
            self._finish(fetch, FetchState.DONE, "")
        else:
            fetch.error = err
            self.stats["failed"] += 1
            log.error(
                "event=model_fetch_failed model=%s source=%s error=%r", model, uri, err.message
            )
            self._finish(fetch, FetchState.FAILED, err.message)

    def _retrying(self, fetch: Fetch, fn: Callable[[], Listing]) -> Listing:
        for attempt in range(1, self.attempts + 1):
            self._update(fetch, attempt=attempt)
            try:
                return fn()
            except SourceError as exc:
                if not exc.retryable or attempt == self.attempts:
                    raise
                self.stats["retries:error"] += 1
                self._sleep(attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _download(self, fetch: Fetch, src: object, listing: Listing) -> None:
        model = fetch.status.model
        self._update(fetch, state=FetchState.DOWNLOADING, bytes_total=listing.total_bytes)
        self._make_room(model, listing.total_bytes)
        staging = self.root / STAGING / uuid.uuid4().hex
        staging.mkdir(parents=True)
        fetch.download_started = time.time()
        fetch.staging = staging
        pending = list(listing.files)
        problems: list[str] = []
        for attempt in range(1, self.attempts + 1):
            self._update(fetch, attempt=attempt, state=FetchState.DOWNLOADING)
            with ThreadPoolExecutor(min(self.parallel, len(pending))) as ex:
                results = list(ex.map(lambda f: self._get_one(src, f, staging, listing), pending))
            problems = [p for p in results if p]
            pending = [f for f, p in zip(pending, results, strict=True) if p]
            if not pending:
                break
            log.warning(
                "event=model_fetch_retry model=%s attempt=%d/%d problems=%r",
                model,
                attempt,
                self.attempts,
                problems[:3],
            )
            if attempt < self.attempts:
                self._sleep(attempt)
        else:
            raise FetchFailed(
                "UNAVAILABLE",
                f"fetching {model} from {fetch.status.source} failed after {self.attempts} "
                f"attempts: {'; '.join(problems[:3])}",
            )
        self._update(fetch, state=FetchState.VERIFYING)
        self._check_model_dir(staging, listing, fetch.status.source)
        (staging / MANIFEST).write_text(
            json.dumps(
                {
                    "source": fetch.status.source,
                    "revision": listing.revision,
                    "bytes": listing.total_bytes,
                    "fetched_unix": time.time(),
                    "files": [
                        {
                            "path": f.path,
                            "size": f.size,
                            "sha256": f.sha256,
                            "git_sha1": f.git_sha1,
                            "md5": f.md5,
                        }
                        for f in listing.files
                    ],
                },
                indent=1,
            )
        )
        self._install_dir(model, staging)
        fetch.staging = None

    def _get_one(self, src: object, f: RemoteFile, staging: Path, listing: Listing) -> str:
        """Download and check one file: "" when good, else what was wrong (file removed)."""
        dest = staging / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            src.download(f, dest, listing)  # type: ignore[attr-defined]
        except SourceError as exc:
            if not exc.retryable:
                raise
            self.stats["retries:checksum" if exc.checksum else "retries:error"] += 1
            dest.unlink(missing_ok=True)
            return str(exc)
        self.stats["bytes"] += dest.stat().st_size if dest.exists() else 0
        problem = verify_file(dest, f)
        if problem:
            kind = problem.removeprefix(f"{f.path}: ").split(" ", 1)[0]
            self.stats["retries:size" if kind == "size" else "retries:checksum"] += 1
            log.warning(
                "event=model_file_rejected file=%s problem=%r checks=%s",
                f.path,
                problem,
                f.checks(),
            )
            dest.unlink(missing_ok=True)
        return problem

    @staticmethod
    def _check_model_dir(path: Path, listing: Listing, uri: str) -> None:
        """config.json declares layers; every safetensors header parses and fits its file."""
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise FetchFailed("FAILED_PRECONDITION", f"{uri}: bad config.json: {exc}") from None
        if config_num_layers(cfg) is None:
            raise FetchFailed(
                "FAILED_PRECONDITION", f"{uri}: config.json needs num_hidden_layers >= 1"
            )
        for f in listing.files:
            if not f.path.endswith(".safetensors"):
                continue
            p = path / f.path
            start, header = read_safetensors_header(p)
            size = p.stat().st_size
            for name, meta in header.items():
                b, e = meta.get("data_offsets", (0, -1))
                if not (0 <= b <= e and start + e <= size):
                    raise FetchFailed(
                        "FAILED_PRECONDITION",
                        f"{uri}: {f.path}: tensor {name} lies outside the file (corrupt or "
                        "truncated)",
                    )

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
            self._retire(model)
            os.rename(staging, final)
            self.store.forget(model)

    def _install_link(self, model: str, target: Path) -> None:
        final = self._path(model)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.link"
        os.symlink(target, tmp)
        with self.core_lock:
            try:
                self._check_replaceable(model)
            except FetchFailed:
                tmp.unlink()
                raise
            self._retire(model)
            os.rename(tmp, final)
            self.store.forget(model)

    def _retire(self, model: str) -> None:
        """Move the current copy of ``model`` (if any) out of the store; caller holds core_lock."""
        path = self._path(model)
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            trash = self.root / TRASH / uuid.uuid4().hex
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, trash)
            threading.Thread(target=shutil.rmtree, args=(trash, True), daemon=True).start()

    # ---- budget -----------------------------------------------------------------------------
    def _models_on_disk(self) -> list[tuple[str, int, float, bool]]:
        """(name, bytes, last use, evictable) of every model in the store."""
        out = []
        for name in self.store.list_models():
            path = self._path(name)
            if path.is_symlink():
                continue
            source, nbytes, used = self.model_info(name)
            if source:
                out.append((name, nbytes, used, True))
            else:
                out.append((name, _du(path), 0.0, False))
        return out

    def _used_bytes(self) -> int:
        reserved = sum(f.status.bytes_total for f in self._active.values())
        return sum(m[1] for m in self._models_on_disk()) + reserved

    def _make_room(self, model: str, need: int) -> None:
        with self._lock:
            while True:
                models = self._models_on_disk()
                reserved = sum(f.status.bytes_total for m, f in self._active.items() if m != model)
                used = sum(m[1] for m in models) + reserved
                free = shutil.disk_usage(self.root).free - reserved
                over_budget = self.budget_bytes and used + need > self.budget_bytes
                if not over_budget and need <= free:
                    return
                busy = self.in_use() | set(self._pins) | set(self._active)
                cold = sorted((m for m in models if m[3] and m[0] not in busy), key=lambda m: m[2])
                if not cold:
                    held = sorted(m[0] for m in models if m[0] in busy) or ["none"]
                    limit = (
                        f"the store budget {format_size(self.budget_bytes)} "
                        f"({format_size(used)} used)"
                        if over_budget
                        else f"the disk's free space ({format_size(max(free, 0))})"
                    )
                    raise FetchFailed(
                        "RESOURCE_EXHAUSTED",
                        f"{model} needs {format_size(need)}, more than {limit} allows, and no "
                        "cold model can be evicted (in use, pinned or fetching: "
                        f"{', '.join(held)}; pre-filled models are never evicted); raise "
                        "--store-budget or free disk",
                    )
                victim = cold[0]
                with self.core_lock:
                    if victim[0] in self.in_use():  # became busy meanwhile: look again
                        continue
                    self._retire(victim[0])
                    self.store.forget(victim[0])
                self.stats["evictions"] += 1
                self.generation += 1
                log.info(
                    "event=store_evicted model=%s bytes=%d last_used=%.0f for=%s",
                    victim[0],
                    victim[1],
                    victim[2],
                    model,
                )

    # ---- progress ---------------------------------------------------------------------------
    def _update(self, fetch: Fetch, **kw: object) -> None:
        with self._lock:
            fetch.status = replace(fetch.status, **kw)  # type: ignore[arg-type]
        self.on_change(fetch.status)

    def _finish(self, fetch: Fetch, state: FetchState, message: str) -> None:
        st = fetch.status
        done = st.bytes_total if state == FetchState.DONE else st.bytes_done
        with self._lock:
            fetch.status = replace(
                st,
                state=state,
                message=message,
                bytes_done=done,
                eta_s=0.0,
                finished_unix=time.time(),
            )
            self._active.pop(st.model, None)
            self._recent.pop(st.model, None)
            self.generation += 1
            self._recent[st.model] = fetch
            while len(self._recent) > 20:
                self._recent.pop(next(iter(self._recent)))
        fetch.done.set()
        self.on_change(fetch.status)

    def _sample_loop(self) -> None:
        """Bytes on disk of each download; the rate over the last ``RATE_WINDOW_S`` gives the
        ETA (a sliding window: it follows a slowing or recovering source within seconds).

        Progress never goes back within one staging directory: a walk racing the hub client's
        rename of a finished file out of its temporary name (or a rejected file being deleted)
        can see fewer bytes than the last walk did; progress then holds until the disk catches
        up, as a progress bar should.  A new attempt (new staging directory) starts from 0."""
        samples: dict[int, tuple[Path, deque[tuple[float, int]]]] = {}
        while not self._stop.wait(self.sample_s):
            with self._lock:
                active = [f for f in self._active.values() if f.staging is not None]
            for key in set(samples) - {id(f) for f in active}:
                del samples[key]
            for f in active:
                if f.status.state != FetchState.DOWNLOADING or f.staging is None:
                    continue
                staging = f.staging
                now, done = time.time(), min(_du(staging), f.status.bytes_total)
                seen = samples.get(id(f))
                if seen is None or seen[0] != staging:
                    seen = samples[id(f)] = (staging, deque([(f.download_started, 0)]))
                win = seen[1]
                done = max(done, win[-1][1])
                win.append((now, done))
                while len(win) > 2 and now - win[1][0] >= RATE_WINDOW_S:
                    win.popleft()
                (t0, b0), (t1, b1) = win[0], win[-1]
                # 0 = unknown: no rate (nor ETA) from less than MIN_RATE_SPAN_S of samples.
                span = t1 - t0
                rate = (b1 - b0) / span if span >= MIN_RATE_SPAN_S else 0.0
                eta = (f.status.bytes_total - done) / rate if rate > 0 else 0.0
                if done != f.status.bytes_done:
                    self._update(f, bytes_done=done, bytes_per_s=rate, eta_s=eta)

    def _sleep(self, attempt: int) -> None:
        self._stop.wait(self.backoff_s * 2 ** (attempt - 1))


def _set_event() -> threading.Event:
    ev = threading.Event()
    ev.set()
    return ev
