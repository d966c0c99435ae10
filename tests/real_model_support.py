"""The real small model for tests (warmserve.realmodel): a pytest plugin that
``tests/conftest.py`` lists in ``pytest_plugins``, so every test folder gets its fixture.

``smollm2_dir`` (session)
    The directory of SmolLM2-135M-Instruct as bf16 safetensors + config + tokenizer + chat
    template + ``WARMSERVE-PROVENANCE.json``, from ``warmserve.realmodel.ensure_model("smollm2")``:
    the cached artefact (``${WARMSERVE_MODEL_CACHE:-~/.cache/warmserve-models}``), re-verified
    against its manifest.  Shared by every test and every session on the machine: treat it as
    read-only (copy it first to change a file; a changed file is caught by the manifest and
    rebuilt by the next session).

When the artefact is missing or fails its manifest the plugin builds it — once, right after
collection and before any test's timeout starts, like the control-plane binaries
(tests/k8s_support.py); it never skips.  Building needs PyPI and an interpreter with torch,
transformers, gguf and accelerate: the vLLM venv (``hack/vllm/setup.sh``), which is where the
``vllm`` group runs; elsewhere ``$WARMSERVE_MODEL_PYTHON`` or the checkout's ``.vllm-cache``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SMOLLM2_FIXTURE = "smollm2_dir"
_built: list[Path] = []  # verified once per session (re-hashing 270 MB takes about a second)


def _uses_smollm2(item: pytest.Item) -> bool:
    return SMOLLM2_FIXTURE in getattr(item, "fixturenames", ())


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the model before the first test runs, outside any per-test timeout."""
    if session.config.option.collectonly:
        return
    if any(_uses_smollm2(item) for item in session.items):
        _smollm2()


def _smollm2() -> Path:
    if not _built:
        from warmserve.realmodel import ensure_model

        _built.append(ensure_model("smollm2"))
    return _built[0]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, verified (read-only: see the module docstring)."""
    return _smollm2()
