"""Scenario files for ``warmserve simulate``: YAML loading and validation.

A scenario names the cluster (nodes × GPUs and a hardware profile), the models (architecture,
tensor parallelism, max batch, which trace day drives each), the workload (arrival-shape and
length traces, total requests/s, power-law exponent α, the simulated period) and the policy
knobs (window, predictor, grace period, queue timeout).  ``grid`` lists values the evaluation
script sweeps (``bench/paper_eval.py``); ``warmserve simulate`` runs the scalar values.

Every problem raises :class:`ScenarioError` (a :class:`PolicyInputError`), whose one-line message
names the field; the CLI turns it into exit status 2.
Example: ``bench/scenarios/paper-testbed.yaml``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from warmserve.policy.cluster import PolicyInputError
from warmserve.policy.overshoot import DEFAULT_OVERSHOOT_HEADROOM, DEFAULT_OVERSHOOT_SPARES


class ScenarioError(PolicyInputError):
    """A scenario that cannot be simulated; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """One served model.  ``arch`` names an architecture the engine model knows (H3b's
    ``engine.ModelArch``); ``weight_gib`` overrides its checkpoint size in GiB (the paper's
    Table 1 "GB" are GiB: Llama2-7B's 6.74e9 FP16 parameters are 13.48e9 bytes = 12.55 GiB)."""

    name: str
    arch: str
    tp: int = 1
    max_batch: int = 32
    trace_day: int = 0
    weight_gib: float | None = None
    prewarm_layers: int | None = None  # None: profiled from the engine model (§4)


@dataclass(frozen=True)
class Scenario:
    name: str
    nodes: int
    gpus_per_node: int
    profile: str
    models: tuple[ModelConfig, ...]
    arrivals: str
    lengths: str
    total_rps: float
    alpha: float
    duration_s: float
    start: str | int = "busiest"  # minute of day, "HH:MM", or "busiest"
    history_days: int = 3
    window_s: float = 300.0
    predictor: str | None = None
    startup: str = "paper"  # start-up profile (warmserve.sim.startup)
    fine_arrivals: str | None = None  # arrival template trace, "poisson"; None: the lengths trace
    prewarm_depth: str = "budget"  # "budget" or "profiled" (models[].prewarm_layers overrides)
    spare_replicas: int = 0  # ControlConfig.spare_replicas (docs/policy.md "Spare replicas")
    overshoot_spares: int = DEFAULT_OVERSHOOT_SPARES  # ControlConfig.overshoot_spares
    overshoot_headroom: float = DEFAULT_OVERSHOOT_HEADROOM  # ControlConfig.overshoot_headroom
    grace_s: float = 300.0
    scale_down_delay_s: float = 60.0
    scale_up_utilization: float = 1.0
    scale_down_utilization: float = 0.5
    scale_interval_s: float = 1.0
    queue_timeout_s: float = 3600.0
    drain_s: float = 1800.0
    seed: int = 0
    systems: tuple[str, ...] = ()
    grid: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def with_overrides(self, **kw: Any) -> Scenario:
        out = replace(self, **kw)
        validate(out)
        return out


_TOP_KEYS = {
    "name", "cluster", "models", "workload", "policy", "seed", "systems", "grid",
}
_GRID_KEYS = {"total_rps", "alpha", "lengths", "window_s", "startup"}
PREWARM_DEPTHS = ("budget", "profiled")


def _get(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any):
    if key not in d:
        if default is _REQUIRED:
            raise ScenarioError(f"{where}.{key} is required")
        return default
    val = d[key]
    if kind is float and isinstance(val, int) and not isinstance(val, bool):
        val = float(val)
    if not isinstance(val, kind) or (isinstance(val, bool) and kind is not bool):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ScenarioError(f"{where}.{key} must be a {name}, got {val!r}")
    return val


_REQUIRED = object()


