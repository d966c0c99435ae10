"""Bounded per-window buffers for the streaming predictors (``warm``, its peak calibration)."""

from __future__ import annotations

import numpy as np


class Tail:
    """The last ``keep`` values of an append-only per-window series, addressed by window index.

    Bounded memory for streaming state: the buffer holds at most ``2 * keep + 16`` values and
    drops its head when full (amortised O(1) per append).
    """

    __slots__ = ("_buf", "_keep", "_size", "_start")

    def __init__(self, keep: int) -> None:
        self._keep = max(int(keep), 1)
        self._buf = np.zeros(2 * self._keep + 16)
        self._start = 0  # window index of _buf[0]
        self._size = 0

    @property
    def end(self) -> int:
        """Index of the next window to append (= windows appended so far)."""
        return self._start + self._size

    def append(self, value: float) -> None:
        if self._size == self._buf.size:
            drop = self._size - self._keep
            self._buf[: self._keep] = self._buf[drop : self._size]
            self._start += drop
            self._size = self._keep
        self._buf[self._size] = value
        self._size += 1

    def get(self, idx: np.ndarray) -> np.ndarray:
        """Values at window indices ``idx``; each must be one of the last ``keep`` appended."""
        if idx.size and (int(idx.min()) < self.end - self._keep or int(idx.max()) >= self.end):
            raise IndexError("Tail.get: window index outside the kept range")
        return self._buf[idx - self._start]

    def last(self, n: int) -> np.ndarray:
        """The last ``min(n, keep, appended)`` values, oldest first (a read-only view)."""
        n = min(n, self._keep, self._size)
        view = self._buf[self._size - n : self._size]
        view.flags.writeable = False
        return view
