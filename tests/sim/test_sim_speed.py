"""bench/sim_speed.py on a tiny scenario: the table's fields, the set-up reported apart, and the
checkpointed predictor fold (a second run from the same history does not fold again)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from tests.sim.conftest import make_doc

ROOT = Path(__file__).resolve().parents[2]


def _load_module():
    spec = importlib.util.spec_from_file_location("sim_speed", ROOT / "bench" / "sim_speed.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_run_part_reports_rates_and_setup_apart(tmp_path, monkeypatch):
    from warmserve.policy import warm_predictor

    warm_predictor.clear_cache()
    folds: list[int] = []
    real_fold = warm_predictor.fold

    def counting_fold(state, h):
        folds.append(h.size)
        return real_fold(state, h)

    monkeypatch.setattr(warm_predictor, "fold", counting_fold)
    scen = tmp_path / "s.yaml"
    scen.write_text(yaml.safe_dump(make_doc()))
    mod = _load_module()
    mod.ROOT = tmp_path  # the part records its scenario relative to ROOT
    res = mod.run_part("tiny", scen, {}, ["warmserve"])
    first = len(folds)
    assert first > 0  # the first run folds each model's history (average and peak)
    res2 = mod.run_part("tiny", scen, {}, ["warmserve", "sllm-gpu"])
    assert len(folds) == first  # ... the next run from the same history starts from a copy
    # ... and simulates exactly what the first did
    w1, w2 = res["rows"][0], res2["rows"][0]
    for key in ("events", "starts", "start_failures"):
        assert w1[key] == w2[key], key
    rows = {r["system"]: r for r in res2["rows"]}
    assert set(rows) == {"warmserve", "sllm-gpu"}
    for r in rows.values():
        assert r["requests"] == res2["requests"] > 0
        assert r["cpu_s"] > 0 and r["requests_per_cpu_s"] == r["requests"] / r["cpu_s"]
        assert r["setup_cpu_s"] >= 0
    assert res2["requests_per_cpu_s"] > 0
