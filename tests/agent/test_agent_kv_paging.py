"""Page-table work off the critical path and lending on completion, through the node core with
the real simulated engine (its KV writes and reads are page-checked against the backend's
shared page table).

* Activation returns with its KV range unmapped; the engine's capacity grows as the pager's
  chunks land, and a request that arrived meanwhile is served once there is room.
* Ending, evicting or lending withdraws capacity first and unmaps in the background; what is
  withdrawn is available at once (a map takes it, flushing first).
* The page-access check is real: a page taken behind the engine's back fails its next access.
* Lending on completion: a finished request of a grace instance triggers Eq. 1 through the
  engine's event at once — there is no timer in the node core.
* Growing back: a request that needs more KV than a grace instance kept makes the agent evict
  the newest borrower's last layers and map the pages back; the request is served.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from warmserve_agent.backends.simulated import SimulatedBackend
from warmserve_agent.engine_host import InProcessEngine
from warmserve_agent.engines.simulated import SimulatedEngine
from warmserve_agent.engines.slotmem import KvAccessError
from warmserve_agent.loader import verify_layers
from warmserve_agent.memory import MemoryManager
from warmserve_agent.node import NodeCore
from warmserve_agent.node_records import Event, EventKind, InstanceRec
from warmserve_agent.store import WeightStore
from warmserve_agent.testing import write_model

from tests.agent.agent_support import PAGE
from tests.engines.helpers import post_json

MiB = 1024**2


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "models"
    write_model(r, "alpha", layers=4, hidden=64, seed=1)
    # 16 KiB of KV per token: 4 tokens per 64 KiB page, so requests need many pages
    write_model(r, "hog", layers=2, hidden=32, seed=4, profile={"kv_bytes_per_token": 16384})
    write_model(r, "wide", layers=8, hidden=96, seed=5)  # a borrower that fills lent pages
    return r


@pytest.fixture
def cores(tmp_path: Path, root: Path) -> Iterator[list[NodeCore]]:
    made: list[NodeCore] = []
    yield made
    for c in made:
        c.shutdown()
        c.mm.close()


def _core(
    cores: list[NodeCore], tmp_path: Path, root: Path, map_s: float = 0.0, **kw: object
) -> NodeCore:
    backend = SimulatedBackend(
        tmp_path / f"gpus{len(cores)}", page_bytes=PAGE, map_s_per_page=map_s
    )
    core = NodeCore(
        MemoryManager(backend),
        WeightStore(root),
        {0: 4 * MiB},
        lambda g: InProcessEngine(g),
        node_name="kv",
        **kw,  # type: ignore[arg-type]
    )
    cores.append(core)
    return core


def _engine(inst: InstanceRec) -> SimulatedEngine:
    eng = inst.engine.engine  # type: ignore[attr-defined]
    assert isinstance(eng, SimulatedEngine)
    return eng


def _post_in_thread(url: str, body: dict) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(post_json(url, body)), daemon=True)
    t.start()
    return t, out


def _wait(pred, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_activation_returns_before_its_kv_is_mapped_and_capacity_follows_the_chunks(
    cores: list[NodeCore], tmp_path: Path, root: Path
) -> None:
    # The pager runs only when the test turns it: nothing maps behind the test's back.
    core = _core(cores, tmp_path, root, kv_pager_thread=False)
    slot = core.prewarm("alpha", [0])
    slot.loader.join()
    inst, _ = core.activate("alpha", [0])
    kv = inst.kv
    assert kv is not None and inst.kv_pages_initial > 16
    assert inst.kv_pages == 0 and kv.granted == 0, "activation did not wait for the KV range"
    eng = _engine(inst)
    assert eng.stats().kv_capacity_bytes == 0
    # a request arriving now waits for KV pages (it is not refused)
    t, out = _post_in_thread(f"{inst.endpoint}/v1/completions", {"prompt": "a b", "max_tokens": 8})
    _wait(lambda: eng.stats().waiting == 1)
    caps, pages = [], []
    more = True
    while more:
        more = core.pager.run_once()
        caps.append(eng.stats().kv_capacity_bytes)
        pages.append(inst.kv_pages)
        core.check()  # granted blocks only touch mapped pages, after every chunk
    assert caps == sorted(caps) and caps[0] > 0 and caps[-1] == inst.kv_pages_initial * PAGE
    assert pages == [8, 24, 56], pages  # chunks double: the first blocks come quickly
    t.join(30)
    assert out and out[0][0] == 200, out
    assert eng.kv_violations() == 0


def test_activation_does_not_wait_for_a_slow_driver(
    cores: list[NodeCore], tmp_path: Path, root: Path
) -> None:
    """The pager's thread, a driver that takes 100 ms per page (the KV range: ~5.6 s)."""
    core = _core(cores, tmp_path, root, map_s=0.1)
    slot = core.prewarm("alpha", [0])
    slot.loader.join()
    t0 = time.monotonic()
    inst, _ = core.activate("alpha", [0])
    took = time.monotonic() - t0
    assert inst.kv_pages < inst.kv_pages_initial, f"waited {took:.2f} s for the whole range"
    status, _ = post_json(f"{inst.endpoint}/v1/completions", {"prompt": "a", "max_tokens": 4})
    assert status == 200  # served from the first chunks
    core.mm.backend.map_s_per_page = 0.0  # type: ignore[attr-defined]  # the rest: quickly
    assert core.kv_idle(60) and inst.kv_pages == inst.kv_pages_initial
    assert _engine(inst).stats().kv_capacity_bytes == inst.kv_pages_initial * PAGE
    core.check()


