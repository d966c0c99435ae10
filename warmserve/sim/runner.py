"""Build a run from a scenario (physics, workload, history, static layouts) and run systems.

:func:`prepare` does everything that is the same for every system — load the GPU profile, build
each model's engine model and policy :class:`~warmserve.policy.cluster.ModelSpec`, draw the
workload and the predictor's history from the seed — and :func:`run_system` runs one system on
it.  All systems of one scenario therefore see exactly the same requests.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from warmserve.policy.autoscaler import AutoscalerConfig, desired_instances
from warmserve.policy.cluster import (
    GiB,
    ModelSpec,
)
from warmserve.policy.load import inflight_load, request_durations
from warmserve.policy.predictor import DEFAULT_PREDICTOR
from warmserve.policy.prewarm_depth import DepthProfile, choose_depth
from warmserve.sim import workload as wl
from warmserve.sim.cluster import SimCluster
from warmserve.sim.core import Simulation
from warmserve.sim.hardware import GpuProfile, load_profile
from warmserve.sim.hooks import Controlled, StaticLayout, SystemHooks
from warmserve.sim.model import PeriodFacts, Prepared, SimModel, SimOutput
from warmserve.sim.model_arch import ModelArch
from warmserve.sim.perf import EngineModel
from warmserve.sim.scenario import Scenario, ScenarioError, start_minute_of
from warmserve.sim.startup import load_startup
from warmserve.sim.systems import get_system

log = logging.getLogger("warmserve.sim")


def _engine_speeds(engine: EngineModel, spec: ModelSpec, lengths) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s per request) at a typical operating point.

    Used only to turn history arrivals into in-flight load (§2.2: "the running time of a request
    is computed based on its input and output lengths"): the median prompt prefilled alone, and a
    half-full batch decoding median contexts.
    """
    p = max(1, int(np.median(lengths[0])))
    ctx = int(np.median(lengths[0]) + np.median(lengths[1]) / 2)
    b = max(1, spec.max_batch // 2)
    return p / engine.prefill_s(p), 1.0 / engine.decode_step_s(b, b * ctx)


def budget_layers(
    profile: GpuProfile, engine: EngineModel, n_models: int, engine_overhead_bytes: int = 0
) -> int:
    """Prewarm depth from the memory budget (§4, §5): every served model's replica should fit
    on one GPU beside one of each of the others (one-for-many prewarming), so each may take
    ``1 / n_models`` of a GPU's usable memory; within that share, less its prepared engine, a
    replica keeps as many leading layers as fit (all of them when the share holds the whole
    shard)."""
    share = profile.usable_bytes / max(n_models, 1)
    if engine_overhead_bytes:
        share = max(0.0, share - engine_overhead_bytes)
    return int(min(engine.arch.num_layers, share // engine.layer_bytes_per_gpu))


def depth_profile(engine: EngineModel, prompt_tokens: int, head_start_s: float) -> DepthProfile:
    """The policy's depth-rule inputs from the engine model (what the operator gets measured
    from the node agents): per-layer load and compute for ``prompt_tokens``, the LM head, and
    the activation as the streamed layers' head start."""
    load, compute, head = engine.depth_inputs(prompt_tokens)
    return DepthProfile(load, compute, head, head_start_s, prompt_tokens)


def build_models(
    sc: Scenario, profile: GpuProfile, lengths, engine_overhead_bytes: int = 0
) -> list[tuple[ModelSpec, EngineModel, int]]:
    """(spec, engine model, profiled minimum depth) per model, in scenario order.
    ``engine_overhead_bytes``: what each prewarm replica's prepared engine occupies per GPU
    (the start-up profile's ``prepared_engine.overhead_bytes``)."""
    out = []
    median_prompt = max(1, int(np.median(lengths[0])))
    for cfg in sc.models:
        try:
            arch = ModelArch.named(cfg.arch)
        except ValueError as exc:
            raise ScenarioError(f"model {cfg.name}: {exc}") from None
        if cfg.weight_gib is not None:
            arch = arch.with_weight_bytes(int(cfg.weight_gib * GiB))
        if cfg.tp > profile.gpus_per_node:
            raise ScenarioError(
                f"model {cfg.name}: tp {cfg.tp} exceeds the {profile.gpus_per_node} GPUs of a "
                f"{profile.name} node"
            )
        engine = EngineModel(profile, arch, cfg.tp)
        # the paper's offline profiling pass (§4), the policy's depth rule (the operator's
        # `auto`): fewest leading layers that never block the first token when the rest
        # streams in behind the activation
        profiled = choose_depth(
            arch.num_layers, None,
            depth_profile(engine, median_prompt, profile.startup.activation_s),
        ).layers
        layers = cfg.prewarm_layers
        if layers is None:
            layers = profiled
            if sc.prewarm_depth == "budget":
                layers = max(
                    profiled,
                    budget_layers(profile, engine, len(sc.models), engine_overhead_bytes),
                )
        if not 1 <= layers <= arch.num_layers:
            raise ScenarioError(
                f"model {cfg.name}: prewarm_layers must be in [1, {arch.num_layers}]"
            )
        spec = ModelSpec(
            name=cfg.name,
            weight_bytes=arch.weight_bytes,
            tp=cfg.tp,
            max_batch=cfg.max_batch,
            cold_start_s=0.0,  # set by prepare (T_c: the whole weights' load time)
            num_layers=arch.num_layers,
            prewarm_layers=layers,
            engine_overhead_bytes=engine_overhead_bytes,
        )
        out.append((spec, engine, profiled))
    return out


def _template(sc: Scenario) -> wl.ArrivalTemplate | None:
    name = sc.fine_arrivals or sc.lengths
    if name == wl.POISSON:
        return None
    return wl.ArrivalTemplate.from_trace(name)


def prepare(sc: Scenario) -> Prepared:
    """Physics, workload and history for ``sc`` (deterministic for ``sc.seed``)."""
    t0 = time.perf_counter()
    gpu = load_profile(sc.profile)
    startup = load_startup(sc.startup, gpu)
    profile = startup.apply(gpu)
    counts = wl.read_minute_series(sc.arrivals)
    lengths = wl.read_lengths(sc.lengths)
    days = [m.trace_day for m in sc.models]
    n_days = counts.size // wl.MINUTES_PER_DAY
    for m in sc.models:
        if m.trace_day >= n_days:
            raise ScenarioError(
                f"model {m.name}: trace_day {m.trace_day} is beyond the {n_days} days of "
                f"{sc.arrivals}"
            )
    duration_min = int(sc.duration_s // 60)
    start = start_minute_of(sc.start)
    if start is None:
        start = wl.busiest_start_minute(counts, days, duration_min)
    win_min = int(sc.window_s // 60)
    start -= start % win_min  # windows stay aligned with the day (the predictor's seasons)
    shares = wl.power_law_shares(len(sc.models), sc.alpha)
    shapes = wl.model_shapes(
        counts, days, start, duration_min, shares, sc.total_rps, sc.history_days
    )
    stream = wl.RequestStream(sc.seed, shapes, lengths, _template(sc), sc.duration_s)
    built = build_models(sc, profile, lengths, startup.engine_overhead_bytes)
    models: list[SimModel] = []
    facts: list[PeriodFacts] = []
    initial: dict[str, int] = {}
    asc = autoscaler_config(sc)
    for idx, ((spec0, engine, _profiled), shape) in enumerate(zip(built, shapes, strict=True)):
        spec = replace(spec0, cold_start_s=startup.load_setup_s + engine.load_s())
        pre, dec = _engine_speeds(engine, spec, lengths)
        avg_h: list[float] = []
        peak_h: list[float] = []
        hist_len = shape.history_min * wl.MINUTE_S
        if hist_len >= sc.window_s:
            h_t, h_in, h_out = stream.model_requests(idx, -hist_len, 0.0)
            loads = inflight_load(
                h_t, request_durations(h_in, h_out, pre, dec), sc.window_s,
                start_s=-hist_len, end_s=0.0,
            )
            avg_h = [w.avg for w in loads]
            peak_h = [w.peak for w in loads]
        p_t, p_in, p_out = stream.model_requests(idx, 0.0, sc.duration_s)
        period = inflight_load(
            p_t, request_durations(p_in, p_out, pre, dec),
            sc.window_s, start_s=0.0, end_s=sc.duration_s,
        ) if p_t.size else []
        facts.append(
            PeriodFacts(
                int(p_t.size),
                float(p_in.mean()) if p_t.size else 1.0,
                float(p_out.mean()) if p_t.size else 1.0,
                max((w.peak for w in period), default=0.0),
            )
        )
        placeable = engine.free_kv_bytes_per_gpu() > 0
        models.append(
            SimModel(
                idx=idx,
                spec=spec,
                engine=engine,
                kv_bytes_per_token=engine.kv_bytes_per_token_per_gpu * spec.tp,
                kv_cap_tokens=engine.kv_capacity_tokens(),
                per_layer_load_s=engine.layer_load_s,
                avg_history=avg_h,
                peak_history=peak_h,
                placeable=placeable,
                load_setup_s=startup.load_setup_s,
                stock_slowdown=startup.stock_slowdown,
            )
        )
        last = avg_h[-1] if avg_h else 0.0
        initial[spec.name] = desired_instances(last, spec.max_batch, 0, asc) if placeable else 0
    return Prepared(
        sc, profile, models, stream, start, shares, facts, initial, time.perf_counter() - t0,
        startup=startup,
    )


def autoscaler_config(sc: Scenario) -> AutoscalerConfig:
    return AutoscalerConfig(
        scale_up_utilization=sc.scale_up_utilization,
        scale_down_utilization=sc.scale_down_utilization,
        scale_down_delay_s=sc.scale_down_delay_s,
        max_grace_s=sc.grace_s,
    )


def system_hooks(prep: Prepared, system: str) -> SystemHooks:
    """The plug-in that runs ``system`` in the event loop (:mod:`warmserve.sim.hooks`): the
    controller for autoscaling systems, a static layout for dedicated and MuxServe, Prism's
    layout plus its activation for Prism."""
    cfg = get_system(system)
    if cfg.mode == "autoscale":
        return Controlled()
    if cfg.mode == "dedicated":
        from warmserve.sim.baselines import dedicated

        return StaticLayout(*dedicated.static_instances(prep))
    if cfg.mode == "muxserve":
        from warmserve.sim.baselines import muxserve

        return StaticLayout(muxserve.static_instances(prep, own_batch=cfg.own_batch))
    if cfg.mode == "prism":
        from warmserve.sim.baselines import prism
        from warmserve.sim.baselines.prism_runtime import PrismHooks

        batch = prism.MAX_NUM_SEQS if cfg.own_batch else None
        layout = prism.static_instances(prep, max_batch=batch)
        if cfg.activate:
            return PrismHooks(prism.runtime_facts(prep, max_batch=batch), layout)
        return StaticLayout(layout)
    raise ScenarioError(f"no event-loop plug-in for system {system!r}")


# The young generation's threshold while a simulation runs (CPython's default is 700).
GC_GEN0_THRESHOLD = 100_000


@contextmanager
def few_collections() -> Iterator[None]:
    """Run a simulation with the cyclic garbage collector seldom in the way (issue 12 §5).

    A run allocates a few objects per event (requests, heap entries, observations) over a
    large, long-lived state (the prepared workload, the cluster, the controller's memos), and
    CPython's default thresholds start a collection every 700 net allocations, each re-scanning
    what survived: about a fifth of the busy hour's CPU time.  Here whatever exists when the
    run starts is frozen (``gc.freeze``: never scanned again) and the young generation is
    collected every 100,000 allocations instead of 700.  Reference counting still frees
    nearly everything at once; only cycles wait longer (peak memory of the busy hour: equal
    to the default's).  Results do not depend on it (the simulator never reads an object's
    address or the collector).  The previous thresholds are restored, and the frozen objects
    released, afterwards."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def run_system(
    prep: Prepared,
    system: str,
    progress: Callable[[float], None] | None = None,
    check: bool = False,
    record: bool = False,
) -> tuple[SimOutput, float]:
    """Run one system; returns its output and the wall seconds it took (the CPU seconds are in
    ``out.extra["cpu_s"]``).  ``record``: keep per-request outcome arrays (tests)."""
    sc = prep.scenario
    cfg = get_system(system)
    t0 = time.perf_counter()
    c0 = time.process_time()
    profile = prep.profile
    cluster = SimCluster(sc.nodes, sc.gpus_per_node, profile.hbm_bytes)
    # Fresh copies of mutable per-run model state (history lists are extended during a run).
    models = [replace(m, avg_history=list(m.avg_history), peak_history=list(m.peak_history))
              for m in prep.models]
    c_layout = time.process_time()
    hooks = system_hooks(prep, system)
    layout_cpu = time.process_time() - c_layout
    predictor = None
    if sc.predictor:
        from warmserve.policy.predictor import make_predictor

        predictor = make_predictor(sc.predictor)
    if isinstance(hooks, StaticLayout):
        # a fixed layout: a model it leaves out is never served (Prism may activate it)
        have = {s.model for s in hooks.instances}
        for m in models:
            if m.spec.name not in have and not hooks.activates:
                m.placeable = False
    sim = Simulation(
        system=cfg,
        models=models,
        cluster=cluster,
        source=prep.stream.chunks(),
        duration_s=sc.duration_s,
        window_s=sc.window_s,
        autoscaler=autoscaler_config(sc),
        scale_interval_s=sc.scale_interval_s,
        queue_timeout_s=sc.queue_timeout_s,
        drain_s=sc.drain_s,
        predictor=predictor,
        hooks=hooks,
        initial_instances=prep.initial,
        progress=progress,
        check=check,
        record=record,
        spare_replicas=sc.spare_replicas,
        overshoot_spares=sc.overshoot_spares,
        overshoot_headroom=sc.overshoot_headroom,
    )
    with few_collections():
        out = sim.run()
    wall = time.perf_counter() - t0
    out.extra["cpu_s"] = time.process_time() - c0
    if isinstance(hooks, StaticLayout) and hooks.info:
        out.extra["layout"] = hooks.info
    if layout_cpu > 0.5:  # choosing the layout simulated (dedicated): report it apart
        out.extra["layout_cpu_s"] = layout_cpu
    log.info(
        "event=sim_done system=%s requests=%d events=%d wall_s=%.2f",
        system, out.requests, out.events, wall,
    )
    return out, wall


def describe(prep: Prepared) -> dict[str, object]:
    """Facts about the run worth printing above the table."""
    sc = prep.scenario
    return {
        "scenario": sc.name,
        "cluster": f"{sc.nodes}x{sc.gpus_per_node} {prep.profile.name}",
        "requests": prep.n_requests,
        "startup": prep.startup.name if prep.startup else "fast-path",
        "arrivals_within_minute": sc.fine_arrivals or sc.lengths,
        "total_rps": sc.total_rps,
        "alpha": sc.alpha,
        "duration_s": sc.duration_s,
        "start": f"{prep.start_minute // 60:02d}:{prep.start_minute % 60:02d}",
        "shares": {m.spec.name: round(float(s), 4) for m, s in zip(prep.models, prep.shares,
                                                                     strict=True)},
        "prewarm_layers": {m.spec.name: m.spec.prewarm_layers for m in prep.models},
        "cold_start_s": {
            m.spec.name: round(float(m.engine.cold_start_s() + m.load_setup_s), 3)
            for m in prep.models
        },
        "seed": sc.seed,
        "predictor": sc.predictor or DEFAULT_PREDICTOR,
        "window_s": sc.window_s,
        "prep_s": round(prep.prep_s, 3),
        "placeable": {m.spec.name: m.placeable for m in prep.models},
        "peak_inflight": {
            m.spec.name: round(p, 1) for m, p in zip(prep.models, prep.peak_inflight, strict=True)
        },
        "initial_instances": dict(prep.initial),
    }


def run_scenario(
    sc: Scenario,
    systems: list[str],
    progress: Callable[[str, float], None] | None = None,
    keep_raw: bool = False,
) -> dict[str, object]:
    """Run ``systems`` on ``sc``; returns ``{"facts", "rows", "raw"?}`` (rows: metrics.summarize).

    Every row passes the conservation check (served + dropped == requests).
    """
    from warmserve.sim import metrics

    for s in systems:
        get_system(s)
    prep = prepare(sc)
    names = [m.spec.name for m in prep.models]
    rows = []
    raw = []
    for s in systems:
        cb = (lambda t, _s=s: progress(_s, t)) if progress is not None else None
        out, wall = run_system(prep, s, cb)
        row = metrics.summarize(out, names, wall)
        metrics.check_conservation(row)
        rows.append(row)
        if keep_raw:
            total = metrics.ModelStats()
            for st in out.stats:
                total.merge(st)
            raw.append((s, total.ttft.cdf(), out.timeline))
    result: dict[str, object] = {"facts": describe(prep), "rows": rows}
    if keep_raw:
        result["raw"] = raw
    return result
