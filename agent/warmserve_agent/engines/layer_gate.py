"""Per-layer readiness: a partially prewarmed model serves before its last layer lands (§4).

The agent's loader keeps copying the missing layers into the slot while the instance serves and
announces each one with ``Engine.layers_ready(n)``.  A :class:`LayerGate` holds that count; an
engine's computation that needs layer ``i`` waits on ``gate.wait(i + 1)`` only, so a request's
first layers run while later ones are still being copied, and the first token comes as soon as
the last layer lands (instead of after the whole model was resident *and* the request started).

Thread-safe: the engine's compute thread waits, the thread delivering ``layers_ready`` advances.
``close()`` wakes every waiter with :class:`GateClosed` (the engine is stopping).
"""

from __future__ import annotations

import threading


class GateClosed(RuntimeError):
    """The engine stopped while a computation waited for a layer."""


class LayerGate:
    """How many of a model's ``total`` layers are resident (see module docstring)."""

    def __init__(self, total: int, resident: int = 0) -> None:
        self.total = total
        self._resident = min(max(0, resident), total)
        self._cond = threading.Condition()
        self._closed = False
        self.waited: list[int] = []  # the layer counts computations had to wait for (tests)

    @property
    def resident(self) -> int:
        return self._resident

    @property
    def complete(self) -> bool:
        return self._resident >= self.total

    def advance(self, n: int) -> None:
        """Layers ``[0, n)`` are resident now (never goes back)."""
        with self._cond:
            if n > self._resident:
                self._resident = min(n, self.total)
                self._cond.notify_all()

    def wait(self, need: int, timeout_s: float | None = None) -> None:
        """Return once ``need`` layers are resident; raise :class:`GateClosed` if the engine
        stops first, ``TimeoutError`` after ``timeout_s``."""
        if self._resident >= need:  # the common case after the load: no lock
            return
        with self._cond:
            if len(self.waited) < 10_000:
                self.waited.append(need)
            ok = self._cond.wait_for(lambda: self._resident >= need or self._closed, timeout_s)
            if self._closed and self._resident < need:
                raise GateClosed(f"the engine stopped while waiting for layer {need - 1}")
            if not ok:
                raise TimeoutError(f"layer {need - 1} did not become resident in {timeout_s} s")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