def _unknown(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise ScenarioError(f"{where}: unknown field(s) {', '.join(extra)}")


def parse(doc: Any, source: str = "scenario") -> Scenario:
    """Build a :class:`Scenario` from a parsed YAML document."""
    if not isinstance(doc, Mapping):
        raise ScenarioError(f"{source}: top level must be a mapping")
    _unknown(doc, _TOP_KEYS, source)
    cluster = _get(doc, "cluster", Mapping, source, _REQUIRED)
    _unknown(cluster, {"nodes", "gpus_per_node", "profile", "startup"}, "cluster")
    wl = _get(doc, "workload", Mapping, source, _REQUIRED)
    _unknown(
        wl,
        {"arrivals", "lengths", "total_rps", "alpha", "duration_s", "start", "history_days",
         "fine_arrivals"},
        "workload",
    )
    pol = _get(doc, "policy", Mapping, source, {})
    _unknown(
        pol,
        {
            "window_s", "predictor", "grace_s", "scale_interval_s", "queue_timeout_s", "drain_s",
            "scale_down_delay_s", "scale_up_utilization", "scale_down_utilization",
            "prewarm_depth", "spare_replicas", "overshoot_spares", "overshoot_headroom",
        },
        "policy",
    )
    raw_models = _get(doc, "models", list, source, _REQUIRED)
    models = []
    for k, m in enumerate(raw_models):
        where = f"models[{k}]"
        if not isinstance(m, Mapping):
            raise ScenarioError(f"{where} must be a mapping")
        _unknown(
            m, {"name", "arch", "tp", "max_batch", "trace_day", "weight_gib", "prewarm_layers"},
            where,
        )
        models.append(
            ModelConfig(
                name=_get(m, "name", str, where, _REQUIRED),
                arch=_get(m, "arch", str, where, _REQUIRED),
                tp=_get(m, "tp", int, where, 1),
                max_batch=_get(m, "max_batch", int, where, 32),
                trace_day=_get(m, "trace_day", int, where, k),
                weight_gib=_get(m, "weight_gib", float, where, None),
                prewarm_layers=_get(m, "prewarm_layers", int, where, None),
            )
        )
    grid_raw = _get(doc, "grid", Mapping, source, {})
    _unknown(grid_raw, _GRID_KEYS, "grid")
    grid = {}
    for key, vals in grid_raw.items():
        if not isinstance(vals, list) or not vals:
            raise ScenarioError(f"grid.{key} must be a non-empty list")
        grid[key] = tuple(vals)
    systems = _get(doc, "systems", list, source, [])
    sc = Scenario(
        name=_get(doc, "name", str, source, Path(source).stem),
        nodes=_get(cluster, "nodes", int, "cluster", _REQUIRED),
        gpus_per_node=_get(cluster, "gpus_per_node", int, "cluster", _REQUIRED),
        profile=_get(cluster, "profile", str, "cluster", "h800"),
        startup=_get(cluster, "startup", str, "cluster", "paper"),
        fine_arrivals=_get(wl, "fine_arrivals", str, "workload", None),
        prewarm_depth=_get(pol, "prewarm_depth", str, "policy", "budget"),
        models=tuple(models),
        arrivals=_get(wl, "arrivals", str, "workload", _REQUIRED),
        lengths=_get(wl, "lengths", str, "workload", _REQUIRED),
        total_rps=_get(wl, "total_rps", float, "workload", _REQUIRED),
        alpha=_get(wl, "alpha", float, "workload", 1.0),
        duration_s=_get(wl, "duration_s", float, "workload", 7200.0),
        start=_get(wl, "start", (str, int), "workload", "busiest"),
        history_days=_get(wl, "history_days", int, "workload", 3),
        window_s=_get(pol, "window_s", float, "policy", 300.0),
        predictor=_get(pol, "predictor", str, "policy", None),
        grace_s=_get(pol, "grace_s", float, "policy", 300.0),
        scale_down_delay_s=_get(pol, "scale_down_delay_s", float, "policy", 60.0),
        scale_up_utilization=_get(pol, "scale_up_utilization", float, "policy", 1.0),
        scale_down_utilization=_get(pol, "scale_down_utilization", float, "policy", 0.5),
        scale_interval_s=_get(pol, "scale_interval_s", float, "policy", 1.0),
        queue_timeout_s=_get(pol, "queue_timeout_s", float, "policy", 3600.0),
        drain_s=_get(pol, "drain_s", float, "policy", 1800.0),
        spare_replicas=_get(pol, "spare_replicas", int, "policy", 0),
        overshoot_spares=_get(
            pol, "overshoot_spares", int, "policy", DEFAULT_OVERSHOOT_SPARES
        ),
        overshoot_headroom=_get(
            pol, "overshoot_headroom", float, "policy", DEFAULT_OVERSHOOT_HEADROOM
        ),
        seed=_get(doc, "seed", int, source, 0),
        systems=tuple(str(s) for s in systems),
        grid=grid,
    )
    validate(sc)
    return sc


def start_minute_of(start: str | int) -> int | None:
    """Minute of day for ``start`` (``None`` for ``"busiest"``)."""
    if isinstance(start, int):
        minute = start
    elif start == "busiest":
        return None
    else:
        try:
            hh, mm = start.split(":")
            minute = int(hh) * 60 + int(mm)
        except ValueError:
            raise ScenarioError(
                f"workload.start must be 'busiest', 'HH:MM' or a minute of day, got {start!r}"
            ) from None
    if not 0 <= minute < 1440:
        raise ScenarioError(f"workload.start must be within one day, got {start!r}")
    return minute


def _positive(value: float, name: str, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ScenarioError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, "
                            f"got {value}")


def validate(sc: Scenario) -> None:
    """Static checks that need no trace or engine (those are checked when the run is built)."""
    if sc.nodes < 1 or sc.gpus_per_node < 1:
        raise ScenarioError("cluster.nodes and cluster.gpus_per_node must be >= 1")
    if not sc.models:
        raise ScenarioError("models must list at least one model")
    names = [m.name for m in sc.models]
    if len(set(names)) != len(names):
        raise ScenarioError("models: duplicate model name")
    for m in sc.models:
        if m.tp < 1:
            raise ScenarioError(f"model {m.name}: tp must be >= 1, got {m.tp}")
        if m.tp > sc.gpus_per_node:
            raise ScenarioError(
                f"model {m.name}: tp {m.tp} is larger than a node ({sc.gpus_per_node} GPUs)"
            )
        if m.max_batch < 1:
            raise ScenarioError(f"model {m.name}: max_batch must be >= 1")
        if m.trace_day < 0:
            raise ScenarioError(f"model {m.name}: trace_day must be >= 0")
        if m.weight_gib is not None:
            _positive(m.weight_gib, f"model {m.name}: weight_gib")
    _positive(sc.total_rps, "workload.total_rps", allow_zero=True)
    _positive(sc.alpha, "workload.alpha", allow_zero=True)
    _positive(sc.duration_s, "workload.duration_s")
    if sc.duration_s % 60:
        raise ScenarioError("workload.duration_s must be whole minutes")
    if sc.history_days < 0:
        raise ScenarioError("workload.history_days must be >= 0")
    start_minute_of(sc.start)
    _positive(sc.window_s, "policy.window_s")
    if sc.window_s % 60:
        raise ScenarioError(
            "policy.window_s must be whole minutes (the arrival trace is per minute)"
        )
    _positive(sc.grace_s, "policy.grace_s", allow_zero=True)
    _positive(sc.scale_interval_s, "policy.scale_interval_s")
    _positive(sc.queue_timeout_s, "policy.queue_timeout_s")
    _positive(sc.drain_s, "policy.drain_s", allow_zero=True)
    if sc.spare_replicas < 0:
        raise ScenarioError(f"policy.spare_replicas must be >= 0, got {sc.spare_replicas}")
    if not (math.isfinite(sc.overshoot_headroom) and 0 <= sc.overshoot_headroom <= 1):
        raise ScenarioError(
            f"policy.overshoot_headroom must be in [0, 1] (a share of a batch), got "
            f"{sc.overshoot_headroom}"
        )
    if sc.overshoot_spares < 0:
        raise ScenarioError(
            f"policy.overshoot_spares must be >= 0, got {sc.overshoot_spares}"
        )
    if sc.prewarm_depth not in PREWARM_DEPTHS:
        raise ScenarioError(
            f"policy.prewarm_depth must be one of {', '.join(PREWARM_DEPTHS)}, "
            f"got {sc.prewarm_depth!r}"
        )
    for key, vals in sc.grid.items():
        for v in vals:
            if key == "startup" and not isinstance(v, str):
                raise ScenarioError(f"grid.startup values must be profile names, got {v!r}")
            if key in ("total_rps", "alpha", "window_s"):
                if not isinstance(v, int | float) or isinstance(v, bool):
                    raise ScenarioError(f"grid.{key} values must be numbers, got {v!r}")
                _positive(float(v), f"grid.{key}", allow_zero=key != "window_s")


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"scenario file not found: {p}")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ScenarioError(f"{p}: not valid YAML{where}") from None
    return parse(doc, str(p))
