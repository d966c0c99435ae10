"""One model fetch from start to finish: list, make room, download with retries, check, install.

:meth:`FetchDownload._run` is the body of a fetch's thread.  It lists the source (retrying a
transient error with exponential backoff), then either links an in-place source (``pvc://``,
``file://``) into the store or downloads every file in parallel into the model's staging
directory (:mod:`~warmserve_agent.sources.fetch_staging`: what an earlier attempt left there is
resumed), makes room first under the store's budget and disk reserve
(:mod:`~warmserve_agent.sources.store_budget`, :mod:`~warmserve_agent.sources.disk_reserve`),
fetches again the files that failed their checks or were cut off
(:mod:`~warmserve_agent.sources.fetch_verify`) up to ``attempts`` times, writes the manifest and
installs the model in one step (:mod:`~warmserve_agent.sources.store_install`).  A failed
fetch leaves its staging directory for the next one.  Every failure finishes the fetch with a
:class:`~warmserve_agent.sources.fetch_records.FetchFailed` (a gRPC status name and a message),
or callers would wait forever.

:class:`FetchDownload` is handed the fetcher's other parts: the install, the budget (room and the
disk guard), the file checks, the progress and the table of fetches; the fetcher holds it and
runs :meth:`FetchDownload.run` in one thread per fetch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from warmserve_agent.sources import Registry, SourceError, SourceSettings, open_source
from warmserve_agent.sources.base import Listing
from warmserve_agent.sources.fetch_progress import FetchProgress
from warmserve_agent.sources.fetch_records import (
    MANIFEST,
    Fetch,
    FetchFailed,
    FetchState,
    FetchTable,
)
from warmserve_agent.sources.fetch_staging import finish, prepare, staging_dir
from warmserve_agent.sources.fetch_verify import FileChecks
from warmserve_agent.sources.store_budget import StoreBudget
from warmserve_agent.sources.store_install import StoreInstall
from warmserve_agent.store import StoreError

log = logging.getLogger("warmserve.agent.fetch")  # one logger for the whole fetcher


class FetchDownload:
    """A fetch's thread body and its retries (see module docstring)."""

    def __init__(
        self,
        install: StoreInstall,
        budget: StoreBudget,
        checks: FileChecks,
        progress: FetchProgress,
        table: FetchTable,
        *,
        settings: SourceSettings,
        registry: Registry,
        attempts: int,
        backoff_s: float,
        parallel: int,
        stop: threading.Event,
    ) -> None:
        self._install = install
        self._budget = budget
        self._checks = checks
        self._progress = progress
        self._table = table
        self._settings = settings
        self._registry = registry
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.parallel = max(1, parallel)
        self._stop = stop

    # ---- the fetch ------------------------------------------------------------------------
    def run(self, fetch: Fetch) -> None:
        model, uri = fetch.status.model, fetch.status.source
        err: FetchFailed | None = None
        total = 0
        try:
            src = open_source(uri, self._settings, self._registry)
            listing = self._retrying(fetch, src.list_files)
            total = listing.total_bytes
            if src.in_place:
                self._checks.check_model_dir(src.location(), listing, uri)
                self._install.install_link(model, src.location(), uri)
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
            fetch.staging = None  # a failed fetch's files stay: the next one resumes them
        stats = self._table.stats
        if err is None:
            stats["ok"] += 1
            log.info(
                "event=model_fetched model=%s source=%s bytes=%d seconds=%.1f",
                model,
                uri,
                total,
                time.time() - fetch.status.started_unix,
            )
            self._progress.finish(fetch, FetchState.DONE, "")
        else:
            fetch.error = err
            stats["failed"] += 1
            log.error(
                "event=model_fetch_failed model=%s source=%s error=%r", model, uri, err.message
            )
            self._progress.finish(fetch, FetchState.FAILED, err.message)

    def _retrying(self, fetch: Fetch, fn: Callable[[], Listing]) -> Listing:
        for attempt in range(1, self.attempts + 1):
            self._progress.update(fetch, attempt=attempt)
            try:
                return fn()
            except SourceError as exc:
                if not exc.retryable or attempt == self.attempts:
                    raise
                self._table.stats["retries:error"] += 1
                self._sleep(attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _download(self, fetch: Fetch, src: object, listing: Listing) -> None:
        model = fetch.status.model
        total = listing.total_bytes
        self._progress.update(fetch, state=FetchState.DOWNLOADING, bytes_total=total)
        staging = staging_dir(self._install.root, model)
        have = prepare(staging, fetch.status.source, listing)
        need = max(total - have, 0)
        self._budget.make_room(model, total, need)
        guard = self._budget.guard(model, need)
        fetch.download_started = time.time()
        fetch.resumed_bytes = have
        fetch.staging = staging
        if have:
            log.info("event=model_fetch_resumed model=%s bytes=%d of=%d", model, have, total)
        pending = list(listing.files)
        problems: list[str] = []
        for attempt in range(1, self.attempts + 1):
            self._progress.update(fetch, attempt=attempt, state=FetchState.DOWNLOADING)
            with ThreadPoolExecutor(min(self.parallel, len(pending))) as ex:
                results = list(
                    ex.map(lambda f: self._checks.get_one(src, f, staging, listing, guard), pending)
                )
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
        self._progress.update(fetch, state=FetchState.VERIFYING)
        self._checks.check_model_dir(staging, listing, fetch.status.source)
        finish(staging)
        (staging / MANIFEST).write_text(
            json.dumps(
                {
                    "model": model,
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
        self._install.install_dir(model, staging)
        fetch.staging = None

    def _sleep(self, attempt: int) -> None:
        self._stop.wait(self.backoff_s * 2 ** (attempt - 1))