def test_synchronous_mapping_maps_everything_before_the_engine_starts(
    cores: list[NodeCore], tmp_path: Path, root: Path
) -> None:
    core = _core(cores, tmp_path, root, kv_background=False)
    inst, _ = core.activate("alpha", [0])
    assert inst.kv_pages == inst.kv_pages_initial and inst.kv is not None
    assert _engine(inst).stats().kv_capacity_bytes == inst.kv_pages_initial * PAGE
    core.check()


def test_unmapping_is_asynchronous_and_withdrawn_pages_are_available_at_once(
    cores: list[NodeCore], tmp_path: Path, root: Path
) -> None:
    core = _core(cores, tmp_path, root, kv_pager_thread=False)
    inst, _ = core.activate("alpha", [0])
    assert core.kv_idle(30)
    n = inst.kv_pages
    core.begin_grace(inst.instance_id)
    lent = n - inst.kv_pages
    assert lent > 0 and core.mm.pending_pages(0) == lent  # lent: withdrawn, not unmapped yet
    assert core.lendable()[0]["lendable_bytes"] == lent * PAGE  # ...and available already
    core.end_instance(inst.instance_id)
    assert core.mm.pending_pages(0) == n  # ending returns before the unmaps
    assert _engine(inst)._loop is None  # the engine stopped first
    core.check()
    slot = core.prewarm("wide", [0])  # its loader's maps flush what they need
    slot.loader.join()
    assert slot.state == "ready"
    core.check()
    assert core.kv_idle(30) and core.mm.pending_pages() == 0
    core.check()
    # activating another model retires the old slots: their pages unmap in the background
    core.activate("hog", [0])
    assert core.kv_idle(30)
    core.check()


