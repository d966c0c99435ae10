"""Tensor parallelism on real vLLM (CPU): a TP=2 tiny Llama prewarmed on a 2-GPU group of an
agent with pooled workers, each rank's shards in its own GPU's slot, rank 1 a pooled worker
adopted by rank 0's executor, the ranks' process group formed when the engine is prepared at
prewarm time.  The hit's tokens equal plain vLLM ``--tensor-parallel-size 2`` on the same
weights; the weight files are overwritten before the Activate, so nothing is read from them."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engines.helpers import post_json
from tests.engines.test_vllm_engine import (
    ARGS,
    PAGE,
    PROMPT,
    REF_SCRIPT,
    _garble_weight_files,
    _tokens,
)

pytestmark = pytest.mark.vllm

REF_TP2 = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
          kv_cache_memory_bytes=8 * 1024**2, tensor_parallel_size=2,
          distributed_executor_backend="mp")
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                   SamplingParams(max_tokens=int(sys.argv[3]), temperature=0))
print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
os._exit(0)
"""


# vLLM's fused parameters and the checkpoint tensors they load, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _rank_shards(model_dir: Path, tp: int, rank: int) -> dict[str, bytes]:
    """What rank ``rank`` of ``tp`` must hold for each of vLLM's parameter names: the slices
    ``warmserve.policy.tensor_parallel.rank_slice`` gives (checked against vLLM's own weight
    loaders in test_vllm_tp_layout.py), fused parts concatenated, read from the files now."""
    from safetensors.numpy import load_file

    from warmserve.policy.tensor_parallel import rank_slice, tp_shape_from_config

    shape = tp_shape_from_config(json.loads((model_dir / "config.json").read_text()))
    ckpt: dict[str, object] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        ckpt.update(load_file(str(f)))

    def piece(name: str) -> bytes:
        a = ckpt[name]
        raw = a.tobytes()  # type: ignore[attr-defined]
        sl = rank_slice(name, a.shape, a.itemsize, tp, rank, shape)  # type: ignore[attr-defined]
        return b"".join(raw[s : s + n] for s, n in sl.ranges)

    out: dict[str, bytes] = {}
    for name in ckpt:
        module = name.rsplit(".", 2)[-2]
        fused = next((f for f, parts in FUSED.items() if module in parts), None)
        if fused is None:
            out[name] = piece(name)
        elif module == FUSED[fused][0]:
            out[name.replace(module, fused)] = b"".join(
                piece(name.replace(module, part)) for part in FUSED[fused]
            )
    return out


def _check_rank_params(
    params: dict[str, tuple[int, int, bytes]], want: dict[str, bytes], rank: int
) -> None:
    """Every parameter of the rank is a view of its own slot, holding exactly its shard."""
    assert set(params) == set(want), (rank, sorted(set(params) ^ set(want)))
    for name, (off, n, data) in params.items():
        assert off >= 0, f"rank {rank}: {name} is not a view of its slot"
        assert n >= len(want[name]), (rank, name, n, len(want[name]))
        assert data[: len(want[name])] == want[name], f"rank {rank}: {name} holds other bytes"
    spans = sorted((off, off + n) for off, n, _ in params.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), f"rank {rank}: views overlap"


@pytest.fixture(scope="module")
def tp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmserve_agent.engines.vllm.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("tpmodels")
    # 4 heads / 2 KV heads, vocabulary 512: every tensor splits 2 ways as vLLM's layers load it
    make_tiny_llama(root / "tiny", layers=4, hidden=128, heads=4, kv_heads=2, seed=11)
    return root


def _agent_config(tmp_path: Path, tp_root: Path, **kw: Any) -> Any:
    """An agent with two simulated GPUs, pooled workers and the vLLM engine over ``tp_root``."""
    from warmserve_agent.config import AgentConfig, parse_simulated_gpus

    return AgentConfig(
        model_dir=tp_root,
        simulate_gpus=parse_simulated_gpus("2x48MiB"),
        listen="127.0.0.1:0",
        page_bytes=PAGE,
        memory_dir=tmp_path / "mem",
        spare_workers=0,
        engines=("vllm",),
        **kw,
    )


def _reference(script: str, model_dir: Path) -> list[int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), VLLM_CPU_OMP_THREADS_BIND="0|1")
    out = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), json.dumps(PROMPT), "16"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("TOKENS ")), None)
    assert line, f"reference vLLM failed:\n{out.stderr[-4000:]}"
    return json.loads(line[7:])


@pytest.fixture(scope="module")
def reference_tp2(tp_root: Path) -> list[int]:
    """Greedy tokens of plain vLLM with --tensor-parallel-size 2 loading the files itself."""
    return _reference(REF_TP2, tp_root / "tiny")


@pytest.fixture(scope="module")
def reference_tp1(tp_root: Path) -> list[int]:
    """The same with tensor parallelism 1."""
    return _reference(REF_SCRIPT, tp_root / "tiny")


