"""Per-agent directories of simulated GPU memory (``/dev/shm/warmserve-<node>-<id>``), owned for the
agent's lifetime, and cleaning up after agents that died.

A directory holds one sparse file per simulated GPU; in a pod ``/dev/shm`` is an in-memory
``emptyDir`` that outlives a container restart, so a ``kill -9``-ed agent used to leave its
directory (and every byte written to it) in RAM for good.  Ownership is an ``flock`` on
``<dir>/.owner``, held until the process exits — the kernel releases it on any death, ``kill -9``
included — so at start an agent can tell a dead agent's directory (lock free) from a live one's
(lock held) without trusting pids:

* :func:`remove_stale` deletes every ``warmserve-*`` directory under the root whose lock is free
  (or that has no lock file, holds nothing but ``gpu<N>.mem`` files and is older than ``grace_s``:
  created by a version without locks, or by an agent that died between ``mkdir`` and locking),
  except those marked ``.keep``.  A directory that merely shares the prefix (another program's,
  e.g. a test control plane's etcd data once named ``warmserve-etcd.*``) is never touched.
* :meth:`MemoryDir.claim` takes a directory (refusing one a live agent holds) and drops the files a
  dead previous owner left in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
from pathlib import Path

log = logging.getLogger("warmserve.agent.shm")

PREFIX = "warmserve-"
LOCK = ".owner"
KEEP = ".keep"
_GPU_FILE = re.compile(r"gpu\d+\.mem")


def _agent_shaped(d: Path) -> bool:
    """Only simulated-GPU files (what an agent that died before locking can have left)."""
    try:
        return all(_GPU_FILE.fullmatch(e.name) and e.is_file() for e in d.iterdir())
    except OSError:
        return False


class MemoryDirBusy(RuntimeError):
    """Another live agent owns the directory."""


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive lock on ``path``, or None if a live process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _size(d: Path) -> int:
    total = 0
    for f in d.rglob("*"):
        with contextlib.suppress(OSError):
            if f.is_file():
                total += f.stat().st_blocks * 512  # what the file really holds (sparse files)
    return total


def remove_stale(root: Path, *, grace_s: float = 60.0) -> list[Path]:
    """Delete dead agents' memory directories under ``root``; returns what was removed."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for d in sorted(root.glob(PREFIX + "*")):
        if not d.is_dir() or d.is_symlink() or (d / KEEP).exists():
            continue
        lock = d / LOCK
        fd = None
        try:
            if lock.exists():
                fd = _try_lock(lock)
                if fd is None:
                    continue  # a live agent's
            elif not _agent_shaped(d):
                continue  # not an agent's memory directory: never ours to delete
            elif time.time() - d.stat().st_mtime < grace_s:
                continue  # maybe an agent between mkdir and locking
            held = _size(d)
            shutil.rmtree(d)
            removed.append(d)
            log.warning("event=stale_memory_dir_removed path=%s bytes=%d", d, held)
        except OSError as exc:  # another user's, or vanished meanwhile
            log.warning("event=stale_memory_dir_skipped path=%s err=%s", d, exc)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


class MemoryDir:
    """A memory directory this process owns until :meth:`release` (or its death)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def claim(cls, path: Path) -> MemoryDir:
        path.mkdir(parents=True, exist_ok=True)
        fd = _try_lock(path / LOCK)
        if fd is None:
            owner = (path / LOCK).read_text().strip() or "?"
            raise MemoryDirBusy(
                f"memory directory {path} is in use by another agent (pid {owner}); give each "
                "agent its own --memory-dir"
            )
        stale = [f for f in path.iterdir() if f.name.endswith(".mem")]
        for f in stale:  # a dead owner's simulated GPU memory: never reused
            f.unlink()
        if stale:
            log.warning("event=stale_memory_files_removed path=%s files=%d", path, len(stale))
        with contextlib.suppress(FileNotFoundError):
            (path / KEEP).unlink()
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(path, fd)

    def release(self, keep: bool = False) -> None:
        """Give the directory up: removed if the backend left it empty; ``keep`` marks it to
        survive other agents' cleanup (kept memory files, for debugging)."""
        if self._fd is None:
            return
        if keep:
            (self.path / KEEP).touch()
        else:
            with contextlib.suppress(FileNotFoundError):
                (self.path / LOCK).unlink()
        os.close(self._fd)
        self._fd = None
        if not keep:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only if empty
