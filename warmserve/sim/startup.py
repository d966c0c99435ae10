"""Start-up profiles: what starting an instance and loading weights cost (issue 12 §1).

A GPU profile (:mod:`warmserve.sim.hardware`) says what the hardware does; a *start-up profile*
says what the serving software costs on it: the Figure 8 stages (process, imports, CUDA
context, engine initialisation, NCCL group, activation) and the weight path (bytes per second
per GPU, a fixed set-up per load from scratch, and how much slower stock vLLM's own loader is).
The simulator's outcome hinges on these numbers, so they are data, each constant cited, and
these exist:

* ``paper`` (``startup_profiles/paper.yaml``): calibrated to WarmServe's Figure 8 stage ratios
  and its 665 ms prewarmed 70B (how the constants were solved for: the file's header).
* ``fast-path`` (``startup_profiles/fast-path.yaml``): the GPU profile's cited vLLM stages and
  its pinned host->GPU link rate (52 GB/s on h800) with no load set-up: the reading before
  issue 12.
* ``free-starts`` (``startup_profiles/free-starts.yaml``): a reference, not a system: every
  start is free, so what remains of a tail is queueing (``bench/paper_eval.py``'s reference).
* ``measured-<gpu>``: built from ``bench/results/gpu-<gpu>.json`` when the GPU benchmark
  (``bench/gpu_bench.py``, ``hack/gpu-check.sh``) has run on real hardware and written one
  (dry runs are refused).  What it measured replaces the ``fast-path`` value, and the source
  of every constant says which: the worker path's load rate, the pooled process's prewarm-hit
  activation (first token included), and the fresh process's imports.  Engine initialisation
  is not measured by that benchmark (it runs transformers, not vLLM) and stays ``fast-path``'s.

:func:`load_startup` reads one (a name, or a path to a YAML file of the same shape);
:func:`list_startup_profiles` lists what exists, ``measured-*`` included.  Bad files fail with
:class:`~warmserve.sim.hardware.ProfileError` naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from warmserve.sim.hardware import GpuProfile, ProfileError, StartupStages, _number

STARTUP_DIR = Path(__file__).resolve().parent / "startup_profiles"
RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"
DEFAULT_STARTUP = "paper"
_STAGES = ("process_start_s", "import_s", "device_init_s", "engine_init_s", "comm_group_s",
           "activation_s")


@dataclass(frozen=True)
class StartupProfile:
    """Software start-up costs; ``stages`` ``None`` and ``load_bw`` ``None`` mean "the GPU
    profile's own" (its ``startup`` block, its ``host_to_gpu_bw``)."""

    name: str
    stages: StartupStages | None
    load_bw: float | None
    load_setup_s: float
    stock_slowdown: float
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    # per GPU, what a prewarm replica's prepared engine occupies beside the weights (optional
    # `prepared_engine.overhead_bytes`; ModelSpec.engine_overhead_bytes, docs/policy.md)
    engine_overhead_bytes: int = 0

    def apply(self, gpu: GpuProfile) -> GpuProfile:
        """The GPU profile with this profile's stages and weight-path rate."""
        return replace(
            gpu,
            startup=self.stages or gpu.startup,
            host_to_gpu_bw=self.load_bw or gpu.host_to_gpu_bw,
        )

    def describe(self, gpu: GpuProfile) -> dict[str, Any]:
        g = self.apply(gpu)
        return {
            "name": self.name,
            "stages": {k: getattr(g.startup, k) for k in _STAGES},
            "load_bw": g.host_to_gpu_bw,
            "load_setup_s": self.load_setup_s,
            "stock_slowdown": self.stock_slowdown,
            "engine_overhead_bytes": self.engine_overhead_bytes,
        }


def _num(origin: str, key: str, v: Any, minimum: float = 0.0, strict: bool = False) -> float:
    x = _number(f"{origin}: {key}", v)  # a finite number, as the GPU profiles parse them
    if x < minimum or (strict and x <= minimum):
        op = ">" if strict else ">="
        raise ProfileError(f"{origin}: {key}: must be finite and {op} {minimum:g}, got {v!r}")
    return x