def _restorer(model_dir: Path) -> Callable[[], None]:
    """Put the weight files back as they are now (bytes and times)."""
    kept = {f: (f.read_bytes(), f.stat()) for f in model_dir.glob("*.safetensors")}

    def restore() -> None:
        for f, (data, st) in kept.items():
            f.write_bytes(data)
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))

    return restore


def test_tp2_hit_from_per_rank_slots_equals_plain_vllm_tp2(
    tmp_path: Path, tp_root: Path, reference_tp2: list[int], request: pytest.FixtureRequest
) -> None:
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient, pb

    cfg = _agent_config(tmp_path, tp_root)
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as c:
        t0 = time.monotonic()
        sid = c.prewarm_wait("tiny", [0, 1], engine="vllm", engine_args=ARGS).slot_id
        deadline = time.monotonic() + 600
        while True:
            (s,) = c.describe().slots
            st = s.prepared_engine.state
            assert st != pb.PREPARED_ENGINE_STATE_FAILED, s.prepared_engine.message
            if st == pb.PREPARED_ENGINE_STATE_READY:
                break
            assert time.monotonic() < deadline, "no prepared engine"
            time.sleep(0.2)
        prepared_s = time.monotonic() - t0
        # the group exists now: rank 1's worker holds its rank, joined at prewarm time
        rank1 = agent.server.pool.worker(1)
        assert rank1.call("ping")["engine_builds"] == 0
        shards = [_rank_shards(tp_root / "tiny", 2, r) for r in range(2)]
        assert shards[0] != shards[1]
        saved = _restorer(tp_root / "tiny")
        garbled = _garble_weight_files(tp_root / "tiny")  # a read at activation would show
        request.addfinalizer(saved)  # the module's later tests load the real weights
        assert garbled > 0
        t1 = time.monotonic()
        res = c.activate("tiny", [0, 1], slot_id=sid, engine="vllm", engine_args=ARGS)
        activate_s = time.monotonic() - t1
        assert res.prewarm_hit and res.instance.stages.engine_prepared
        assert _tokens(res.instance.endpoint) == reference_tp2
        assert agent.server.pool.worker(0).call("ping")["engine_builds"] == 1
        for r in range(2):  # rank r's parameters: views of GPU r's slot, its shards there
            _check_rank_params(agent.server.pool.worker(r).call("slot_params"), shards[r], r)
        print(f"TP2 prepared in {prepared_s:.1f}s, Activate {activate_s * 1000:.0f} ms")


def _prepared_ready(c: object, deadline_s: float = 600) -> None:
    from warmserve.api.agent.client import pb

    deadline = time.monotonic() + deadline_s
    while True:
        (s,) = c.describe().slots  # type: ignore[attr-defined]
        st = s.prepared_engine.state
        assert st != pb.PREPARED_ENGINE_STATE_FAILED, s.prepared_engine.message
        if st == pb.PREPARED_ENGINE_STATE_READY:
            return
        assert time.monotonic() < deadline, "no prepared engine"
        time.sleep(0.2)


