"""``--smoke`` for the benchmarks: every runnable ``bench/*.py`` takes it and then runs its usual
code path at tiny sizes, in seconds, writes its results to a temp dir (never ``bench/results``)
and exits non-zero on any error, so that CI notices a bench that no longer runs
(``tests/bench/test_bench_smoke.py`` runs them all).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def add_smoke_flag(ap: argparse.ArgumentParser, sizes: Mapping[str, Any], note: str = "") -> None:
    """``--smoke``: the flags of ``sizes`` (``dest`` -> value) set for a run of seconds."""
    flags = ", ".join(_show(k, v) for k, v in sizes.items())
    ap.add_argument(
        "--smoke",
        action="store_true",
        help=f"a run of seconds that checks the bench still works: {flags}; results to a temp "
        "dir" + (f"; {note}" if note else ""),
    )


def apply_smoke(
    args: argparse.Namespace,
    sizes: Mapping[str, Any],
    outputs: Mapping[str, str | Path] | None = None,
) -> None:
    """With ``--smoke``, set ``sizes`` on ``args``; then each result file ``args.<attr>`` of
    ``outputs`` (attr -> default path) that was not given gets its default, in a smoke run a
    file of the default's name in one new temp dir."""
    if args.smoke:
        for k, v in sizes.items():
            setattr(args, k, v)
    tmp: Path | None = None
    for attr, default in (outputs or {}).items():
        if getattr(args, attr) is not None:
            continue
        path = Path(default)
        if args.smoke:
            tmp = tmp or Path(tempfile.mkdtemp(prefix="bench-smoke-"))
            path = tmp / path.name
        setattr(args, attr, str(path) if isinstance(default, str) else path)


def _show(dest: str, v: Any) -> str:
    flag = "--" + dest.replace("_", "-")
    if isinstance(v, bool):
        return flag if v else f"no {flag}"
    if isinstance(v, list | tuple):
        return f"{flag} {' '.join(str(x) for x in v)}"
    return f"{flag} {v}"
