"""vLLM's KV cache mapped in the background, lent in grace and grown back (group ``vllm``).

Real vLLM (CPU) over a tiny random-weight Llama in a slot on the simulated backend, engines in
this process (the agent owns the memory: the engine maps KV pages from the backend's shared page
table as they are granted):

* activation returns with no KV page mapped; vLLM's block pool has no usable block until the
  pager's chunks land, then the blocks their pages cover; a request sent meanwhile waits and is
  served with plain vLLM's greedy tokens;
* the layout vLLM reports is layer-major (a segment per KV tensor), and lending gives back the
  pages no kept block touches in *every* layer's region, not only the tail;
* in grace the agent lends on each completion; a request that needs more blocks than were kept
  makes the agent evict the newest prewarm's last layers and map the pages back; vLLM's pool
  grows and the request is served with the reference tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Event
from warmserve_agent.store import WeightStore

from tests.agent.conftest import write_model
from tests.engines.test_vllm_engine import ARGS, PROMPT, REF_SCRIPT, _env, _tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PAGE = 64 * 1024
GPU = 48 * 1024**2
# 32-token blocks and C = 256: Eq. 1 keeps an idle instance M / C, 2 usable blocks; a 64-token
# answer needs 3
SMALL_BLOCKS = [*ARGS, "--block-size", "32", "--max-num-seqs", "256"]


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmserve_agent.engines.vllm.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("models")
    make_tiny_llama(root / "tiny", layers=4, hidden=128, seed=7)
    make_tiny_llama(root / "other", layers=4, hidden=128, seed=8)
    # many small layers: a prewarm that fills whatever the first borrower left, to the page
    write_model(root, "pad", layers=60, hidden=48, seed=9)
    return root


@pytest.fixture(scope="module")
def reference(roots: Path) -> dict[int, list[int]]:
    out = {}
    for n, script in (
        (16, REF_SCRIPT),
        (64, REF_SCRIPT.replace("max_model_len=256,", "max_model_len=256, block_size=32,")),
    ):
        run = subprocess.run(
            [sys.executable, "-c", script, str(roots / "tiny"), json.dumps(PROMPT), str(n)],
            capture_output=True,
            text=True,
            timeout=600,
            env=_env(),
        )
        line = next((x for x in run.stdout.splitlines() if x.startswith("TOKENS ")), None)
        assert line, run.stderr[-3000:]
        out[n] = json.loads(line[7:])
    return out


def _core(tmp_path: Path, root: Path, gpu: int = GPU, **kw: object) -> NodeCore:
    return NodeCore(
        MemoryManager(SimulatedBackend(tmp_path / "gpus", page_bytes=PAGE)),
        WeightStore(root),
        {0: gpu},
        lambda g: InProcessEngine(g),
        engines=("vllm",),
        **kw,  # type: ignore[arg-type]
    )


def _free_blocks(eng: object) -> int:
    return eng._client.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()  # type: ignore[attr-defined]


def test_vllm_blocks_become_usable_as_their_pages_map(
    tmp_path: Path, roots: Path, reference: dict[int, list[int]]
) -> None:
    core = _core(tmp_path, roots, kv_pager_thread=False)  # the test turns the pager
    try:
        inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
        eng = inst.engine.engine  # type: ignore[attr-defined]
        assert inst.kv_pages == 0 and _free_blocks(eng) == 0, "activation waited for its KV"
        geo = eng.stats().kv_geometry
        assert geo is not None and len(geo.segments) == 4  # one region per layer: layer-major
        out: list = []
        t = threading.Thread(target=lambda: out.append(_tokens(inst.endpoint)), daemon=True)
        t.start()
        time.sleep(1.0)
        assert not out, "served without a KV block"
        usable, more = [], True
        while more:
            more = core.pager.run_once()
            usable.append(eng.stats().kv_capacity_bytes)  # blocks vLLM may allocate
            core.check()  # granted blocks only touch mapped pages
        assert usable == sorted(usable) and usable[0] > 0, usable  # grew chunk by chunk
        assert len(set(usable)) >= 3
        t.join(300)
        assert out == [reference[16]]
    finally:
        core.shutdown()
        core.mm.close()


def test_vllm_lends_every_layers_tail_and_grows_back_for_a_request(
    tmp_path: Path, roots: Path, reference: dict[int, list[int]]
) -> None:
    core = _core(tmp_path, roots, gpu=8 * 1024**2)  # what it lends, two prewarms fill
    events: list[Event] = []
    core.subscribe(events.append)
    try:
        inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=SMALL_BLOCKS)
        assert core.kv_idle(120)
        eng = inst.engine.engine  # type: ignore[attr-defined]
        kv = inst.kv
        assert kv is not None and kv.granted == kv.geometry.num_blocks
        full_free = _free_blocks(eng)
        core.begin_grace(inst.instance_id)  # idle: Eq. 1 keeps M / C
        assert core.kv_idle(120)
        kept = kv.granted
        assert 0 < kept <= 3
        assert _free_blocks(eng) < full_free
        # the pages given back lie in every layer's region (layer-major), not only the tail
        live = core.mm.live_vpages(inst.slot_id, 0)
        seg_pages = [
            {(off + b * stride) // PAGE + inst.weight_pages for b in range(kv.geometry.num_blocks)}
            for off, stride in kv.geometry.segments
        ]
        for pages in seg_pages:
            assert pages - live, "every layer's region gave pages back"
            assert pages & live, "and kept the pages of the blocks it keeps"
        # prewarms borrow the lent pages, to the last one
        borrower = core.prewarm("other", [0])
        borrower.loader.join()
        assert borrower.state == "ready"
        pad_layout = core.store.layout("pad", 1)
        fit = max(
            n
            for n in range(1, 61)
            if -(-pad_layout.bytes_for_layers(n) // PAGE) <= core.mm.available_pages(0)
        )
        pad = core.prewarm("pad", [0], layers=fit)
        pad.loader.join()
        assert pad.state == "ready" and core.mm.available_pages(0) <= 1
        # a long request needs more blocks than were kept: it waits, vLLM says so, the agent
        # evicts the borrower's last layers and maps the pages back; vLLM's pool grows
        assert _tokens(inst.endpoint, n=64) == reference[64]
        said = [e.message for e in events if e.subject == inst.instance_id]
        assert any(m.startswith("taking back") for m in said), said
        # the newest borrower lost its last layers; the older one kept everything
        assert pad.slot_id not in core.slots or pad.layers_resident < fit
        assert borrower.layers_resident == 4
        assert core.lender.event_refreshes >= 1
        # the completion lends again at once (no timer here)
        deadline = time.monotonic() + 30
        while kv.granted > kept and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv.granted == kept
        assert core.kv_idle(120)
        core.check()
    finally:
        core.shutdown()
        core.mm.close()


def test_vllm_kv_capacity_follows_set_kv_capacity_both_ways(
    make_core: Callable[..., NodeCore], roots: Path, reference: dict[int, list[int]]
) -> None:
    """The engine alone: lending takes free blocks out of vLLM's pool, growing gives them back
    (the pages stayed mapped here, so the shared page table finds them again)."""
    core = make_core(gpus=1, gpu_bytes=GPU, page=PAGE, root=roots, engines=("vllm",))
    inst, _ = core.activate("tiny", [0], engine="vllm", engine_args=ARGS)
    assert core.kv_idle(120)
    eng = inst.engine.engine  # type: ignore[attr-defined]
    geo = eng.stats().kv_geometry
    free0 = _free_blocks(eng)
    quarter = geo.capacity(geo.num_blocks // 4)
    assert eng.set_kv_capacity(quarter) == quarter
    assert _free_blocks(eng) == geo.num_blocks // 4 - 1  # block 0 is vLLM's null block
    assert _tokens(inst.endpoint) == reference[16], "serves from the blocks it kept"
    assert eng.set_kv_capacity(geo.capacity(geo.num_blocks)) == geo.capacity(geo.num_blocks)
    eng._client.call_sync(lambda: None)  # a raise is queued for the engine thread: let it run
    assert _free_blocks(eng) == free0
    assert _tokens(inst.endpoint) == reference[16]