def test_the_page_access_check_catches_a_page_taken_behind_the_engines_back(
    cores: list[NodeCore], tmp_path: Path, root: Path
) -> None:
    core = _core(cores, tmp_path, root)
    inst, _ = core.activate("alpha", [0])
    assert core.kv_idle(30)
    eng = _engine(inst)
    mem = eng._kv.mems[0]
    first = inst.weight_pages
    mem.check_pages(range(first, first + 4))  # granted and mapped: fine
    # negative control: the agent unmaps a granted page without withdrawing capacity first
    core.mm.unmap_range(inst.slot_id, first, 2)
    with pytest.raises(KvAccessError, match="not mapped"):
        mem.kv_write(first * PAGE, b"x")
    req = urllib.request.Request(
        f"{inst.endpoint}/v1/completions",
        data=json.dumps({"prompt": "a", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:  # its first page is the one taken
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 500
    assert eng.kv_violations() >= 1
    # the freed page goes to another slot and a different one is mapped here: the engine's
    # own mapping still reaches the old page, now another slot's; the check refuses it
    core.mm.create_slot("thief", [0])
    core.mm.map_range("thief", 0, 1)  # takes the page the engine still reaches at first + 1
    core.mm.map_range(inst.slot_id, first + 1, 1)
    with pytest.raises(KvAccessError, match="not granted"):
        mem.kv_write((first + 1) * PAGE, b"x")
    core.mm.destroy_slot("thief")


def test_a_completion_lends_at_once_without_a_timer(
    cores: list[NodeCore], tmp_path: Path, root: Path
) -> None:
    core = _core(cores, tmp_path, root)
    cfg = root / "alpha" / "config.json"
    data = json.loads(cfg.read_text())
    data["warmserve"].update(decode_tok_s=20.0)  # a 20-token request runs ~1 s
    cfg.write_text(json.dumps(data))
    inst, _ = core.activate("alpha", [0])
    assert core.kv_idle(30)
    eng = _engine(inst)
    t, out = _post_in_thread(f"{inst.endpoint}/v1/completions", {"prompt": "a", "max_tokens": 20})
    _wait(lambda: eng.stats().running == 1)
    core.begin_grace(inst.instance_id)  # R = 1: Eq. 1 keeps more than it will at R = 0
    kept = inst.kv_pages
    lent_at: list[float] = []

    def on(ev: Event) -> None:
        if ev.kind == EventKind.INSTANCE and ev.message.startswith("lent"):
            lent_at.append(time.monotonic())

    core.subscribe(on)
    t.join(30)
    done = time.monotonic()
    assert out and out[0][0] == 200
    _wait(lambda: bool(lent_at), timeout=5)
    # the NodeCore has no timer: only the engine's completion event can have done this
    assert core.events is not None and core.events.received >= 1
    assert core.lender.event_refreshes >= 1
    assert inst.kv_pages < kept
    assert lent_at[0] - done < 1.0, f"lent {lent_at[0] - done:.3f} s after the completion"
    core.check()


def test_kv_lent_to_a_prewarm_grows_back_for_a_request_that_needs_it(
    cores: list[NodeCore], tmp_path: Path, root: Path
) -> None:
    core = _core(cores, tmp_path, root)
    inst, _ = core.activate("hog", [0])
    assert core.kv_idle(30)
    total = inst.kv_pages
    core.begin_grace(inst.instance_id)  # idle: Eq. 1 keeps M / C, lends the rest
    assert core.kv_idle(30)
    kept = inst.kv_pages
    assert kept < total // 2
    # a prewarm borrows the lent pages: as many layers of "wide" as fit
    layout = core.store.layout("wide", 1)
    fit = max(
        n
        for n in range(1, layout.model.num_layers + 1)
        if -(-layout.bytes_for_layers(n) // PAGE) <= core.mm.available_pages(0)
    )
    borrower = core.prewarm("wide", [0], layers=fit)
    borrower.loader.join()
    assert borrower.layers_resident == fit and core.mm.available_pages(0) < total - kept - 2
    # a request needs ~3x what the grace instance kept: it waits, the engine says so, and the
    # agent takes the borrower's last layers back
    tokens = 3 * kept * PAGE // 16384
    # The range's pages as they change: the request's completion event lends them out again at
    # once (Eq. 1 at R = 0), so what the instance holds after the request says nothing.
    assert inst.kv is not None
    told, peak = inst.kv.on_pages, [inst.kv_pages]

    def on_pages(n: int) -> None:
        told(n)
        peak.append(n)

    inst.kv.on_pages = on_pages
    status, body = post_json(
        f"{inst.endpoint}/v1/completions", {"prompt": "x", "max_tokens": tokens}, timeout=30
    )
    assert status == 200 and body["usage"]["completion_tokens"] == tokens
    assert borrower.slot_id not in core.slots or borrower.layers_resident < fit
    assert max(peak) > kept, "the KV range grew back for the request"
    assert _engine(inst).kv_violations() == 0
    assert core.kv_idle(30)
    core.check()
    if borrower.slot_id in core.slots:  # what stays of the borrower is intact
        digests = [core.store.digests(borrower.layout, 0)]
        bad = verify_layers(
            lambda r, o, n: core.mm.read(borrower.slot_id, 0, o, n),
            borrower.layout,
            digests,
            [0],
            borrower.layers_resident,
        )
        assert not bad
