"""GPU hardware profiles for the simulator: load, validate, list.

One YAML file per GPU type lives in ``warmserve/sim/profiles/`` (``h800`` is the WarmServe
paper's testbed, §7.1).  A profile holds the physical rates the engine model needs (HBM size and
bandwidth, dense BF16 tensor throughput, host->GPU and GPU<->GPU bandwidth), two efficiency
factors, and the software start-up stage costs of a vLLM instance.

Why YAML with a mandatory ``sources`` block: every constant must say where it comes from (a
datasheet, a public measurement, or an explicit assumption), so that nobody tunes the simulator
to reproduce the paper's end results.  The loader refuses a profile with an uncited constant,
an unknown key (typos would otherwise be silently ignored) or an out-of-range value, and names
the offending field in the error.

Rates in a profile are *effective* rates (what a real transfer or kernel achieves); nominal
vendor figures are kept under ``nominal`` for reference only and are never used in physics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from warmserve.policy.cluster import PolicyInputError

DEFAULT_PROFILE = "h800"
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class ProfileError(PolicyInputError):
    """A GPU profile that is missing, malformed or out of range; the message names the field.

    Subclasses :class:`PolicyInputError` (a ``ValueError``) so the CLI reports it as a one-line
    user error with exit status 2.
    """


@dataclass(frozen=True, slots=True)
class StartupStages:
    """Seconds each instance start-up stage costs when it is *not* prewarmed.

    The stages follow the paper's Figure 8 breakdown (§7.2): a worker process must exist
    (``process_start_s``) and have imported the serving stack (``import_s``), hold a CUDA context
    (``device_init_s``), an engine must be initialised (``engine_init_s``: memory profiling, KV
    cache allocation, CUDA-graph capture), a TP>1 instance needs its NCCL communicator
    (``comm_group_s``), and finally the engine is bound to resident weights and starts serving
    (``activation_s``, paid on every start).  Weight loading is not a fixed stage: it is
    bandwidth-bound and computed by :meth:`warmserve.sim.perf.EngineModel.load_s`.
    """

    process_start_s: float
    import_s: float
    device_init_s: float
    engine_init_s: float
    comm_group_s: float
    activation_s: float = 0.0


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """Physical description of one GPU type (all rates effective, SI units: bytes, s, FLOP).

    ``gpu_to_gpu_bw`` is the per-direction NCCL bus bandwidth inside a node;
    ``host_to_gpu_bw`` the pinned host->GPU copy rate of *one* GPU's link (GPUs of a TP group
    load in parallel over their own links).  ``step_overhead_s`` is the fixed cost of one
    forward pass (kernel launches, scheduling, sampling) and ``allreduce_latency_s`` the fixed
    cost of one TP all-reduce; both matter for small batches and high TP.
    ``prefill_efficiency`` scales the tensor peak for GEMM-bound work, ``decode_efficiency`` the
    HBM peak for bandwidth-bound work.
    """

    name: str
    hbm_bytes: int
    hbm_bw: float
    bf16_flops: float
    host_to_gpu_bw: float
    gpu_to_gpu_bw: float
    prefill_efficiency: float
    decode_efficiency: float
    startup: StartupStages
    allreduce_latency_s: float = 1.0e-5
    step_overhead_s: float = 0.0
    gpu_memory_utilization: float = 0.9
    runtime_reserve_bytes: int = 0
    gpus_per_node: int = 8
    description: str = ""
    nominal: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> int:
        """Bytes one engine may use: HBM x utilization - CUDA context/graphs (vLLM's budget)."""
        return int(self.hbm_bytes * self.gpu_memory_utilization) - self.runtime_reserve_bytes


_FLOAT_FIELDS = (
    "hbm_bw",
    "bf16_flops",
    "host_to_gpu_bw",
    "gpu_to_gpu_bw",
    "prefill_efficiency",
    "decode_efficiency",
    "allreduce_latency_s",
    "gpu_memory_utilization",
)
_INT_FIELDS = ("hbm_bytes", "runtime_reserve_bytes", "gpus_per_node")
_NON_NEGATIVE_FIELDS = ("step_overhead_s",)
_FRACTIONS = ("prefill_efficiency", "decode_efficiency", "gpu_memory_utilization")
_STAGE_FIELDS = tuple(f.name for f in fields(StartupStages))
_REQUIRED = (
    "name",
    "hbm_bytes",
    "hbm_bw",
    "bf16_flops",
    "host_to_gpu_bw",
    "gpu_to_gpu_bw",
    "prefill_efficiency",
    "decode_efficiency",
    "startup",
    "sources",
)
_KNOWN = (
    set(_REQUIRED)
    | set(_FLOAT_FIELDS)
    | set(_INT_FIELDS)
    | set(_NON_NEGATIVE_FIELDS)
    | {"description", "nominal"}
)


def _number(where: str, value: Any) -> float:
    """Parse a YAML scalar as a finite float (PyYAML reads ``3.35e12`` as a string)."""
    if isinstance(value, bool):
        raise ProfileError(f"{where}: expected a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: expected a number, got {value!r}") from None
    if not math.isfinite(out):
        raise ProfileError(f"{where}: must be finite, got {value!r}")
    return out


def _positive(where: str, value: Any) -> float:
    out = _number(where, value)
    if out <= 0:
        raise ProfileError(f"{where}: must be > 0, got {value!r}")
    return out


def _non_negative(where: str, value: Any) -> float:
    out = _number(where, value)
    if out < 0:
        raise ProfileError(f"{where}: must be >= 0, got {value!r}")
    return out


def _parse_startup(origin: str, raw: Any) -> StartupStages:
    if not isinstance(raw, dict):
        raise ProfileError(f"{origin}: startup: expected a mapping of stage -> seconds")
    unknown = sorted(set(raw) - set(_STAGE_FIELDS))
    if unknown:
        raise ProfileError(f"{origin}: startup: unknown stage(s) {unknown}; known {_STAGE_FIELDS}")
    missing = [s for s in _STAGE_FIELDS if s not in raw and s != "activation_s"]
    if missing:
        raise ProfileError(f"{origin}: startup: missing stage(s) {missing}")
    values = {k: _non_negative(f"{origin}: startup.{k}", v) for k, v in raw.items()}
    return StartupStages(**values)


def _check_sources(origin: str, data: dict[str, Any]) -> dict[str, str]:
    """Every numeric constant must be cited: ``sources[key]`` (``startup.x``/``nominal.x``)."""
    sources = data["sources"]
    if not isinstance(sources, dict):
        raise ProfileError(f"{origin}: sources: expected a mapping of field -> citation")
    numeric = set(_FLOAT_FIELDS) | set(_INT_FIELDS) | set(_NON_NEGATIVE_FIELDS)
    needed = [k for k in data if k in numeric]
    needed += [f"startup.{k}" for k in data["startup"]]
    needed += [f"nominal.{k}" for k in (data.get("nominal") or {})]
    uncited = [k for k in needed if not str(sources.get(k, "")).strip()]
    if uncited:
        raise ProfileError(f"{origin}: sources: no citation for {uncited}")
    return {str(k): str(v) for k, v in sources.items()}


def parse_profile(data: Any, origin: str = "<profile>") -> GpuProfile:
    """Validate a decoded YAML mapping and build a :class:`GpuProfile`.

    ``origin`` (a file name) prefixes every error so the user knows which file to fix.
    """
    if not isinstance(data, dict):
        raise ProfileError(f"{origin}: expected a YAML mapping at the top level")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ProfileError(f"{origin}: missing field(s) {missing}")
    unknown = sorted(set(data) - _KNOWN)
    if unknown:
        raise ProfileError(f"{origin}: unknown field(s) {unknown}")
    startup = _parse_startup(origin, data["startup"])
    sources = _check_sources(origin, data)
    values: dict[str, Any] = {}
    for key in _FLOAT_FIELDS:
        if key in data:
            values[key] = _positive(f"{origin}: {key}", data[key])
    for key in _NON_NEGATIVE_FIELDS:
        if key in data:
            values[key] = _non_negative(f"{origin}: {key}", data[key])
    for key in _INT_FIELDS:
        if key in data:
            num = _non_negative(f"{origin}: {key}", data[key])
            if num != int(num):
                raise ProfileError(f"{origin}: {key}: must be a whole number, got {data[key]!r}")
            values[key] = int(num)
    for key in _FRACTIONS:
        if key in values and not 0 < values[key] <= 1:
            raise ProfileError(f"{origin}: {key}: must be in (0, 1], got {data[key]!r}")
    if values["hbm_bytes"] <= 0:
        raise ProfileError(f"{origin}: hbm_bytes: must be > 0")
    if values.get("gpus_per_node", 8) < 1:
        raise ProfileError(f"{origin}: gpus_per_node: must be >= 1")
    nominal_raw = data.get("nominal") or {}
    if not isinstance(nominal_raw, dict):
        raise ProfileError(f"{origin}: nominal: expected a mapping")
    nominal = {str(k): _number(f"{origin}: nominal.{k}", v) for k, v in nominal_raw.items()}
    name = str(data["name"]).strip()
    if not name:
        raise ProfileError(f"{origin}: name: must not be empty")
    profile = GpuProfile(
        name=name,
        startup=startup,
        description=str(data.get("description", "")),
        nominal=nominal,
        sources=sources,
        **values,
    )
    if profile.usable_bytes <= 0:
        budget = int(profile.hbm_bytes * profile.gpu_memory_utilization)
        raise ProfileError(
            f"{origin}: runtime_reserve_bytes leaves no usable memory "
            f"(hbm_bytes x gpu_memory_utilization = {budget})"
        )
    return profile


def list_profiles() -> list[str]:
    """Names of the bundled profiles (file stems), sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def _read_text(name: str) -> tuple[str, str]:
    """Return (origin, text) for a bundled profile name or a path to a YAML file."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ProfileError(f"GPU profile file {name!r} does not exist")
        return str(path), path.read_text(encoding="utf-8")
    known = list_profiles()
    name = name.lower()
    if name not in known:
        raise ProfileError(f"unknown GPU profile {name!r}; known profiles: {', '.join(known)}")
    return f"{name}.yaml", (PROFILE_DIR / f"{name}.yaml").read_text(encoding="utf-8")


def load_profile(name: str = DEFAULT_PROFILE) -> GpuProfile:
    """Load and validate a GPU profile by bundled name (``list_profiles()``) or YAML file path.

    Raises :class:`ProfileError` naming the file and field on any problem.
    """
    if not isinstance(name, str) or not name.strip():
        raise ProfileError("GPU profile name must be a non-empty string")
    origin, text = _read_text(name.strip())
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{origin}: not valid YAML: {exc}") from None
    return parse_profile(data, origin)
