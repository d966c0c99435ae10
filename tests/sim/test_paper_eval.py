"""bench/paper_eval.py renders docs/evaluation.md from a grid run (a tiny grid), and the
ablation report it prints says, per mechanism, whether it acted and changed anything."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import yaml

from tests.sim.conftest import make_doc

ROOT = Path(__file__).resolve().parents[2]
ABLATIONS = ("warmserve-no-lending,warmserve-no-keep-weights,warmserve-no-evict-aware,"
             "warmserve-no-prediction,warmserve-no-reclaim,warmserve-no-proactive")


def _load_module():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("paper_eval", ROOT / "bench" / "paper_eval.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_paper_eval_writes_markdown_and_json_and_rerenders(tmp_path):
    doc = make_doc(**{"workload.duration_s": 600, "workload.total_rps": 12,
                      "cluster.gpus_per_node": 4})
    doc["grid"] = {"alpha": [1.0], "total_rps": [12], "startup": ["paper", "fast-path"]}
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump(doc))
    out, res = tmp_path / "eval.md", tmp_path / "eval.json"
    mod = _load_module()
    rc = mod.main(["--scenario", str(scen), "--out", str(out), "--json", str(res),
                   "--systems", f"warmserve,sllm-gpu,dedicated,reactive,{ABLATIONS}", "--no-code",
                   "--no-window-ablation"])
    assert rc == 0
    text = out.read_text()
    for heading in ("## What a start costs under each profile", "## Goals, profile `paper`",
                    "## Goals, profile `fast-path`", "## Ablations, profile `paper`",
                    "## TTFT per model", "## `dedicated`: the best static allocation",
                    "## Simulator speed in this run"):
        assert heading in text, heading
    saved = json.loads(res.read_text())
    assert len(saved["points"]) == 2  # one grid point x two profiles
    for p in saved["points"]:
        names = {r["system"] for r in p["rows"]}
        assert "dedicated" in names  # shared by both profiles (it starts nothing)
        for r in p["rows"]:  # conservation, every system, every profile
            assert r["served"] + r["dropped"] == r["requests"] == p["facts"]["requests"]
    # the free-starts reference: reactive, one run per grid point, in its own column
    assert [r["overrides"]["startup"] for r in saved["references"]] == ["free-starts"]
    assert [r["system"] for r in saved["references"][0]["rows"]] == ["reactive"]
    assert "reactive P99, every start free" in text
    again = tmp_path / "again.md"
    assert mod.main(["--from-json", str(res), "--out", str(again)]) == 0
    assert again.read_text() == text
    # a section run by its own commands at the end of the page survives a re-render
    again.write_text(text + "\n## Under measured costs\n\nkept\n")
    assert mod.main(["--from-json", str(res), "--out", str(again)]) == 0
    assert again.read_text() == text + "\n## Under measured costs\n\nkept\n"

    # each ablation differs from WarmServe wherever its mechanism acted; the ones that never
    # acted are reported as such on the page (not hidden)
    from eval_goals import ablation_effects

    effects = [e for p in saved["points"] for e in ablation_effects(p)]
    assert {e["ablation"] for e in effects} == set(ABLATIONS.split(","))
    for e in effects:
        if e["exercised"]:
            assert e["differs"], f"{e['ablation']} acted but changed nothing"
    assert any(e["exercised"] for e in effects)
    for e in effects:
        if not any(f["exercised"] for f in effects if f["ablation"] == e["ablation"]):
            assert f"`{e['ablation']}`" in text and "never exercised on this grid" in text
