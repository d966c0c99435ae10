"""The fetcher's staging directory: files created without following links, and partial downloads
kept so that the next attempt resumes them.

A model's files land in ``<store>/.warmserve-staging/<dir>/`` (``<dir>``: the model's store
directory name, :func:`warmserve.modelref.store_dirname`, so one model, one staging directory).
The directory outlives a failed fetch: :data:`PARTIAL` records the source, the revision and each
listed file's identity (size, checksums, version), and the next fetch of the model keeps the
files whose identity is unchanged and resumes each where it stopped (sources stream from an
offset).  Everything else there is removed first: another source or revision, a changed file,
anything not listed.  Partial directories of models not being fetched are the first thing
removed when a fetch needs room (:mod:`~warmserve_agent.sources.store_budget`).

Every path written comes from a remote listing.  Each is checked
(:func:`~warmserve_agent.sources.base.check_remote_path`), then opened one component at a time
from a directory descriptor with ``O_NOFOLLOW`` (``O_DIRECTORY`` for directories, ``O_EXCL`` for
a new file), so that no link, planted or raced, can redirect a write out of the staging
directory; the resolved path is checked to lie under it as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from warmserve.modelref import store_dirname
from warmserve_agent.sources.base import Listing, RemoteFile, SourceError, check_remote_path
from warmserve_agent.sources.fetch_records import STAGING, du

PARTIAL = ".warmserve-partial.json"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def staging_dir(root: Path, model: str) -> Path:
    """Where ``model``'s files are staged in the store at ``root``."""
    return root / STAGING / store_dirname(model)


def _identity(f: RemoteFile) -> list[object]:
    return [f.size, f.sha256, f.git_sha1, f.md5, f.etag]


def prepare(staging: Path, source: str, listing: Listing) -> int:
    """Make ``staging`` hold only what a download of ``listing`` from ``source`` can resume
    (module docstring); the bytes kept."""
    staging.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    record: dict = {}
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((staging / PARTIAL).read_text())
    if staging.is_symlink() or (
        staging.exists()
        and (record.get("source") != source or record.get("revision") != listing.revision)
    ):
        _remove(staging)
    staging.mkdir(mode=0o700, exist_ok=True)
    before = record.get("files", {}) if isinstance(record.get("files"), dict) else {}
    keep = {f.path: f for f in listing.files if before.get(f.path) == _identity(f)}
    for dirpath, dirnames, filenames in os.walk(staging, topdown=False):
        for name in filenames + dirnames:
            p = Path(dirpath) / name
            rel = p.relative_to(staging).as_posix()
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(OSError):
                    p.rmdir()  # only if empty: it holds kept files otherwise
                continue
            f = keep.get(rel)
            if f is None or not stat.S_ISREG(st.st_mode) or st.st_size > f.size:
                p.unlink()
    doc = {
        "source": source,
        "revision": listing.revision,
        "files": {f.path: _identity(f) for f in listing.files},
    }
    (staging / PARTIAL).write_text(json.dumps(doc))
    return du(staging) - (staging / PARTIAL).stat().st_size


def finish(staging: Path) -> None:
    """The download is complete: the partial record goes before the directory is installed."""
    (staging / PARTIAL).unlink(missing_ok=True)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def open_staged(staging: Path, rel: str) -> tuple[BinaryIO, int]:
    """(the file for listed path ``rel`` under ``staging``, open for writing at its end; the
    bytes already in it).  SourceError when the path is not safe or a component is a link."""
    check_remote_path(rel, f"staging {rel!r}")
    parts = rel.split("/")
    dfd = os.open(staging, _DIR_FLAGS)
    try:
        for i, seg in enumerate(parts[:-1]):
            with contextlib.suppress(FileExistsError):
                os.mkdir(seg, 0o700, dir_fd=dfd)
            try:
                nfd = os.open(seg, _DIR_FLAGS, dir_fd=dfd)
            except OSError as exc:  # ELOOP, ENOTDIR: a link or a file where a directory goes
                raise SourceError(
                    f"refusing to write {rel!r}: {'/'.join(parts[: i + 1])} in the staging "
                    f"directory is not a plain directory ({exc.strerror})"
                ) from None
            os.close(dfd)
            dfd = nfd
        try:
            try:
                fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                fd = os.open(parts[-1], _FILE_FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
        except OSError as exc:
            raise SourceError(
                f"refusing to write {rel!r} in the staging directory: {exc.strerror}"
            ) from None
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    real = os.path.realpath(staging / rel)
    base = os.path.realpath(staging)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or os.path.commonpath([base, real]) != base:
        os.close(fd)
        raise SourceError(f"refusing to write {rel!r}: not a plain file inside the staging area")
    os.set_blocking(fd, True)
    os.lseek(fd, 0, os.SEEK_END)
    return os.fdopen(fd, "wb"), st.st_size


def stale_partials(root: Path, active: set[str]) -> list[tuple[Path, int]]:
    """(directory, bytes) of the partial downloads of models not being fetched (``active``:
    models being fetched), oldest first."""
    base = root / STAGING
    keep = {store_dirname(m) for m in active}
    out = []
    with contextlib.suppress(OSError):
        for p in base.iterdir():
            if p.name not in keep:
                with contextlib.suppress(OSError):
                    out.append((p, du(p), p.lstat().st_mtime))
    return [(p, n) for p, n, _ in sorted(out, key=lambda x: x[2])]


def remove(path: Path) -> None:
    """Delete a partial download (a directory under the staging area)."""
    _remove(path)
