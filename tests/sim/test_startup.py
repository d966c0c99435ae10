"""Start-up profiles: data, cited, `paper` calibrated to Figure 8, a measured
profile built only from a real GPU benchmark result."""

from __future__ import annotations

import json

import pytest

from warmserve.sim.hardware import ProfileError, load_profile
from warmserve.sim.physics_table import physics_table
from warmserve.sim.startup import (
    list_startup_profiles,
    load_startup,
    measured_results,
    parse_startup,
)

H800 = load_profile("h800")


def _table(name: str) -> list[dict]:
    sp = load_startup(name, H800)
    return physics_table(sp.apply(H800), load_setup_s=sp.load_setup_s)


def test_paper_profile_reproduces_figure_8_for_every_model():
    rows = _table("paper")
    assert [r["model"] for r in rows] == ["llama2-7b (TP1)", "llama2-13b (TP2)",
                                          "llama2-70b (TP4)"]
    for r in rows:
        assert 1.6 <= r["device_x"] <= 1.7, r
        assert 2.3 <= r["engine_x"] <= 4.7, r
        assert 7.0 <= r["weights_comm_x"] <= 7.8, r
        assert 29.8 <= r["total_reduction"] <= 54.8, r
    assert rows[2]["ttft_commgroup_s"] == pytest.approx(0.665, abs=0.005)  # §7.2: ~665 ms


def test_fast_path_is_the_gpu_profiles_own_reading():
    sp = load_startup("fast-path", H800)
    g = sp.apply(H800)
    assert g.startup == H800.startup and g.host_to_gpu_bw == H800.host_to_gpu_bw == 52e9
    assert sp.load_setup_s == 0.0 and sp.stock_slowdown == pytest.approx(9.976)
    # the audit's finding, kept visible: a TP-1 miss costs what a hit costs on this reading
    r = _table("fast-path")[0]
    assert r["weights_comm_x"] < 1.5


def test_every_bundled_profile_cites_every_constant():
    for name in ("paper", "fast-path"):
        sp = load_startup(name, H800)
        assert sp.sources and all(v.strip() for v in sp.sources.values())
    assert {"paper", "fast-path"} <= set(list_startup_profiles())


def test_bad_profiles_fail_naming_the_field(tmp_path):
    good = {"name": "x", "stages": "gpu",
            "load": {"bw": "link", "setup_s": 0, "stock_slowdown": 1},
            "sources": {"stages": "a", "load.bw": "b", "load.setup_s": "c",
                        "load.stock_slowdown": "d"}}
    assert parse_startup(good).name == "x"
    with pytest.raises(ProfileError, match="no citation"):
        parse_startup({**good, "sources": {"stages": "a"}})
    with pytest.raises(ProfileError, match=r"load\.setup_s"):
        parse_startup({**good, "load": {**good["load"], "setup_s": -1}})
    with pytest.raises(ProfileError, match="stock_slowdown"):
        parse_startup({**good, "load": {**good["load"], "stock_slowdown": 0.5}})
    with pytest.raises(ProfileError, match="unknown field"):
        parse_startup({**good, "typo": 1})
    with pytest.raises(ProfileError, match="missing stage"):
        parse_startup({**good, "stages": {"import_s": 1}})
    with pytest.raises(ProfileError, match="unknown start-up profile"):
        load_startup("nope")
    with pytest.raises(ProfileError, match="measured profiles: none"):
        load_startup("measured-h100", results_dir=tmp_path)


def test_measured_profile_only_from_a_real_gpu_result(tmp_path):
    # A dry run is never a measurement.
    (tmp_path / "gpu-fake.json").write_text(json.dumps({"dry_run": True}))
    assert measured_results(tmp_path) == {}
    # A (synthetic, test-only) real-looking result becomes measured-<name>: what it measured
    # replaces fast-path's value and says where it came from; the rest stays fast-path's.
    result = {
        "dry_run": False, "gpu": {"name": "Test GPU"},
        "load": {"plain": {"bytes_per_s": 50e9}, "worker": {"bytes_per_s": 45e9}},
        "llama": {"size": "8b", "hit_first_token_s": 0.31, "fresh": {"import_s": 4.2}},
    }
    (tmp_path / "gpu-testgpu.json").write_text(json.dumps(result))
    assert list(measured_results(tmp_path)) == ["measured-testgpu"]
    assert "measured-testgpu" in list_startup_profiles(tmp_path)
    sp = load_startup("measured-testgpu", H800, results_dir=tmp_path)
    g = sp.apply(H800)
    assert g.host_to_gpu_bw == 45e9 and g.startup.activation_s == 0.31
    assert g.startup.import_s == 4.2
    assert g.startup.engine_init_s == H800.startup.engine_init_s  # not measured: fast-path's
    assert "gpu-testgpu.json" in sp.sources["load.bw"]
    assert "gpu-testgpu.json" in sp.sources["stages.activation_s"]
    assert "fast-path" in sp.sources["stages.engine_init_s"]
