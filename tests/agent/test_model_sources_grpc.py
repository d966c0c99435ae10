"""Model sources through the agent's gRPC API: Prewarm/Activate of a model the node's store
lacks (fetched from hf:// first, with progress on the stream, in Describe and on Watch),
InspectModel, the store's budget in Describe, and the refusals."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from conftest import PAGE, MiB, write_model
from warmserve_agent.config import AgentConfig
from warmserve_agent.sources.disk_reserve import DiskReserve
from warmserve_agent.testing import AgentThread

from tests.model_sources_support import HubServer, repo_from_dir
from warmserve.api.agent.client import AgentClient, AgentError, SyncAgentClient, pb

NAME = "org/" + "long-model-name-" * 12  # 196 characters with the slash


@pytest.fixture
def hub(tmp_path: Path):
    up = tmp_path / "upstream"
    repos = {
        "org/alpha": repo_from_dir(write_model(up, "alpha", layers=3, hidden=64, seed=1)),
        "org/beta": repo_from_dir(write_model(up, "beta", layers=2, hidden=64, seed=2)),
    }
    with HubServer(repos, rate=1e5) as h:
        yield h


def agent_cfg(tmp_path: Path, hub: HubServer, **kw) -> AgentConfig:
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    base = dict(
        model_dir=store,
        simulate_gpus=[4 * MiB] * 2,
        listen="127.0.0.1:0",
        page_bytes=PAGE,
        memory_dir=tmp_path / f"gpus-{time.monotonic_ns()}",
        node_name="node-a",
        use_workers=False,
        hf_endpoint=hub.url,
        fetch_backoff_s=0.05,
        store_reserve=DiskReserve(0.0, 0),  # the machine's free disk is not what it tests
    )
    base.update(kw)
    return AgentConfig(**base)


def test_prewarm_fetches_a_missing_model_with_progress(tmp_path: Path, hub: HubServer) -> None:
    with AgentThread(agent_cfg(tmp_path, hub)) as a, SyncAgentClient(a.address) as c:
        assert not c.describe().models
        info = c.inspect_model(NAME, "hf://org/alpha")  # before any download
        assert (info.num_layers, info.source) == (3, "hf://org/alpha")
        assert sum(hub.downloads.values()) == 0
        watched: list[pb.WatchEvent] = []

        async def awatch() -> None:
            async with AgentClient(a.address) as w:
                async for ev in w.watch(include_snapshot=False):
                    watched.append(ev)
                    if ev.kind == pb.WatchEvent.KIND_FETCH and ev.fetch.state in (
                        pb.FETCH_STATE_DONE,
                        pb.FETCH_STATE_FAILED,
                    ):
                        return

        def watch() -> None:
            asyncio.run(asyncio.wait_for(awatch(), 30))

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        time.sleep(0.3)
        msgs = list(c.prewarm(NAME, [0], 0, source="hf://org/alpha", request_id="p1"))
        fetching = [m for m in msgs if m.HasField("fetch")]
        assert fetching and not any(m.slot_id for m in fetching)
        assert fetching[-1].fetch.state == pb.FETCH_STATE_DONE
        assert any(
            m.fetch.state == pb.FETCH_STATE_DOWNLOADING and m.fetch.bytes_done > 0 for m in fetching
        ), fetching
        assert msgs[-1].done and msgs[-1].slot.model == NAME
        assert msgs[-1].slot.layers_resident == 3
        d = c.describe()
        (m,) = d.models
        assert (m.name, m.source, m.num_layers) == (NAME, "hf://org/alpha", 3)
        assert m.disk_bytes > 0 and m.last_used_unix > 0
        assert d.store.used_bytes >= m.disk_bytes
        assert d.fetches[0].state == pb.FETCH_STATE_DONE
        from warmserve_agent.cli.inspect import render  # `warmserve agent inspect`

        text = render(d)
        assert "STORE  used" in text and "budget none" in text
        assert "FETCHING" in text and "hf://org/alpha" in text and "done" in text
        t.join(10)
        fetch_events = [e.fetch for e in watched if e.kind == pb.WatchEvent.KIND_FETCH]
        assert fetch_events[-1].state == pb.FETCH_STATE_DONE and fetch_events[-1].model == NAME
        assert any(f.bytes_done and f.bytes_total for f in fetch_events)
        # Present now: a second prewarm (other GPU) downloads nothing and streams no fetch.
        n = sum(hub.downloads.values())
        msgs = list(c.prewarm(NAME, [1], 2, source="hf://org/alpha", request_id="p2"))
        assert not any(m.HasField("fetch") for m in msgs)
        assert sum(hub.downloads.values()) == n


def test_activate_cold_starts_a_model_it_fetches_first(tmp_path: Path, hub: HubServer) -> None:
    with AgentThread(agent_cfg(tmp_path, hub)) as a, SyncAgentClient(a.address) as c:
        r = c.activate("org/beta", [0], source="hf://org/beta", request_id="a1")
        assert not r.prewarm_hit and r.instance.model == "org/beta"
        assert c.describe().models[0].source == "hf://org/beta"


def test_refusals(tmp_path: Path, hub: HubServer) -> None:
    hub.corrupt["model-00001-of-00002.safetensors"] = 99
    cfg = agent_cfg(tmp_path, hub, fetch_attempts=2)
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        with pytest.raises(AgentError) as e:  # bad GPU: refused before any download
            list(c.prewarm("org/alpha", [7], 0, source="hf://org/alpha"))
        assert e.value.code.name == "INVALID_ARGUMENT"
        assert sum(hub.downloads.values()) == 0
        with pytest.raises(AgentError) as e:
            list(c.prewarm("org/alpha", [0], 0, source="s4://x/y"))
        assert e.value.code.name == "FAILED_PRECONDITION" and "unsupported model source" in str(
            e.value
        )
        with pytest.raises(AgentError) as e:
            list(c.prewarm("org/a/b", [0], 0, source="hf://org/alpha"))
        assert e.value.code.name == "INVALID_ARGUMENT" and "model name" in str(e.value)
        with pytest.raises(AgentError) as e:  # corrupted every time: refused after 2 attempts
            list(c.prewarm("org/alpha", [0], 0, source="hf://org/alpha"))
        assert e.value.code.name == "UNAVAILABLE" and "sha256" in str(e.value)
        with pytest.raises(AgentError) as e:  # no source, not in the store
            list(c.prewarm("org/beta", [0], 0))
        assert e.value.code.name == "NOT_FOUND" and "spec.model.source" in str(e.value)
        with pytest.raises(AgentError) as e:
            c.inspect_model("org/beta")
        assert e.value.code.name == "NOT_FOUND"
        d = c.describe()
        assert d.fetches[-1].state == pb.FETCH_STATE_FAILED
        assert "sha256" in d.fetches[-1].message
        assert not d.slots and not d.models
