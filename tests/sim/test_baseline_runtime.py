"""The baselines inside the event loop: MuxServe's own batch cap, the dynamic sharing slowdown,
Prism's activation on idle GPUs (warmserve.sim.core with warmserve.sim.baselines)."""

from __future__ import annotations

import numpy as np
import pytest

from warmserve.policy.autoscaler import AutoscalerConfig
from warmserve.policy.cluster import ModelSpec
from warmserve.sim.baselines import muxserve, power_law_rates, prism
from warmserve.sim.baselines.prism_runtime import PrismHooks
from warmserve.sim.cluster import SimCluster
from warmserve.sim.core import Simulation
from warmserve.sim.hardware import load_profile
from warmserve.sim.hooks import StaticLayout
from warmserve.sim.model import SimModel, StaticInstance
from warmserve.sim.model_arch import ModelArch
from warmserve.sim.perf import EngineModel
from warmserve.sim.sharing import Load, dynamic_slowdown
from warmserve.sim.systems import get_system

H800 = load_profile("h800")


def _runtime(idx: int, name: str, max_batch: int = 32) -> SimModel:
    arch = ModelArch.llama2("7b")
    eng = EngineModel(H800, arch, 1)
    spec = ModelSpec(name, arch.weight_bytes, 1, max_batch, eng.load_s(), arch.num_layers)
    return SimModel(
        idx,
        spec,
        eng,
        eng.kv_bytes_per_token_per_gpu,
        eng.kv_capacity_tokens(),
        eng.layer_load_s,
        [],
        [],
    )


def _sim(system: str, static, arrivals, models_of, n_in=500, n_out=50, gpus=1, models=None):
    models = models or [_runtime(0, "a"), _runtime(1, "b")]
    n = len(arrivals)
    return Simulation(
        system=get_system(system),
        models=models,
        cluster=SimCluster(1, gpus, H800.hbm_bytes),
        arrival=np.array(arrivals, dtype=float),
        model_of=np.array(models_of),
        input_tokens=np.full(n, n_in),
        output_tokens=np.full(n, n_out),
        duration_s=1000.0,
        window_s=300.0,
        autoscaler=AutoscalerConfig(),
        scale_interval_s=1.0,
        queue_timeout_s=3600.0,
        drain_s=600.0,
        hooks=StaticLayout(static),
        record=True,
    )


# ----------------------------------------------------------------------------- MuxServe batch


def test_adbs_batch_is_kv_quota_over_average_request_capped_at_256():
    load = Load(1.0, 1155.0, 211.0)
    assert muxserve.adbs_max_num_seqs(1366 * 40 + 5, load) == 40  # 1366 tokens per request
    assert muxserve.adbs_max_num_seqs(10**9, load) == muxserve.MAX_NUM_SEQS == 256
    assert muxserve.adbs_max_num_seqs(100, load) == 1  # never 0: one request can always run
    with pytest.raises(muxserve.MuxServeError, match="kv_tokens"):
        muxserve.adbs_max_num_seqs(0, load)


def test_muxserve_instances_cap_at_the_scenarios_batch_and_adbs_keeps_its_own():
    from tests.sim.test_baselines import TPS, _fake_prep

    rates = dict(zip(TPS, power_law_rates(25, 0.5, 4), strict=True))
    prep = _fake_prep(rates, TPS)
    loads = muxserve.average_loads(prep)
    spec_batch = {m.spec.name: m.spec.max_batch for m in prep.models}
    # default (a fair comparison): MuxServe's quota capped at the scenario's batch
    for inst in muxserve.static_instances(prep):
        own = muxserve.adbs_max_num_seqs(inst.kv_cap_tokens, loads[inst.model])
        assert inst.max_batch == min(own, spec_batch[inst.model])
        assert inst.config_slowdown is not None and inst.config_slowdown > 0
        assert inst.prefill_config_slowdown is not None and inst.prefill_config_slowdown > 0
    # the `muxserve-adbs` variant keeps its own batch: far more than the scenario's 32
    insts = muxserve.static_instances(prep, own_batch=True)
    for inst in insts:
        assert inst.max_batch == muxserve.adbs_max_num_seqs(inst.kv_cap_tokens, loads[inst.model])
    assert min(i.max_batch for i in insts) > 32


def test_prism_instances_default_to_the_scenarios_batch_prism256_to_vllms():
    from tests.sim.test_baselines import TPS, _fake_prep

    rates = dict(zip(TPS, power_law_rates(25, 0.5, 4), strict=True))
    prep = _fake_prep(rates, TPS)
    spec_batch = {m.spec.name: m.spec.max_batch for m in prep.models}
    for inst in prism.static_instances(prep):
        assert inst.max_batch == spec_batch[inst.model]
    for inst in prism.static_instances(prep, max_batch=prism.MAX_NUM_SEQS):
        assert inst.max_batch == prism.MAX_NUM_SEQS == 256


