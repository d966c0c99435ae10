"""``pvc://CLAIM[/PATH]`` and ``file:///PATH``: model directories the agent can already read.

Both are *in place*: the store links ``<store>/<model>`` to the directory instead of copying it
(KubeAI mounts a ``pvc://`` volume into the engine pod the same way), so they use no cache
budget and are never evicted.  The fetcher still checks that the directory is a model (a
config.json, safetensors whose headers parse and fit the files).

* ``pvc://CLAIM/PATH`` is ``<--pvc-root>/CLAIM/PATH``: the chart mounts every claim listed in
  ``agent.modelSources.pvcs`` read-only at ``/mnt/warmserve/pvc/<claim>`` (the claim must allow
  many readers, ReadOnlyMany/ReadWriteMany, as every GPU node mounts it).
* ``file:///PATH`` must lie under an ``--allow-path`` root (the chart's
  ``agent.modelSources.hostPaths``, mounted read-only at the same path); anything else is
  refused, so a ModelDeployment cannot make the agent read arbitrary files (its token, keys).
* **Links inside the model** are confined to the model's directory (resolved): a link whose
  target resolves outside it (``/etc``, the agent's keys, another model, elsewhere on the claim)
  makes the source refused, naming the link and where it points.  Links that stay inside are
  allowed (a shard shared by two names costs nothing and reads nothing new); a linked directory
  is checked but not walked (no loops).  The store checks again whenever it reads a model's
  files (:func:`warmserve_agent.store.confined`), since a tenant who can write the volume could
  swap a file for a link after the fetch.
"""

from __future__ import annotations

import os
from pathlib import Path

from warmserve.modelref import FileRef, PvcRef
from warmserve_agent.sources.base import Listing, RemoteFile, SourceError, SourceSettings, select
from warmserve_agent.store import StoreError, confined


class DirectorySource:
    in_place = True

    def __init__(self, root: Path, uri: str, *, confine_to: Path) -> None:
        self.uri = uri
        # Resolve symlinks before the containment check, so a link cannot point outside.
        real = Path(os.path.realpath(root))
        base = Path(os.path.realpath(confine_to))
        if real != base and base not in real.parents:
            raise SourceError(f"{uri}: resolves to {real}, outside {base}")
        self.root = real

    def list_files(self) -> Listing:
        if not self.root.is_dir():
            raise SourceError(f"{self.uri}: {self.root} is not a directory on this node")
        files = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:  # every link, hidden ones too, stays inside
                p = Path(dirpath) / name
                if p.is_symlink():
                    self._inside(p)
            dirnames[:] = [
                d
                for d in dirnames
                if not d.startswith(".") and not (Path(dirpath) / d).is_symlink()
            ]
            for name in filenames:
                p = Path(dirpath) / name
                try:
                    files.append(RemoteFile(p.relative_to(self.root).as_posix(), p.stat().st_size))
                except OSError as exc:
                    raise SourceError(f"{self.uri}: cannot read {p}: {exc}") from None
        return Listing(select(files, self.uri))

    def _inside(self, p: Path) -> Path:
        try:
            return confined(self.root, p)
        except StoreError:
            raise SourceError(
                f"{self.uri}: {p.relative_to(self.root)} links to {os.path.realpath(p)}, "
                f"outside the model's directory {self.root}: links may only point inside it"
            ) from None

    def download(self, f: RemoteFile, dest: Path, listing: Listing) -> None:
        raise NotImplementedError("in-place sources are linked, not copied")

    def read_range(self, path: str, start: int, length: int, listing: Listing) -> bytes:
        try:
            with open(self._inside(self.root / path), "rb") as fh:
                fh.seek(start)
                return fh.read(length)
        except OSError as exc:
            raise SourceError(f"{self.uri}: cannot read {path}: {exc}") from None

    def location(self) -> Path:
        return self.root


def pvc_source(ref: PvcRef, settings: SourceSettings, uri: str) -> DirectorySource:
    mount = settings.pvc_root / ref.claim
    if not mount.is_dir():
        raise SourceError(
            f"{uri}: claim {ref.claim!r} is not mounted in this agent (expected at {mount}); add "
            "it to the chart's agent.modelSources.pvcs"
        )
    return DirectorySource(mount / ref.path if ref.path else mount, uri, confine_to=mount)


def file_source(ref: FileRef, settings: SourceSettings, uri: str) -> DirectorySource:
    path = Path(ref.path)
    for root in settings.allowed_paths:
        if path == root or root in path.parents:
            return DirectorySource(path, uri, confine_to=root)
    allowed = ", ".join(str(p) for p in settings.allowed_paths) or "none"
    raise SourceError(
        f"{uri}: {path} is not under an allowed node path (allowed: {allowed}); add its root to "
        "the chart's agent.modelSources.hostPaths (agent flag --allow-path)"
    )
