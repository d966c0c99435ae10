"""The manifest of a built model directory: the sha256 and size of every file in it, and the
``.complete`` marker that holds the manifest's own sha256.

:func:`problem` re-hashes everything (about a second for SmolLM2's 270 MB, small next to an
engine build) and names the first thing that differs: a missing, changed or unexpected file, a
symlink, or a missing marker.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from warmserve.realmodel.fetch import sha256_file

MANIFEST = "WARMSERVE-MANIFEST.json"
PROVENANCE = "WARMSERVE-PROVENANCE.json"
COMPLETE = ".complete"


def _files(d: Path) -> list[str]:
    return sorted(
        str(p.relative_to(d))
        for p in d.rglob("*")
        if not p.is_dir() or p.is_symlink()
        if p.name not in (MANIFEST, COMPLETE) or p.parent != d
    )


def write(d: Path, model_name: str, key: str) -> None:
    """Write the manifest of everything in ``d``, then the marker (last: its presence means
    the directory is whole)."""
    files = {}
    for rel in _files(d):
        p = d / rel
        if p.is_symlink():
            raise ValueError(f"{p} is a symlink; a model directory holds plain files only")
        files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    doc = {"model": model_name, "key": key, "files": files}
    data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    (d / MANIFEST).write_bytes(data)
    (d / COMPLETE).write_text(hashlib.sha256(data).hexdigest() + "\n")


def problem(d: Path) -> str | None:
    """None when ``d`` is exactly what its manifest says; else what is wrong, in a few words."""
    if not d.is_dir():
        return "not built"
    try:
        marker = (d / COMPLETE).read_text().strip()
    except FileNotFoundError:
        return f"no {COMPLETE} marker (an interrupted build)"
    try:
        data = (d / MANIFEST).read_bytes()
        files = json.loads(data)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    if hashlib.sha256(data).hexdigest() != marker:
        return f"{MANIFEST} does not match its {COMPLETE} marker"
    present = _files(d)
    extra = sorted(set(present) - set(files))
    if extra:
        return f"unexpected file {extra[0]}"
    for rel, want in sorted(files.items()):
        p = d / rel
        if p.is_symlink() or not p.is_file():
            return f"{rel} is missing or not a plain file"
        if p.stat().st_size != want["bytes"]:
            return f"{rel} has {p.stat().st_size} bytes, the manifest says {want['bytes']}"
        if sha256_file(p) != want["sha256"]:
            return f"{rel} does not match its sha256 in the manifest"
    return None
