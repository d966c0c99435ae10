"""GPU contract tests: the CUDA backend's behaviour on a real device (``hack/gpu-check.sh``).

``WARMSERVE_GPU_TESTS`` chooses what runs (all tests here are marked ``gpu``):

* ``off`` (default, e.g. the ordinary CI run): deselected — this machine has no GPU.
* ``fake``: the driver-level contracts run against the recording fake driver
  (``warmserve_agent.fake_cuda``), as ``hack/gpu-check.sh --dry-run`` does in CI; tests that also
  need torch on a device (marked ``gpu_torch``) are deselected and listed.
* ``real``: everything runs against ``cuda.bindings.driver`` on GPU 0; a missing driver,
  cuda-python or torch **fails** the test (never skips).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

MODES = ("off", "fake", "real")


def gpu_mode() -> str:
    mode = os.environ.get("WARMSERVE_GPU_TESTS", "off")
    if mode not in MODES:
        raise pytest.UsageError(f"WARMSERVE_GPU_TESTS={mode!r}: use one of {', '.join(MODES)}")
    return mode


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mode = gpu_mode()
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("gpu") is None:
            keep.append(item)
        elif mode == "off" or (mode == "fake" and item.get_closest_marker("gpu_torch")):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> str:
    return f"warmserve GPU tests: WARMSERVE_GPU_TESTS={gpu_mode()}"


@pytest.fixture
def mode() -> str:
    return gpu_mode()


@pytest.fixture
def driver(mode: str) -> Iterator[Any]:
    """The driver module the backend uses: the real one, or a fresh fake (one 1 GiB device)."""
    if mode == "real":
        from cuda.bindings import driver as real

        yield real
    else:
        from warmserve_agent.fake_cuda import FakeDriver

        fake = FakeDriver(devices=1, mem_bytes=1024 * 2**20)
        yield fake
        assert not fake.violations, fake.violations


@pytest.fixture
def driver_spec(mode: str, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """How worker processes import the driver (None: the real one)."""
    if mode == "real":
        return None
    monkeypatch.setenv("WARMSERVE_FAKE_CUDA_DEVICES", "1")
    monkeypatch.setenv("WARMSERVE_FAKE_CUDA_MEM", str(1024 * 2**20))
    return "warmserve_agent.fake_cuda:DRIVER"
