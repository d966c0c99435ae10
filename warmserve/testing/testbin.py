"""Test server binaries (Prometheus, the S3 server, the OpenTelemetry Collector) that
``hack/testbin/build.sh`` builds from source."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def built_server(name: str) -> Path:
    """A test server binary built by hack/testbin/build.sh (hack/test.sh builds them before
    pytest; built here on first use otherwise, then cached)."""
    linked = REPO / ".testbin" / name
    if linked.is_file() and os.access(linked, os.X_OK):
        return linked
    out = subprocess.run(
        [str(REPO / "hack" / "testbin" / "build.sh"), name],
        check=True,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    return Path(out.stdout.strip().splitlines()[-1]) / name
