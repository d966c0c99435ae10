"""Scale: what the operator writes per deployment, against in-memory agents and API.

* ``Accepted`` / ``SpecChanged`` come from the loop, once per spec generation (also across
  restarts, from ``status.observedGeneration``), queued within the Event budget, never dropped;
* a history written right after its deployment is read a poll later;
* kopf keeps no diff-base (one write per new deployment: its finalizer).
"""

from __future__ import annotations

import asyncio

import kopf
import pytest
import warmserve_operator.report as report
from warmserve_operator.handlers import NoDiffBase

from tests.operator.test_reconciler import Harness, seed_history


async def settle() -> None:
    """Let the Reporter's queued-Event task (posting to the in-memory API) run to its end."""
    for _ in range(20):
        await asyncio.sleep(0)


async def ticks(h: Harness, n: int) -> None:
    for _ in range(n):
        await h.tick()
        await settle()


def lifecycle(h: Harness, name: str) -> list[str]:
    return [
        r for r in h.kube.reasons(f"ModelDeployment/{name}") if r in ("Accepted", "SpecChanged")
    ]


async def test_accepted_once_then_spec_changed_once_per_generation_across_restarts() -> None:
    h = Harness()
    h.kube.add_md("a", "llama-a", maxBatchSize=4)
    await ticks(h, 4)
    assert lifecycle(h, "a") == ["Accepted"]
    assert h.status("a")["observedGeneration"] == 1

    md = h.kube.mds[("default", "a")]
    md["spec"]["maxBatchSize"], md["metadata"]["generation"] = 8, 2
    await ticks(h, 4)
    assert lifecycle(h, "a") == ["Accepted", "SpecChanged"]
    assert h.status("a")["observedGeneration"] == 2

    h.rec = h.new_reconciler()  # a restart: the status says generation 2 was seen
    await ticks(h, 3)
    assert lifecycle(h, "a") == ["Accepted", "SpecChanged"], "nothing posted again"

    md["spec"]["maxBatchSize"], md["metadata"]["generation"] = 16, 3  # changed while down
    h.rec = h.new_reconciler()
    await ticks(h, 3)
    assert lifecycle(h, "a") == ["Accepted", "SpecChanged", "SpecChanged"]
    last = [m for (_r, _t, reason, m) in h.kube.events if reason == "SpecChanged"][-1]
    assert "maxBatchSize 16" in last


async def test_lifecycle_events_beyond_the_budget_wait_instead_of_being_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(report, "EVENT_BURST", 3.0)
    monkeypatch.setattr(report, "EVENT_RATE", 2.0)  # 1 Event per 0.5 s tick
    h = Harness()
    names = [f"d{i}" for i in range(8)]
    for name in names:
        h.kube.add_md(name, "llama-a", maxBatchSize=4)  # one owner, seven duplicates
    await ticks(h, 2)
    posted = sum(len(lifecycle(h, n)) for n in names)
    assert 0 < posted < len(names), "the budget holds the burst back"
    await ticks(h, 40)
    assert all(lifecycle(h, n) == ["Accepted"] for n in names), h.kube.events
    # Condition Events over the budget are dropped (and counted), lifecycle ones never.
    dropped = h.rec.metrics.events_dropped._value.get()
    assert dropped >= 1


async def test_a_history_written_right_after_its_deployment_is_read_a_poll_later() -> None:
    h = Harness()
    reads: list[list[str]] = []
    read = h.kube.read_histories

    async def counting(uids: list[str]) -> dict[str, dict[str, str]]:
        reads.append(sorted(uids))
        return await read(uids)

    h.kube.read_histories = counting  # type: ignore[method-assign]
    h.kube.add_md("a", "llama-a", maxBatchSize=4)
    await h.tick()  # first sight: no history stored yet
    assert len(h.rec.controller.history("llama-a")) == 0
    seed_history(h.kube, "a", "llama-a", h.clock.t, avg=2.0, peak=4.0)
    await h.tick(2)  # poll_s = 0.5 s later: looked for once more
    assert len(h.rec.controller.history("llama-a")) == 20
    h.kube.add_md("b", "llama-b", maxBatchSize=4)
    await h.tick(6)  # never written: looked for twice, then not again
    assert reads == [["uid-a"], ["uid-a"], ["uid-b"], ["uid-b"]]


def test_kopf_keeps_no_diff_base() -> None:
    store = NoDiffBase()
    body = kopf.Body({"metadata": {"name": "a"}, "spec": {"x": 1}})
    patch = kopf.Patch()
    assert store.fetch(body=body) is None
    store.store(body=body, patch=patch, essence=store.build(body=body))
    assert not patch, "nothing to write"