def test_static_max_batch_caps_admission():
    # 5 simultaneous requests, batch cap 2: two are admitted at once, the rest wait.
    static = [StaticInstance("a", "node-0", (0,), max_batch=2)]
    sim = _sim("dedicated", static, [0.0] * 5, [0] * 5)
    out = sim.run()
    assert int((out.assigned == 0.0).sum()) == 2
    assert not np.isnan(out.finish).any()


# ----------------------------------------------------------------------------- dynamic slowdown


def test_dynamic_slowdown_formula():
    assert dynamic_slowdown(1.2, 0) == pytest.approx(1.2)
    assert dynamic_slowdown(1.2, 2) == pytest.approx(3.6)
    with pytest.raises(ValueError, match="busy_neighbours"):
        dynamic_slowdown(1.0, -1)


def test_sharing_slowdown_follows_the_neighbours_current_load():
    # a and b share GPU 0 (configuration factors 1.2 for prefills, 1.5 for decode steps).
    # Request 0 (a) runs alone; requests 1 (a) and 2 (b) arrive together much later, so b's
    # prefill starts while a is busy.
    static = [
        StaticInstance(
            "a", "node-0", (0,), slowdown=9.0, config_slowdown=1.5, prefill_config_slowdown=1.2
        ),
        StaticInstance(
            "b", "node-0", (0,), slowdown=9.0, config_slowdown=1.5, prefill_config_slowdown=1.2
        ),
    ]
    sim = _sim("muxserve", static, [0.0, 100.0, 100.0], [0, 0, 1])
    out = sim.run()
    eng = sim.models[0].engine
    prefill = eng.prefill_s([500])
    step = eng.decode_step_s(1, 500)
    # alone: the configuration factor only, not the static average (9.0)
    assert out.first_token[0] == pytest.approx(prefill * 1.2, rel=1e-9)
    assert out.finish[0] - out.first_token[0] == pytest.approx(49 * step * 1.5, rel=1e-6)
    # together: a's prefill was timed with b idle, b's with a busy (twice as slow)
    assert out.first_token[1] - 100.0 == pytest.approx(prefill * 1.2, rel=1e-9)
    assert out.first_token[2] - 100.0 == pytest.approx(prefill * 2.4, rel=1e-9)
    # both decode with a busy neighbour for a while: slower than alone
    assert out.finish[1] - out.first_token[1] > 49 * step * 1.5 * 1.2


# ----------------------------------------------------------------------------- Prism activation


def _big_runtime(idx: int, name: str, gib: float) -> SimModel:
    arch = ModelArch.llama2("7b").with_weight_bytes(int(gib * 2**30))
    eng = EngineModel(H800, arch, 1)
    spec = ModelSpec(name, arch.weight_bytes, 1, 32, eng.load_s(), arch.num_layers)
    return SimModel(
        idx,
        spec,
        eng,
        eng.kv_bytes_per_token_per_gpu,
        eng.kv_capacity_tokens(),
        eng.layer_load_s,
        [],
        [],
    )


def _facts(models, rates, idle_s=10.0):
    return prism.PrismFacts(
        rates=rates,
        idle_timeout_s={m.spec.name: idle_s for m in models},
        activation_s={m.spec.name: prism.activation_s(m.engine) for m in models},
        min_kv_bytes=1e9,
        usable_bytes=float(H800.usable_bytes),
    )


def _prism_sim(models, static, arrivals, models_of, gpus, facts, n_in=500, n_out=50):
    sim = _sim("prism", static, arrivals, models_of, n_in, n_out, gpus=gpus, models=models)
    sim.hooks = PrismHooks(facts, static)
    return sim


def test_plan_activation_prefers_empty_gpus_then_evicts_idle_models():
    part = 40 * 2**30
    full = prism.PrismGpu(0, 0, ("x",), 5.0, H800.usable_bytes - part)
    empty = prism.PrismGpu(1, 0, (), 0.0, H800.usable_bytes)
    model = prism.PrismModel("y", part, 1.0, 1.0)
    assert prism.plan_activation([full, empty], [], model, 0.0, 10.0) == ((1,), [])
    # the empty GPU is excluded (it holds y already): nothing fits without an eviction ...
    assert prism.plan_activation([full, empty], [], model, 0.0, 10.0, exclude=[1]) is None
    # ... and x, idle for 50 s > 10 s, is evicted to make room
    x = prism.ResidentModel("x", (0,), part, 1.0, last_request_s=0.0)
    assert prism.plan_activation([full, empty], [x], model, 50.0, 10.0, exclude=[1]) == (
        (0,),
        ["x"],
    )
    # a busy or recently used x is never evicted
    busy = prism.ResidentModel("x", (0,), part, 1.0, last_request_s=0.0, inflight=1)
    assert prism.plan_activation([full, empty], [busy], model, 50.0, 10.0, exclude=[1]) is None
    assert prism.plan_activation([full, empty], [x], model, 5.0, 10.0, exclude=[1]) is None
    with pytest.raises(prism.PrismError, match="global index order"):
        prism.plan_activation([empty, full], [], model, 0.0, 10.0)


