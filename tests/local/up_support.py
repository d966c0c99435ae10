"""Helpers of the ``warmserve up`` tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def warmserve(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m warmserve ARGS`` from the repository root; output captured."""
    return subprocess.run(
        [sys.executable, "-m", "warmserve", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else dict(os.environ),
        cwd=REPO,
        timeout=timeout,
    )
