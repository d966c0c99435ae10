"""Errors raised in a GPU worker process reach the agent as the same type, with their fields.

A real worker process (``WorkerHandle``) runs the real simulated engine over a slot in a real
file; each kind of error is provoked the way it happens in service (wrong bytes at start, wrong
bytes of a layer announced later, a slot the engine cannot read, a command the worker refuses, a
bug) and must arrive as its own exception type: nothing in the agent reads the message to tell
them apart.  Then the record itself: every kind survives the trip, and a record of another
version is refused with a message naming both versions.  Last, through the gRPC API with worker
processes: a slot whose bytes are wrong fails the Activate and is quarantined.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import hypothesis.strategies as st
import pytest
from hypothesis import given
from warmserve_agent.engine import EngineError, WeightsMismatch, WeightVerificationError
from warmserve_agent.engines.spec import EngineSpec, SlotRegion, TensorPlacement
from warmserve_agent.testing import AgentThread
from warmserve_agent.worker import WorkerError, WorkerHandle
from warmserve_agent.worker_errors import PIPE_VERSION, ErrorKind, WorkerFault

from tests.agent.agent_support import cfg_for
from warmserve.api.agent.client import AgentError, SyncAgentClient
from warmserve.api.agent.v1 import agent_pb2 as pb

PAGE = 4096
LAYER_BYTES = 3000


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerHandle]:
    h = WorkerHandle()
    try:
        h.wait_ready()
        yield h
    finally:
        h.stop()


def slot_spec(tmp_path: Path, *, bad_layers: set[int], resident: int, readable: bool = True):
    """A two-layer slot in a file (weights, then one KV page); the store's digests of the
    layers in ``bad_layers`` do not match the bytes in the slot."""
    layers = [bytes([i + 1]) * LAYER_BYTES for i in range(2)]
    weights = b"".join(layers)
    npages = -(-len(weights) // PAGE) + 1
    path = tmp_path / "gpu0.mem"
    path.write_bytes(weights.ljust(npages * PAGE, b"\0"))
    tensors = tuple(
        TensorPlacement(
            f"layers.{i}.weight",
            i,
            i * LAYER_BYTES,
            LAYER_BYTES,
            "U8",
            (LAYER_BYTES,),
            (LAYER_BYTES,),
        )
        for i in range(2)
    )
    digests = tuple(
        hashlib.blake2b(b"not these bytes" if i in bad_layers else data, digest_size=16).hexdigest()
        for i, data in enumerate(layers)
    )
    region = SlotRegion(
        gpu=0,
        va=0,
        page_bytes=PAGE,
        weight_bytes=len(weights),
        kv_bytes=npages * PAGE - len(weights),
        local=True,
        host_file=str(path) if readable else "",
        ppages=tuple(range(npages)),
    )
    return EngineSpec(
        engine="simulated",
        model="tiny",
        instance_id="inst-000000000001",
        model_dir=str(tmp_path),
        layers_total=2,
        layers_resident=resident,
        kv_capacity_bytes=region.kv_bytes,
        regions=(region,),
        tensors=tensors,
        digests=(digests,),
    )


# ---- a real worker process ----------------------------------------------------------------------
def test_wrong_bytes_at_start_arrive_as_weight_verification_error(
    worker: WorkerHandle, tmp_path: Path
) -> None:
    spec = slot_spec(tmp_path, bad_layers={1}, resident=2)
    with pytest.raises(WeightVerificationError) as ei:
        worker.call("start_engine", spec=spec)
    assert ei.value.tensors == ("layers.1.weight[rank 0]",)
    assert "differ from the store" in str(ei.value) and "start_engine failed" in str(ei.value)


def test_wrong_bytes_of_a_later_layer_arrive_as_weights_mismatch(
    worker: WorkerHandle, tmp_path: Path
) -> None:
    spec = slot_spec(tmp_path, bad_layers={1}, resident=1)
    assert worker.call("start_engine", spec=spec).startswith("http://127.0.0.1:")
    try:
        with pytest.raises(WeightsMismatch) as ei:
            worker.call("layers_ready", n=2)
        assert ei.value.tensors == ("layers.1.weight[rank 0]",)
        assert worker.call("stats").bad_tensors == ("layers.1.weight[rank 0]",)
    finally:
        worker.call("stop_engine")


def test_an_unreadable_slot_arrives_as_engine_error(worker: WorkerHandle, tmp_path: Path) -> None:
    spec = slot_spec(tmp_path, bad_layers=set(), resident=2, readable=False)
    with pytest.raises(EngineError) as ei:
        worker.call("start_engine", spec=spec)
    assert type(ei.value) is EngineError  # not a weights error: the slot's bytes may be fine
    assert "cannot read any shard of its slot" in str(ei.value)


def test_a_refused_command_and_a_bug_arrive_as_worker_error(worker: WorkerHandle) -> None:
    with pytest.raises(WorkerError, match="stats failed: WorkerError: no engine is running"):
        worker.call("stats")
    with pytest.raises(WorkerError, match=r"bind failed: TypeError: .*gpu"):
        worker.call("bind")  # the handler's own TypeError: kind UNEXPECTED
    assert worker.call("ping")["pid"] == worker.pid  # the worker serves on


# ---- the record ---------------------------------------------------------------------------------
KINDS = [
    (WeightsMismatch("m", tensors=["a[rank 1]"]), ErrorKind.WEIGHTS_MISMATCH, WeightsMismatch),
    (
        WeightVerificationError("v", tensors=["b[rank 0]", "c[rank 0]"]),
        ErrorKind.WEIGHT_VERIFICATION,
        WeightVerificationError,
    ),
    (EngineError("e"), ErrorKind.ENGINE, EngineError),
    (WorkerError("w"), ErrorKind.WORKER, WorkerError),
    (KeyError("k"), ErrorKind.UNEXPECTED, WorkerError),
]


@pytest.mark.parametrize(("exc", "kind", "raised"), KINDS, ids=[k.value for _, k, _ in KINDS])
def test_every_kind_survives_the_record(
    exc: BaseException, kind: ErrorKind, raised: type[Exception]
) -> None:
    fault = WorkerFault.from_wire(WorkerFault.of(exc).to_wire())
    assert fault.kind == kind and fault.exc_type == type(exc).__name__
    again = fault.exception("worker gpu 3: cmd failed")
    assert type(again) is raised
    assert str(again) == f"worker gpu 3: cmd failed: {type(exc).__name__}: {exc}"
    assert getattr(again, "tensors", ()) == getattr(exc, "tensors", ())


@given(message=st.text(max_size=200), tensors=st.lists(st.text(max_size=40), max_size=5))
def test_weights_mismatch_fields_round_trip(message: str, tensors: list[str]) -> None:
    got = WorkerFault.from_wire(WorkerFault.of(WeightsMismatch(message, tensors)).to_wire())
    assert (got.kind, got.message, got.tensors) == (
        ErrorKind.WEIGHTS_MISMATCH,
        message,
        tuple(tensors),
    )


@pytest.mark.parametrize(
    ("record", "why"),
    [
        (
            {**WorkerFault.of(EngineError("x")).to_wire(), "version": PIPE_VERSION + 1},
            f"version {PIPE_VERSION + 1}, this agent reads version {PIPE_VERSION}",
        ),
        ("EngineError: x", r"cannot read \(EngineError: x\)"),  # an earlier worker's text
        (
            {**WorkerFault.of(EngineError("x")).to_wire(), "kind": "no-such-kind"},
            "unreadable error record",
        ),
    ],
    ids=["newer-version", "text", "unknown-kind"],
)
def test_a_record_this_agent_cannot_read_is_refused(record: object, why: str) -> None:
    with pytest.raises(WorkerError, match=why) as ei:
        WorkerFault.from_wire(record)
    assert type(ei.value) is WorkerError


# ---- through the API, with worker processes -----------------------------------------------------
def test_wrong_bytes_in_a_worker_hosted_engine_quarantine_the_slot(
    tmp_path: Path, model_root: Path
) -> None:
    with AgentThread(cfg_for(tmp_path, model_root, use_workers=True)) as a:
        c = SyncAgentClient(a.address)
        try:
            slot = c.prewarm_wait("gamma", [0]).slot
            core = a.server.core
            lay = core.slots[slot.slot_id].layout
            core.mm.write(slot.slot_id, 0, lay.placements[0].slot_offset, b"\xde\xad\xbe\xef")
            with pytest.raises(AgentError) as ei:
                c.activate("gamma", [0])
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            assert "WeightVerificationError" in ei.value.message
            d = c.describe()
            assert d.slots[0].state == pb.SLOT_STATE_FAILED
            assert "verification" in d.slots[0].message
            assert d.gpus[0].state == pb.WORKER_STATE_UNIVERSAL and not d.instances
        finally:
            c.close()
