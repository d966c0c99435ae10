"""Tests of ``warmserve plan`` and the cluster snapshot reader (warmserve.cluster_snapshot)."""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from warmserve import cli
from warmserve.cluster_snapshot import load_cluster_state, parse_cluster_state, parse_size
from warmserve.policy.cluster import GiB, PolicyInputError, WorkerState

EXAMPLE = Path(str(resources.files("warmserve") / "data" / "examples" / "cluster.json"))


@pytest.fixture(autouse=True)
def _only_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exercise cli.main without depending on other subcommands' modules.
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("warmserve.cli.plan",))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def example() -> dict[str, Any]:
    return json.loads(EXAMPLE.read_text())


# --------------------------------------------------------------------------- happy paths


def test_example_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["plan", str(EXAMPLE), "--json"], capsys)
    assert rc == 0 and err == ""
    doc = json.loads(out)
    s = doc["summary"]
    assert (s["gpus"], s["models"]) == (16, 4)
    assert s["requested"] == s["kept"] + s["placed"] + s["unplaced"]
    assert s["kept"] == 2 and s["placed"] >= 1
    for r in doc["replicas"]:
        assert set(r) >= {"model", "kind", "rank", "score", "node", "gpus", "action"}
        assert r["action"] in ("keep", "place")
    for u in doc["unplaced"]:
        assert u["reason"]
    # The 70B basic replica goes to the free aligned block of node-b.
    seventy = [r for r in doc["replicas"] if r["model"] == "llama2-70b" and r["kind"] == "basic"]
    assert [(r["node"], r["gpus"]) for r in seventy] == [("node-b", [4, 5, 6, 7])]


