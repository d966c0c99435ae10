"""bench/paper_eval.py renders docs/evaluation.md from a grid run (smoke test on a tiny grid)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

from tests.sim.conftest import make_doc

ROOT = Path(__file__).resolve().parents[2]


def _load_module():
    spec = importlib.util.spec_from_file_location("paper_eval", ROOT / "bench" / "paper_eval.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_paper_eval_writes_markdown_and_json_and_rerenders(tmp_path):
    doc = make_doc(**{"workload.duration_s": 300})
    doc["grid"] = {"alpha": [1.0], "total_rps": [3, 6]}
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump(doc))
    out, res = tmp_path / "eval.md", tmp_path / "eval.json"
    mod = _load_module()
    rc = mod.main(["--scenario", str(scen), "--out", str(out), "--json", str(res),
                   "--systems", "warmserve,sllm-gpu,dedicated"])
    assert rc == 0
    text = out.read_text()
    for heading in ("## Main table", "## Our numbers next to the paper's",
                    "## Simulator speed", "simulated requests per wall second"):
        assert heading in text
    saved = json.loads(res.read_text())
    assert len(saved["points"]) == 2
    assert all(len(p["rows"]) == 3 for p in saved["points"])
    again = tmp_path / "again.md"
    assert mod.main(["--from-json", str(res), "--out", str(again)]) == 0
    assert again.read_text().split("\n", 3)[3] == text.split("\n", 3)[3]