def test_prism_activates_on_idle_gpus_under_load():
    # one 7B instance on GPU 0 of 4; a burst it cannot hold (batch cap 4) activates more
    # instances on the empty GPUs, each ready after Prism's activation time.
    models = [_runtime(0, "a"), _runtime(1, "b")]
    static = [StaticInstance("a", "node-0", (0,), max_batch=4, config_slowdown=1.0)]
    facts = _facts(models, {"a": 10.0, "b": 0.0})
    sim = _prism_sim(models, static, [0.0] * 40, [0] * 40, gpus=4, facts=facts)
    out = sim.run()
    assert not np.isnan(out.finish).any()
    assert len(out.starts) >= 1
    act = prism.activation_s(models[0].engine)
    assert all(s.latency_s == pytest.approx(act) and not s.hit for s in out.starts)
    assert all(0.5 < s.latency_s < 0.8 for s in out.starts)  # Prism Fig. 9: ~0.7 s for 7-8B
    # requests ran on the new instances: some were assigned once they were ready, not later
    assert int(np.isclose(out.assigned, act).sum()) >= 1
    # the new instances sit on GPUs that were idle, never beside another instance of a
    gpus = [g for i in sim.instances if i.model == "a" for g in i.gpus]
    assert len(gpus) == len(out.starts) + 1 and len(set(gpus)) == len(gpus)


def test_prism_evicts_an_idle_model_when_memory_is_short():
    # one GPU, two 40 GiB models: only one fits.  b's request evicts a (idle > 10 s), then a's
    # later request evicts b.
    models = [_big_runtime(0, "a", 40), _big_runtime(1, "b", 40)]
    static = [StaticInstance("a", "node-0", (0,), max_batch=256, config_slowdown=1.0)]
    facts = _facts(models, {"a": 1.0, "b": 1.0})
    sim = _prism_sim(models, static, [0.0, 100.0, 200.0], [0, 1, 0], gpus=1, facts=facts)
    out = sim.run()
    assert not np.isnan(out.finish).any()
    assert [s.model for s in out.starts] == ["b", "a"]
    act_b = prism.activation_s(models[1].engine)
    assert out.first_token[1] - 100.0 == pytest.approx(act_b + models[1].engine.prefill_s([500]))
    # a GPU is never double-booked: only one model resident at a time
    assert out.gpu_seconds <= 1000.0 + 1e-6


def test_prism_waits_when_the_resident_model_is_busy():
    # b arrives while a is still decoding: nothing is evicted, b waits for a to finish and go
    # idle past its threshold (the next arrival of b re-tries the activation).
    models = [_big_runtime(0, "a", 40), _big_runtime(1, "b", 40)]
    static = [StaticInstance("a", "node-0", (0,), max_batch=256, config_slowdown=1.0)]
    facts = _facts(models, {"a": 1.0, "b": 1.0})
    sim = _prism_sim(models, static, [0.0, 0.5, 60.0], [0, 1, 1], gpus=1, facts=facts)
    out = sim.run()
    assert out.start_failures >= 1
    assert out.first_token[1] > 60.0  # served only after the retry at t = 60
    assert not np.isnan(out.finish).any()


@pytest.mark.parametrize("system", ["muxserve", "prism"])
def test_baselines_conserve_requests_and_causality(system):
    from tests.sim.conftest import make_doc
    from warmserve.sim import result_rows, runner
    from warmserve.sim.scenario import parse

    prep = runner.prepare(parse(make_doc(**{"workload.total_rps": 12})))
    out, wall = runner.run_system(prep, system, check=True, record=True)
    names = [m.spec.name for m in prep.models]
    row = result_rows.summarize(out, names, wall)
    result_rows.check_conservation(row)
    served = ~np.isnan(out.finish)
    arr = prep.requests.arrival
    assert (out.assigned[served] >= arr[served] - 1e-9).all()
    assert (out.first_token[served] >= out.assigned[served] - 1e-9).all()
    assert (out.finish[served] >= out.first_token[served] - 1e-9).all()
    assert row["gpu_hours"] <= 8 * prep.scenario.duration_s / 3600 + 1e-9


def test_prism_scale_out_never_time_shares_a_busy_gpu():
    # a (cap 2) on GPU 0, b on GPU 1 busy with a long request: a burst of a finds no GPU free
    # of working instances, so no replica is added (one beside b would add no capacity).
    models = [_runtime(0, "a"), _runtime(1, "b")]
    static = [
        StaticInstance("a", "node-0", (0,), max_batch=2, config_slowdown=1.0),
        StaticInstance("b", "node-0", (1,), max_batch=256, config_slowdown=1.0),
    ]
    facts = _facts(models, {"a": 1.0, "b": 1.0})
    arrivals = [0.0] + [0.1] * 6
    sim = _prism_sim(models, static, arrivals, [1] + [0] * 6, gpus=2, facts=facts, n_out=2000)
    out = sim.run()
    assert out.starts == [] and out.start_failures >= 1
    assert not np.isnan(out.finish).any()
