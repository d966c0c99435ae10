"""Progress of model fetches: status updates, finishing a fetch, and the download-rate sampler.

Bytes on disk of each download are sampled every ``sample_s``; the rate over a sliding window of
``RATE_WINDOW_S`` gives an ETA.  Every change of a fetch's status is published through
``on_change`` (the agent's Watch stream and Describe) and counted in the metrics.  A finished
fetch stays visible in :meth:`~warmserve_agent.sources.fetcher.ModelFetcher.statuses` for a while.

:class:`FetchProgress` writes the statuses into the fetcher's
:class:`~warmserve_agent.sources.fetch_records.FetchTable`; the fetcher holds it and hands it to
the download.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from warmserve_agent.sources.fetch_records import Fetch, FetchState, FetchStatus, FetchTable, du

RATE_WINDOW_S = 5.0
MIN_RATE_SPAN_S = 2.0


class FetchProgress:
    """Status updates and the sampler thread's loop (see module docstring)."""

    def __init__(
        self,
        table: FetchTable,
        on_change: Callable[[FetchStatus], None],
        sample_s: float,
        stop: threading.Event,
    ) -> None:
        self._table = table
        self._on_change = on_change
        self._sample_s = sample_s
        self._stop = stop

    # ---- progress ---------------------------------------------------------------------------
    def update(self, fetch: Fetch, **kw: object) -> None:
        with self._table.lock:
            fetch.status = replace(fetch.status, **kw)  # type: ignore[arg-type]
        self._on_change(fetch.status)

    def finish(self, fetch: Fetch, state: FetchState, message: str) -> None:
        st = fetch.status
        done = st.bytes_total if state == FetchState.DONE else st.bytes_done
        with self._table.lock:
            fetch.status = replace(
                st,
                state=state,
                message=message,
                bytes_done=done,
                eta_s=0.0,
                finished_unix=time.time(),
            )
            self._table.finished(fetch)
        fetch.done.set()
        self._on_change(fetch.status)

    def sample_loop(self) -> None:
        """Bytes on disk of each download; the rate over the last ``RATE_WINDOW_S`` gives the
        ETA (a sliding window: it follows a slowing or recovering source within seconds).

        Progress never goes back within one staging directory: a walk racing the hub client's
        rename of a finished file out of its temporary name (or a rejected file being deleted)
        can see fewer bytes than the last walk did; progress then holds until the disk catches
        up, as a progress bar should.  Bytes resumed from an earlier attempt count as done, not
        towards the rate."""
        samples: dict[int, tuple[Path, deque[tuple[float, int]]]] = {}
        while not self._stop.wait(self._sample_s):
            with self._table.lock:
                active = [f for f in self._table.active.values() if f.staging is not None]
            for key in set(samples) - {id(f) for f in active}:
                del samples[key]
            for f in active:
                if f.status.state != FetchState.DOWNLOADING or f.staging is None:
                    continue
                staging = f.staging
                now, done = time.time(), min(du(staging), f.status.bytes_total)
                seen = samples.get(id(f))
                if seen is None or seen[0] != staging:
                    seen = samples[id(f)] = (
                        staging,
                        deque([(f.download_started, min(f.resumed_bytes, done))]),
                    )
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
                    self.update(f, bytes_done=done, bytes_per_s=rate, eta_s=eta)