def parse_startup(data: Any, origin: str = "<startup profile>") -> StartupProfile:
    """Validate a decoded YAML mapping; every constant must be cited in ``sources``."""
    if not isinstance(data, dict):
        raise ProfileError(f"{origin}: expected a YAML mapping at the top level")
    unknown = sorted(
        set(data) - {"name", "description", "stages", "load", "sources", "prepared_engine"}
    )
    if unknown:
        raise ProfileError(f"{origin}: unknown field(s) {unknown}")
    for key in ("name", "stages", "load", "sources"):
        if key not in data:
            raise ProfileError(f"{origin}: missing field {key!r}")
    sources = data["sources"]
    if not isinstance(sources, dict):
        raise ProfileError(f"{origin}: sources: expected a mapping of field -> citation")
    needed: list[str] = []
    raw_st = data["stages"]
    stages: StartupStages | None
    if raw_st == "gpu":
        stages = None
        needed.append("stages")
    elif isinstance(raw_st, dict):
        bad = sorted(set(raw_st) - set(_STAGES))
        if bad:
            raise ProfileError(f"{origin}: stages: unknown stage(s) {bad}; known {list(_STAGES)}")
        missing = [k for k in _STAGES if k not in raw_st]
        if missing:
            raise ProfileError(f"{origin}: stages: missing stage(s) {missing}")
        stages = StartupStages(**{k: _num(origin, f"stages.{k}", raw_st[k]) for k in _STAGES})
        needed += [f"stages.{k}" for k in _STAGES]
    else:
        raise ProfileError(f"{origin}: stages: expected a mapping of stage -> seconds or 'gpu'")
    load = data["load"]
    if not isinstance(load, dict):
        raise ProfileError(f"{origin}: load: expected a mapping (bw, setup_s, stock_slowdown)")
    bad = sorted(set(load) - {"bw", "setup_s", "stock_slowdown"})
    if bad:
        raise ProfileError(f"{origin}: load: unknown field(s) {bad}")
    for k in ("bw", "setup_s", "stock_slowdown"):
        if k not in load:
            raise ProfileError(f"{origin}: load: missing field {k!r}")
    bw = None if load["bw"] == "link" else _num(origin, "load.bw", load["bw"], strict=True)
    setup = _num(origin, "load.setup_s", load["setup_s"])
    slow = _num(origin, "load.stock_slowdown", load["stock_slowdown"], 1.0)
    needed += ["load.bw", "load.setup_s", "load.stock_slowdown"]
    overhead = 0
    if "prepared_engine" in data:
        eng = data["prepared_engine"]
        if not isinstance(eng, dict) or set(eng) != {"overhead_bytes"}:
            raise ProfileError(
                f"{origin}: prepared_engine: expected a mapping with overhead_bytes only"
            )
        v = eng["overhead_bytes"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ProfileError(
                f"{origin}: prepared_engine.overhead_bytes: must be an integer >= 0, got {v!r}"
            )
        overhead = v
        needed.append("prepared_engine.overhead_bytes")
    uncited = [k for k in needed if not str(sources.get(k, "")).strip()]
    if uncited:
        raise ProfileError(f"{origin}: sources: no citation for {uncited}")
    name = str(data["name"]).strip()
    if not name:
        raise ProfileError(f"{origin}: name: must not be empty")
    return StartupProfile(
        name, stages, bw, setup, slow, str(data.get("description", "")),
        {str(k): str(v) for k, v in sources.items()}, overhead,
    )


def measured_results(results_dir: Path = RESULTS_DIR) -> dict[str, Path]:
    """``measured-<gpu>`` names of the real GPU benchmark results present (dry runs skipped)."""
    out: dict[str, Path] = {}
    for p in sorted(results_dir.glob("gpu-*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and not data.get("dry_run", True):
            out[f"measured-{p.stem.removeprefix('gpu-')}"] = p
    return out


def measured_profile(path: Path, base: StartupProfile, gpu: GpuProfile) -> StartupProfile:
    """A ``measured-<gpu>`` profile: ``base`` (``fast-path``) with what ``path`` measured."""
    origin = str(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{origin}: not a readable JSON result: {exc}") from None
    if not isinstance(data, dict) or data.get("dry_run", True):
        raise ProfileError(f"{origin}: a dry run (or not a gpu_bench result): no GPU figure in it")
    stages = base.stages or gpu.startup
    sources = {f"stages.{k}": f"{base.name}: {base.sources.get('stages', '')}" for k in _STAGES}
    sources.update({k: f"{base.name}: {v}" for k, v in base.sources.items()})
    bw = base.load_bw
    gpu_name = (data.get("gpu") or {}).get("name", "?")
    load = data.get("load") or {}
    worker = (load.get("worker") or {}).get("bytes_per_s")
    if worker:
        bw = _num(origin, "load.worker.bytes_per_s", worker, strict=True)
        sources["load.bw"] = f"{origin}: load.worker.bytes_per_s (GPU {gpu_name}, worker path)"
        plain = (load.get("plain") or {}).get("bytes_per_s")
        if plain:
            sources["load.bw"] += f"; plain pinned copy {float(plain) / 1e9:.1f} GB/s"
    llama = data.get("llama") or {}
    hit = llama.get("hit_first_token_s")
    if hit:
        stages = replace(stages, activation_s=_num(origin, "llama.hit_first_token_s", hit))
        sources["stages.activation_s"] = (
            f"{origin}: llama.hit_first_token_s (Llama {llama.get('size', '?')}, prewarm hit to "
            "first token, forward included)"
        )
    fresh = llama.get("fresh") or {}
    if fresh.get("import_s"):
        stages = replace(stages, import_s=_num(origin, "llama.fresh.import_s", fresh["import_s"]))
        sources["stages.import_s"] = f"{origin}: llama.fresh.import_s (torch + transformers)"
    return StartupProfile(
        path.stem.replace("gpu-", "measured-", 1), stages, bw, base.load_setup_s,
        base.stock_slowdown,
        f"fast-path with the values measured on {gpu_name} ({path.name})", sources,
        base.engine_overhead_bytes,
    )


def list_startup_profiles(results_dir: Path = RESULTS_DIR) -> list[str]:
    """Bundled start-up profiles plus a ``measured-<gpu>`` per real GPU result present."""
    bundled = [p.stem for p in STARTUP_DIR.glob("*.yaml")]
    return sorted(bundled + list(measured_results(results_dir)))


def load_startup(
    name: str = DEFAULT_STARTUP, gpu: GpuProfile | None = None, results_dir: Path = RESULTS_DIR
) -> StartupProfile:
    """A start-up profile by name (``paper``, ``fast-path``, ``measured-<gpu>``) or YAML path."""
    if not isinstance(name, str) or not name.strip():
        raise ProfileError("start-up profile name must be a non-empty string")
    name = name.strip()
    if name.startswith("measured-"):
        found = measured_results(results_dir)
        if name not in found:
            have = ", ".join(found) or "none: no real bench/results/gpu-*.json yet"
            raise ProfileError(f"unknown start-up profile {name!r}; measured profiles: {have}")
        if gpu is None:
            from warmserve.sim.hardware import load_profile

            gpu = load_profile()
        return measured_profile(found[name], load_startup("fast-path"), gpu)
    if name.endswith((".yaml", ".yml")) or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ProfileError(f"start-up profile file {name!r} does not exist")
        origin = str(path)
    else:
        path = STARTUP_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ProfileError(
                f"unknown start-up profile {name!r}; known: "
                f"{', '.join(list_startup_profiles(results_dir))}"
            )
        origin = path.name
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ProfileError(f"{origin}: not valid YAML: {exc}") from None
    return parse_startup(data, origin)
