"""Scenario validation and the ``warmserve simulate`` command: table, JSON, plot, bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.sim.conftest import make_doc
from warmserve.cli import main
from warmserve.sim import runner
from warmserve.sim.scenario import ScenarioError, parse
from warmserve.sim.systems import parse_systems
from warmserve.sim.workload import power_law_shares


def _write(tmp_path, doc, name="s.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def _err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"models": [{"name": "x", "arch": "gpt-9", "tp": 1}]}, "unknown model architecture"),
        ({"models": [{"name": "x", "arch": "llama2-70b", "tp": 16}]}, "larger than a node"),
        ({"workload.arrivals": "nope.csv.gz"}, "nope.csv.gz"),
        ({"workload.lengths": "missing-lengths.csv"}, "missing-lengths.csv"),
        ({"workload.total_rps": -3}, "total_rps"),
        ({"workload.alpha": -1}, "alpha"),
        ({"policy.window_s": 0}, "window_s"),
        ({"policy.bogus": 1}, "unknown field"),
        ({"models": [{"name": "x", "arch": "llama2-7b", "trace_day": 9}]}, "trace_day"),
        ({"workload.start": "25:00"}, "workload.start"),
    ],
)
def test_bad_scenarios_fail_with_one_line_and_status_2(tmp_path, capsys, changes, needle):
    path = _write(tmp_path, make_doc(**changes))
    rc, err = _err(capsys, ["simulate", path, "--systems", "reactive"])
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert needle in err
    assert "Traceback" not in err


def test_missing_scenario_file_and_bad_yaml(tmp_path, capsys):
    rc, err = _err(capsys, ["simulate", str(tmp_path / "none.yaml")])
    assert rc == 2 and "not found" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [unclosed\n")
    rc, err = _err(capsys, ["simulate", str(bad)])
    assert rc == 2 and "not valid YAML" in err


def test_unknown_system_is_a_usage_error(tmp_path, capsys):
    rc, err = _err(capsys, ["simulate", _write(tmp_path, make_doc()), "--systems", "magic"])
    assert rc == 2 and "unknown system 'magic'" in err


def test_simulate_prints_table_and_writes_json_and_plot(tmp_path, capsys):
    path = _write(tmp_path, make_doc())
    out_json = tmp_path / "r.json"
    out_png = tmp_path / "r.png"
    rc = main(["simulate", path, "--systems", "warmserve,reactive", "--json", str(out_json),
               "--plot", str(out_png), "--seed", "3"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT p99" in text and "warmserve" in text and "reactive" in text
    assert "requests per wall second" in text
    data = json.loads(out_json.read_text())
    assert [r["system"] for r in data["rows"]] == ["warmserve", "reactive"]
    assert set(data["rows"][0]["per_model"]) == {"a", "b"}
    assert data["facts"]["seed"] == 3
    assert out_png.stat().st_size > 1000


def test_power_law_shares_match_the_paper():
    # §7.3: with alpha = 2.0 the most popular of four models gets 70.2 % of the requests.
    s = power_law_shares(4, 2.0)
    assert s[0] == pytest.approx(0.702, abs=5e-4)
    assert s.sum() == pytest.approx(1.0)
    assert list(power_law_shares(3, 0.0)) == pytest.approx([1 / 3] * 3)


def test_workload_hits_target_rate_and_shares():
    doc = make_doc(**{"workload.total_rps": 10, "workload.duration_s": 1800, "workload.alpha": 2})
    prep = runner.prepare(parse(doc))
    n = len(prep.requests)
    # the trace's own minute-scale bursts (the arrival template) move a half hour's count by a
    # few percent; the expected count is exact (test_workload.py)
    assert n / 1800 == pytest.approx(10, rel=0.1)
    first = (prep.requests.model == 0).mean()
    assert first == pytest.approx(0.8, abs=0.03)  # 1 / (1 + 1/4)
    assert (prep.requests.arrival >= 0).all() and (prep.requests.arrival < 1800).all()
    assert (prep.requests.input_tokens > 0).all()
    # the predictor has history from before the period
    assert all(len(m.avg_history) == 288 for m in prep.models)


def test_parse_systems_and_scenario_errors():
    assert parse_systems("warmserve, reactive") == ["warmserve", "reactive"]
    with pytest.raises(ScenarioError, match="cluster"):
        parse({"models": []})
    with pytest.raises(ValueError, match="twice"):
        parse_systems("reactive,reactive")


def test_paper_testbed_scenario_is_valid():
    from warmserve.sim.scenario import load_scenario

    sc = load_scenario("bench/scenarios/paper-testbed.yaml")
    assert (sc.nodes, sc.gpus_per_node) == (2, 8)
    assert [m.tp for m in sc.models] == [1, 1, 2, 4]
    assert sc.grid["total_rps"] == (10, 15, 20, 25)
    assert sc.window_s == 300 and sc.duration_s == 7200


def test_spare_replicas_reach_the_controller():
    """``policy.spare_replicas`` is ControlConfig.spare_replicas in the simulator (the operator's
    ``--spare-replicas``; docs/policy.md "Spare replicas"); negative is an error."""
    from warmserve.sim.core import Simulation

    doc = make_doc(**{"policy.spare_replicas": 1, "workload.duration_s": 300})
    sc = parse(doc)
    assert sc.spare_replicas == 1 and parse(make_doc()).spare_replicas == 0
    seen = []
    orig = Simulation.__init__

    def spy(self, *a, **kw):
        orig(self, *a, **kw)
        seen.append(self.controller.cfg.spare_replicas)

    Simulation.__init__ = spy
    try:
        runner.run_system(runner.prepare(sc), "warmserve")
    finally:
        Simulation.__init__ = orig
    assert seen == [1]
    with pytest.raises(ScenarioError, match="spare_replicas"):
        parse(make_doc(**{"policy.spare_replicas": -1}))


def test_startup_override_by_name_or_path_and_unknown_profile(tmp_path, capsys):
    path = _write(tmp_path, make_doc(**{"workload.total_rps": 12}))  # reactive starts instances
    instant = tmp_path / "instant.yaml"
    stages = {k: 0.0 for k in ("process_start_s", "import_s", "device_init_s", "engine_init_s",
                                "comm_group_s", "activation_s")}
    load = {"bw": 1.0e15, "setup_s": 0.0, "stock_slowdown": 1.0}
    sources = {f"{part}.{k}": "a bound, not a system" for part, d in
               (("stages", stages), ("load", load)) for k in d}
    instant.write_text(yaml.safe_dump({"name": "instant", "description": "every start free",
                                       "stages": stages, "load": load, "sources": sources}))
    results = {}
    for profile in ("fast-path", str(instant)):
        out_json = tmp_path / f"{len(results)}.json"
        rc = main(["simulate", path, "--systems", "reactive", "--startup", profile,
                   "--json", str(out_json)])
        assert rc == 0
        capsys.readouterr()
        data = json.loads(out_json.read_text())
        results[data["facts"]["startup"]] = data["rows"][0]
    assert set(results) == {"fast-path", "instant"}
    # free starts: a request behind one of reactive's cold starts no longer waits seconds
    assert results["fast-path"]["cold_starts"] > 0
    assert results["instant"]["ttft_p99_s"] < results["fast-path"]["ttft_p99_s"] / 5
    rc, err = _err(capsys, ["simulate", path, "--startup", "nope"])
    assert rc == 2 and "unknown start-up profile 'nope'" in err


def test_overshoot_spares_reach_the_controller():
    """``policy.overshoot_spares`` / ``policy.overshoot_headroom`` are ControlConfig's in the
    simulator (the operator's ``--overshoot-spares``; docs/policy.md "Overshoot spares");
    negative is an error."""
    from warmserve.sim.core import Simulation

    doc = make_doc(**{"policy.overshoot_spares": 1, "policy.overshoot_headroom": 0.25,
                      "workload.duration_s": 300})
    sc = parse(doc)
    assert (sc.overshoot_spares, sc.overshoot_headroom) == (1, 0.25)
    seen = []
    orig = Simulation.__init__

    def spy(self, *a, **kw):
        orig(self, *a, **kw)
        seen.append((self.controller.cfg.overshoot_spares, self.controller.cfg.overshoot_headroom))

    Simulation.__init__ = spy
    try:
        runner.run_system(runner.prepare(sc), "warmserve")
    finally:
        Simulation.__init__ = orig
    assert seen == [(1, 0.25)]
    with pytest.raises(ScenarioError, match="overshoot_spares"):
        parse(make_doc(**{"policy.overshoot_spares": -1}))
    with pytest.raises(ScenarioError, match="overshoot_headroom"):
        parse(make_doc(**{"policy.overshoot_headroom": -0.5}))