def test_example_table_and_start(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(
        ["plan", str(EXAMPLE), "--start", "llama2-7b-1", "--start", "llama2-70b"], capsys
    )
    assert rc == 0
    assert "ACTION" in out and "SCORE" in out and "keep" in out and "place" in out
    assert "llama2-7b-1: hit on node-a GPUs 5" in out
    assert "llama2-70b: cold on node-b GPUs 4,5,6,7" in out


def test_ablation_flag(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["plan", str(EXAMPLE), "--json", "--no-evict-aware"], capsys)
    assert rc == 0 and json.loads(out)["evict_aware"] is False


def test_help_documents_schema(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    words = ("nodes", "models", "replicas", "instances", "80GiB", "12.55GB", "active_instances")
    for word in words:
        assert word in out


def test_plan_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    a = run(["plan", str(EXAMPLE), "--json"], capsys)[1]
    b = run(["plan", str(EXAMPLE), "--json"], capsys)[1]
    assert a == b


# --------------------------------------------------------------------------- scenario rules


def test_sizes() -> None:
    assert parse_size(1234) == 1234
    assert parse_size("80GiB") == 80 * GiB
    assert parse_size("12.55GB") == 12_550_000_000
    assert parse_size("2 MiB") == 2 * 1024**2
    assert parse_size("512") == 512
    for bad, msg in [
        (-1, "negative"),
        ("-3GB", "negative"),
        ("12XB", "unknown unit"),
        ("lots", "bad size"),
        (1.5, "expected bytes"),
        (True, "expected a size"),
    ]:
        with pytest.raises(PolicyInputError, match=msg):
            parse_size(bad, "x")


def test_free_defaults() -> None:
    s = load_cluster_state(EXAMPLE)
    a = s.node("node-a")
    assert a.gpu(0).free_bytes == 0 and a.gpu(0).state == WorkerState.DEDICATED
    # grace GPU: Eq. 1 with R=3, C=32, M=60 GiB, K=4 GiB -> 54.125 GiB lendable
    assert a.gpu(4).free_bytes == int(54.125 * GiB)
    # universal GPU: memory minus the resident 7B replica (12.55 GB)
    assert a.gpu(5).free_bytes == 80 * GiB - 12_550_000_000
    assert a.gpu(6).free_bytes == 80 * GiB
    assert s.active_instances("llama2-70b") == 1 and s.active_instances("llama2-7b-0") == 0


def _mutate(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(example())
    *parents, last = path.split(".")
    cur: Any = doc
    for p in parents:
        cur = cur[int(p)] if p.isdigit() else cur[p]
    if value is _DELETE:
        del cur[int(last) if last.isdigit() else last]
    else:
        cur[int(last) if last.isdigit() else last] = value
    return doc


_DELETE = object()

BAD = [
    ("nodes.0.gpus.0.color", "red", r"nodes\[0\]\.gpus\[0\]: unknown field 'color'"),
    ("models.0.weight", "-12GB", r"models\[0\]\.weight: negative size"),
    ("nodes.0.gpus.6.memory", -5, r"nodes\[0\]\.gpus\[6\]\.memory: negative size"),
    ("models.3.tp", 16, r"models\[3\]\.tp: 16 GPUs exceed every node \(largest has 8\)"),
    ("replicas.0.gpus", [9], r"replicas\[0\]\.gpus: GPU 9 does not exist"),
    ("instances.0.gpus", [0, 1, 2, 8], r"instances\[0\]\.gpus: GPU 8 does not exist"),
    ("nodes.1.name", "node-a", r"nodes: duplicate node name 'node-a'"),
    ("models.1.name", "llama2-7b-0", r"models: duplicate model name 'llama2-7b-0'"),
    ("nodes.0.gpus.1.id", 0, r"duplicate GPU id 0"),
    ("instances.1.name", "llama2-70b-a", r"instances: duplicate instance name"),
    ("models.3.active_instances", 2, r"models\[3\]\.active_instances: says 2"),
    ("models.0.avg_load", _DELETE, r"models\[0\]: missing field 'avg_load'"),
    ("models.0.peak_load", -1, r"models\[0\]\.peak_load: must be a finite number >= 0"),
    ("replicas.0.model", "gpt-9", r"replicas\[0\]\.model: unknown model 'gpt-9'"),
    ("replicas.0.node", "node-z", r"replicas\[0\]\.node: unknown node 'node-z'"),
    ("replicas.1.gpus", [2], r"replicas\[1\]\.gpus: 1 GPUs but the model's tp is 2"),
    ("nodes.0.gpus.6.state", "busy", r"nodes\[0\]\.gpus\[6\]\.state: unknown value 'busy'"),
    ("nodes.0.gpus.0.free", "1GiB", r"a dedicated GPU lends nothing"),
    ("nodes.0.gpus.6.free", "90GiB", r"nodes\[0\]\.gpus\[6\]\.free: .* exceeds memory"),
    ("instances.0.phase", "grace", r"needs it grace"),
    ("instances.1.kv_used", "61GiB", r"instances\[1\]\.kv_used: .* exceeds kv_capacity"),
    ("nodes", [], r"nodes: must not be empty"),
    ("models", {}, r"models: expected a list"),
    ("extra", 1, r"scenario: unknown field 'extra'"),
]


@pytest.mark.parametrize(("path", "value", "pattern"), BAD)
def test_bad_scenarios_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], path: str, value: Any, pattern: str
) -> None:
    doc = _mutate(path, value)
    with pytest.raises(PolicyInputError, match=pattern):
        parse_cluster_state(doc)
    f = tmp_path / "s.json"
    f.write_text(json.dumps(doc))
    rc, out, err = run(["plan", str(f)], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("warmserve plan: error: ")
    assert "Traceback" not in err


def test_overlapping_instances_rejected() -> None:
    doc = example()
    doc["instances"].append(
        {"name": "x", "model": "llama2-7b-1", "node": "node-a", "gpus": [3], "phase": "serving"}
    )
    with pytest.raises(PolicyInputError, match="GPU 3 of node-a already serves 'llama2-70b-a'"):
        parse_cluster_state(doc)


def test_missing_file_and_invalid_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["plan", str(tmp_path / "nope.json")], capsys)
    assert rc == 2 and "scenario file not found" in err and err.count("\n") == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": [,]}')
    rc, _, err = run(["plan", str(bad)], capsys)
    assert rc == 2 and "invalid JSON at line 1 column 12" in err
    rc, _, err = run(["plan", str(EXAMPLE), "--start", "gpt-9"], capsys)
    assert rc == 2 and "unknown model 'gpt-9'" in err
