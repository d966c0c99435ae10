"""A prewarm slot evicted while vLLM's engine is being prepared over it (group ``vllm``; real
vLLM on CPU, the tiny Llama, engines in this process).

The eviction cancels the preparation: a build under way cannot be interrupted, so it ends —
failing over the slot's unmapped pages and removed page table, which is no error then — and is
torn down; nothing is logged as a failed preparation, nothing of vLLM is left running, and the
process prepares the next slot's engine.  Before, the build failed with
``event=vllm_build_failed`` at ERROR with its traceback and ``engine_prepare_failed ...
FileNotFoundError`` at WARNING (the slot's page-table file was gone)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from warmserve_agent.engines.spec import PreparedState
from warmserve_agent.node import NodeCore

from tests.engines.test_vllm_engine import (  # noqa: F401  (tiny_root: fixture)
    ARGS,
    GPU,
    PAGE,
    _tokens,
    tiny_root,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def _vllm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("vllm-server", "vllm-engine")]


def test_evicting_a_slot_while_its_vllm_engine_prepares(
    make_core: Callable[..., NodeCore],
    tiny_root: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    from warmserve_agent.engines.vllm import loader

    caplog.set_level(logging.INFO, logger="warmserve.agent")
    core = make_core(gpus=1, gpu_bytes=GPU, page=PAGE, root=tiny_root, engines=("vllm",))
    before = _vllm_threads()
    slot = core.prewarm("tiny", [0], engine="vllm", engine_args=ARGS)
    deadline = time.monotonic() + 60
    while True:  # its preparation has begun: the engine is being built in its host
        rec = core.preparer.prepared.get(slot.slot_id)
        prep = None if rec is None or rec.host is None else rec.host._prepared  # type: ignore[attr-defined]
        if prep is not None:
            break
        assert time.monotonic() < deadline, "no preparation began"
        time.sleep(0.005)
    assert prep.report().state == PreparedState.PREPARING
    core.evict(slot.slot_id)
    prep.thread.join(120)
    assert not prep.thread.is_alive(), "the preparation did not end"
    core.preparer.settle()
    said = [r.getMessage() for r in caplog.records]
    loud = ("engine_prepare_failed", "vllm_build_failed")
    assert not [m for m in said if any(w in m for w in loud)], said
    # cancelled (its build failed over the slot that went), or built first and then dropped
    assert [m for m in said if "engine_prepare_cancelled" in m or "engine_prepared" in m], said
    # torn down: vLLM's threads and the slot's registration go (in the background)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        [t for t in _vllm_threads() if t not in before] or slot.slot_id in loader._ACTIVE
    ):
        time.sleep(0.05)
    assert not [t for t in _vllm_threads() if t not in before], "vLLM still runs"
    assert slot.slot_id not in loader._ACTIVE
    # the process prepares the next slot's engine, and its hit serves
    nxt = core.prewarm("tiny", [0], engine="vllm", engine_args=ARGS)
    nxt.loader.join()
    core.preparer.settle(600)
    assert core.preparer.prepared[nxt.slot_id].report.state == PreparedState.READY
    inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
    assert inst.prewarm_hit and inst.stages.engine_prepared
    assert len(_tokens(inst.endpoint)) == 16
