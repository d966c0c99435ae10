"""An engine built for a prewarm slot ahead of its activation, in the process that will host it.

A pooled worker builds the engine of a slot while the slot waits (``Engine.prepare``, on a
thread: the worker keeps answering the agent, whose loader may be copying the slot's weights
through it); an ``Activate`` of that slot then only grows the KV cache and opens the endpoint
(``Engine.start``).  :class:`PreparedEngine` is that build and its outcome.  At most one exists
per process (``worker.py`` and ``engine_host.InProcessEngine`` hold one): engines such as vLLM keep
process-wide state, and the process hosts the serving engine after activation anyway.

What it costs while it waits (:attr:`PreparedReport.host_bytes`): the growth of the process's
anonymous resident memory (``RssAnon``) from before the build to after it (garbage collected and
the C heap trimmed on both sides, so freed memory does not count), less what the memory owner's
staging ring allocated meanwhile (the worker may be loading weights at the same time).  The
slot's own memory is not counted (it is the GPU's).  On a GPU a prepared engine would also hold
device memory (its CUDA context is the worker's anyway; graphs, workspaces): not measured here.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from warmserve_agent.engines.spec import EngineSpec, PreparedReport, PreparedState

log = logging.getLogger("warmserve.agent.engine")


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``): after an
    engine's teardown, so a pooled process does not keep what the engine held, and before a
    build, so the build's growth is measured rather than served from freed memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def anon_rss_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon`` of ``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PreparedEngine:
    """``engine.prepare(spec)`` running (then done) on its own thread (see module docstring).

    ``after``: threads to wait for first (engines of this process still being torn down)."""

    def __init__(
        self,
        engine: Any,
        spec: EngineSpec,
        *,
        backend: Any = None,
        after: Iterable[threading.Thread] = (),
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.slot_id = spec.slot_id
        self.key = spec.prepared_key()
        self._backend = backend
        self._report = PreparedReport(PreparedState.PREPARING)
        self.cancelled = threading.Event()  # its slot went (drop): build nothing more
        self.thread = threading.Thread(
            target=self._build, args=(tuple(after),), name=f"prepare-{spec.slot_id}", daemon=True
        )
        self.thread.start()

    def _staging(self) -> int:
        if self._backend is None or not hasattr(self._backend, "staging_bytes"):
            return 0
        try:
            return int(self._backend.staging_bytes(self.spec.regions[0].gpu))
        except Exception:  # no ring yet, or no such GPU here
            return 0

    def _build(self, after: tuple[threading.Thread, ...]) -> None:
        for t in after:  # a drop meanwhile does not wait for them: it builds nothing
            while t.is_alive() and not self.cancelled.is_set():
                t.join(0.05)
        if self.cancelled.is_set():  # the slot went while the engine before it was torn down
            self._cancel(0.0, "before its build")
            return
        gc.collect()
        trim_heap()
        rss0, ring0, t0 = anon_rss_bytes(), self._staging(), time.perf_counter()
        try:
            self.engine.prepare(self.spec)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.engine.stop()
            if self.cancelled.is_set():  # failed over a slot that went meanwhile: expected
                self._cancel(time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
                return
            self._report = PreparedReport(
                PreparedState.FAILED, time.perf_counter() - t0, 0, f"{type(exc).__name__}: {exc}"
            )
            log.warning(
                "event=engine_prepare_failed slot=%s engine=%s err=%s",
                self.slot_id,
                self.spec.engine,
                exc,
            )
            return
        seconds = time.perf_counter() - t0
        gc.collect()  # what the build freed is no cost of the engine while it waits
        trim_heap()
        cost = anon_rss_bytes() - rss0 - (self._staging() - ring0)
        self._report = PreparedReport(PreparedState.READY, seconds, max(0, cost), "")
        log.info(
            "event=engine_prepared slot=%s engine=%s seconds=%.3f host_bytes=%d",
            self.slot_id,
            self.spec.engine,
            self._report.seconds,
            self._report.host_bytes,
        )

    def _cancel(self, seconds: float, why: str) -> None:
        if seconds:  # what a build cut short left behind goes back to the system
            gc.collect()
            trim_heap()
        self._report = PreparedReport(
            PreparedState.FAILED, seconds, 0, f"cancelled: its slot went ({why})"
        )
        log.info(
            "event=engine_prepare_cancelled slot=%s engine=%s seconds=%.3f why=%s",
            self.slot_id,
            self.spec.engine,
            seconds,
            why,
        )

    def report(self, wait_s: float = 0.0) -> PreparedReport:
        """Its state, after waiting up to ``wait_s`` for the build to finish."""
        if wait_s > 0:
            self.thread.join(wait_s)
        return self._report

    def claim(self, spec: EngineSpec) -> Any:
        """The engine for an activation of ``spec`` once built, or None (build failed, or built
        for other arguments: then it is stopped here)."""
        self.thread.join()
        if self._report.state == PreparedState.READY and spec.prepared_key() == self.key:
            return self.engine
        if self._report.state == PreparedState.READY:
            with contextlib.suppress(Exception):
                self.engine.stop()
        return None

    def drop(self) -> threading.Thread:
        """Tear it down in the background; returns the thread doing it, which anything
        building in this process must wait for.  A build not begun yet (waiting for ``after``)
        never begins; one under way cannot be interrupted: it ends (a failure over the slot
        that went is no error) and is stopped."""
        self.cancelled.set()

        def stop() -> None:
            self.thread.join()
            if self._report.state == PreparedState.READY:
                with contextlib.suppress(Exception):
                    self.engine.stop()
                gc.collect()
                trim_heap()

        t = threading.Thread(target=stop, name=f"drop-{self.slot_id}", daemon=True)
        t.start()
        return t
