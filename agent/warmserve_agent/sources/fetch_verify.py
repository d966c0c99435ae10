"""Checking what a fetch downloaded: every file against its listing, the model before install.

Every file is checked against the listing (size, and the sha256 / git blob id / MD5 the source
publishes, :func:`~warmserve_agent.sources.base.verify_file`); a file that fails is deleted so
that the download loop (:mod:`~warmserve_agent.sources.fetch_download`) fetches it again, while a
transfer that was cut off keeps its bytes and is resumed.  Files are written through
:func:`~warmserve_agent.sources.fetch_staging.open_staged` (no link followed) and
:class:`~warmserve_agent.sources.disk_reserve.GuardedFile` (no more than listed; the disk
reserve watched).  Before
a model is installed, its ``config.json`` must declare its layers (the unit of prewarming, §4.1)
and every safetensors header must parse and fit its file.

:class:`FileChecks` counts what it rejects in the fetcher's counters; the fetcher holds it and
hands it to the download.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from warmserve_agent.sources import SourceError
from warmserve_agent.sources.base import Listing, RemoteFile, verify_file
from warmserve_agent.sources.disk_reserve import DiskGuard, GuardedFile
from warmserve_agent.sources.fetch_records import FetchFailed
from warmserve_agent.sources.fetch_staging import open_staged
from warmserve_agent.store import config_num_layers, read_safetensors_header

log = logging.getLogger("warmserve.agent.fetch")  # one logger for the whole fetcher


class FileChecks:
    """Per-file and per-model checks (see module docstring)."""

    def __init__(self, stats: Counter[str]) -> None:
        self.stats = stats  # bytes, retries:<reason>

    def get_one(
        self,
        src: object,
        f: RemoteFile,
        staging: Path,
        listing: Listing,
        guard: DiskGuard | None = None,
    ) -> str:
        """Download (the rest of) one file and check it: "" when good, else what was wrong.

        A transfer cut off keeps what reached the disk, and the next attempt resumes after it;
        a file that fails its checks (or that the client library found corrupt) is deleted."""
        dest = staging / f.path
        out, have = open_staged(staging, f.path)
        with out:
            if have < f.size:
                if guard is not None:
                    guard.check()  # the disk may have filled since the fetch began
                sink = GuardedFile(out, have, f.size, guard, f.path)
                try:
                    src.download(f, sink, have, listing)  # type: ignore[attr-defined]
                except SourceError as exc:
                    if not exc.retryable:
                        raise
                    self.stats["retries:checksum" if exc.checksum else "retries:error"] += 1
                    out.close()
                    if exc.checksum:
                        dest.unlink(missing_ok=True)
                    else:
                        self.stats["bytes"] += max(dest.stat().st_size - have, 0)
                    return str(exc)
        self.stats["bytes"] += max(dest.stat().st_size - have, 0)
        problem = verify_file(dest, f)
        if problem is None:
            return ""
        self.stats["retries:size" if problem.size else "retries:checksum"] += 1
        log.warning(
            "event=model_file_rejected file=%s problem=%r checks=%s",
            f.path,
            problem.text,
            f.checks(),
        )
        dest.unlink(missing_ok=True)
        return problem.text

    @staticmethod
    def check_model_dir(path: Path, listing: Listing, uri: str) -> None:
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