def test_tp2_dead_rank_ends_the_instance_frees_both_slots_and_the_workers_serve_again(
    tmp_path: Path, tp_root: Path
) -> None:
    """Rank 1's pooled worker is killed (SIGKILL) while the TP=2 instance answers a stream of
    requests.  Memory owned by the workers, as deployed on GPUs: GPU 1's memory dies with it.
    The instance ends (INSTANCE_REMOVED), every rank's slot and pages are freed, the request in
    flight returns, nothing waits long; rank 0's worker and rank 1's replacement then prewarm,
    prepare and serve a TP=2 slot of the same model again (its group formed a second time at
    Activate: the engine prepared for other arguments is dropped), and EndInstance of that
    instance returns in bounded time."""
    import signal
    import threading
    import urllib.error

    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient

    cfg = _agent_config(tmp_path, tp_root, memory_in_workers=True)
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as c:
        pool = agent.server.pool
        sid = c.prewarm_wait("tiny", [0, 1], engine="vllm", engine_args=ARGS).slot_id
        _prepared_ready(c)
        res = c.activate("tiny", [0, 1], slot_id=sid, engine="vllm", engine_args=ARGS)
        want = _tokens(res.instance.endpoint)
        pid0, pid1 = pool.worker(0).pid, pool.worker(1).pid

        outcomes: list[str] = []
        stop = threading.Event()

        def load() -> None:  # requests in flight when the rank dies
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0}
            while not stop.is_set():
                try:
                    status, _ = post_json(f"{res.instance.endpoint}/v1/completions", body, 60)
                    outcomes.append(str(status))
                except (urllib.error.URLError, OSError) as exc:
                    outcomes.append(type(exc).__name__)
                    return  # the endpoint is gone

        t = threading.Thread(target=load, daemon=True)
        t.start()
        while not outcomes:
            time.sleep(0.05)
        t0 = time.monotonic()
        os.kill(pid1, signal.SIGKILL)
        gone_s = 0.0
        while True:  # rank 0 in a collective with the dead rank never returns: it is ended
            d = c.describe()
            gone = not d.instances and not d.slots
            freed = all(g.pages_free == g.pages_total for g in d.gpus)
            if gone and freed and not gone_s:
                gone_s = time.monotonic() - t0
            alive = all(pool.worker(g).alive() for g in (0, 1))
            if gone_s and alive and d.gpus[1].worker_restarts == 1:
                break
            assert time.monotonic() < t0 + 150, f"not cleaned up and replaced in 150 s:\n{d}"
            time.sleep(0.2)
        assert gone_s < 30, f"the instance and its slots took {gone_s:.1f} s to go"
        # the group's shared memory (vLLM's CPU all-reduce) does not outlive its ranks
        assert not list(Path("/dev/shm").glob(f"{sid}.store-*"))
        replaced_s = time.monotonic() - t0
        stop.set()
        t.join(timeout=30)
        assert not t.is_alive(), "a request in flight when rank 1 died never returned"
        assert pool.worker(1).pid != pid1
        assert not d.gpus[0].prepared_slot_id and not d.gpus[1].prepared_slot_id
        rank0_ended = pool.worker(0).pid != pid0

        # The survivors serve again: the same group, a new slot whose engine is prepared for
        # other arguments (its group forms at prewarm), so Activate drops it and builds its
        # own, the group formed anew over the same ranks' slots.
        other = [*ARGS, "--max-num-seqs", "17"]
        sid2 = c.prewarm_wait("tiny", [0, 1], engine="vllm", engine_args=other).slot_id
        _prepared_ready(c)
        res2 = c.activate("tiny", [0, 1], slot_id=sid2, engine="vllm", engine_args=ARGS)
        assert res2.prewarm_hit and not res2.instance.stages.engine_prepared
        assert _tokens(res2.instance.endpoint) == want
        c.begin_grace(res2.instance.instance_id)  # ends in time: every rank's thread wakes
        t1 = time.monotonic()
        c.end_instance(res2.instance.instance_id, evict_weights=True)
        end_s = time.monotonic() - t1
        assert end_s < 20, f"EndInstance of the TP=2 instance took {end_s:.1f} s"
        print(
            f"dead rank: instance and slots gone in {gone_s:.1f} s, workers replaced in "
            f"{replaced_s:.1f} s (rank 0's ended: {rank0_ended}), outcomes {outcomes[-3:]}; "
            f"EndInstance {end_s:.1f} s"
        )


def _poison_free_pages(agent: Any) -> int:
    """A previous tenant's bytes in every page no slot maps now: NaN (0xFF) everywhere, so KV
    blocks a request used without zeroing them would turn its logits to NaN."""
    be = agent.server.core.mm.backend
    n = 0
    for g, mem in be._mm.items():
        page = be.page_bytes
        for p in range(len(mem) // page):
            if p not in be._used[g]:
                mem[p * page : (p + 1) * page] = b"\xff" * page
                n += 1
    return n


def test_engines_rebuilt_in_the_same_pooled_workers_over_a_previous_tenants_pages(
    tmp_path: Path, tp_root: Path, reference_tp1: list[int], reference_tp2: list[int]
) -> None:
    """A pooled worker's history does not change its next engine.  GPU 0's worker serves a TP=1
    engine first, then a TP=2 slot's engine is prepared for other arguments and built again at
    Activate (the slot's group formed twice over the same workers): each group gets vLLM's CPU
    shared-memory all-reduce, named as in a fresh process (vLLM names groups by a per-process
    counter, and ranks whose names differ fall back to gloo over TCP), and the second build is
    not refused for the first one's segment.  Every free page holds NaN before each activation
    (a previous tenant's KV): blocks are zeroed as vLLM hands them out, on every rank, so the
    answers are plain vLLM's."""
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient

    cfg = _agent_config(tmp_path, tp_root)
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as c:
        assert _poison_free_pages(agent) > 0
        res = c.activate("tiny", [0], engine="vllm", engine_args=ARGS)
        assert _tokens(res.instance.endpoint) == reference_tp1
        c.begin_grace(res.instance.instance_id)
        c.end_instance(res.instance.instance_id, evict_weights=True)

        other = [*ARGS, "--max-num-seqs", "17"]  # a prepared engine the activation drops
        sid = c.prewarm_wait("tiny", [0, 1], engine="vllm", engine_args=other).slot_id
        _prepared_ready(c)
        want = [f"{sid}.store-tp:0-[0-1]-cpushm_{r}" for r in range(2)]
        assert sorted(p.name for p in Path("/dev/shm").glob(f"{sid}.store-*")) == want
        assert _poison_free_pages(agent) > 0
        res2 = c.activate("tiny", [0, 1], slot_id=sid, engine="vllm", engine_args=ARGS)
        assert res2.prewarm_hit and not res2.instance.stages.engine_prepared
        assert sorted(p.name for p in Path("/dev/shm").glob(f"{sid}.store-*")) == want
        assert _tokens(res2.instance.endpoint) == reference_tp2
        c.begin_grace(res2.instance.instance_id)
        c.end_instance(res2.instance.instance_id, evict_weights=True)
        # evicted: no name of its group is left for a later kill of the workers to strand
        assert not list(Path("/dev/shm").glob(f"{sid}.store-*"))
