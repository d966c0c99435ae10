"""Static estimates for models that share GPUs, used to turn a baseline's placement into the
simulator's always-on instances (:class:`warmserve.sim.core.StaticInstance`).

The simulator times an instance with its model's own :class:`~warmserve.sim.perf.EngineModel`
times a constant ``slowdown``.  For a model that shares GPUs we estimate that constant as

    slowdown = (service time on its shared configuration, alone) / (service time on its own engine)
               x (1 + sum of the busy fractions of the other models on its GPUs)

The first factor carries configuration differences (MuxServe runs a model with TP = mesh size
and an SM share); the second is processor sharing: while a co-located model is busy, the two
interleave kernels on the same SMs and HBM, so each runs at about half speed (Prism time-shares
GPUs; MuxServe's decode jobs have separate SM partitions but share HBM, and decode is
bandwidth-bound).  Busy fractions come from Little's law at the model's average rate
(:func:`busy_fraction`).  That static, average-load value is kept as
:attr:`StaticInstance.slowdown` for reporting; the simulator applies the *dynamic* form
(:func:`dynamic_slowdown`): the configuration factor times one plus the number of neighbours
that are busy (a prefill running or a non-empty decode batch) at the moment a prefill or a decode
step is timed, so the slowdown follows bursts (docs/simulator.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from warmserve.sim.perf import EngineModel


@dataclass(frozen=True, slots=True)
class Load:
    """A model's average load: requests/s and mean prompt/output tokens."""

    rate: float
    prompt_tokens: float
    output_tokens: float


def operating_batch(engine: EngineModel, load: Load, max_batch: int) -> int:
    """Concurrent requests at the average rate (Little's law, fixed point, capped)."""
    if load.rate <= 0:
        return 1
    prompt = max(1, round(load.prompt_tokens))
    ctx = load.prompt_tokens + load.output_tokens / 2
    b = 1
    for _ in range(30):
        latency = engine.prefill_s(prompt) + load.output_tokens * engine.decode_step_s(
            b, round(b * ctx)
        )
        nb = max(1, min(max_batch, round(load.rate * latency)))
        if nb == b:
            break
        b = nb
    return b


def service_time_s(engine: EngineModel, load: Load, batch: int) -> float:
    """GPU time one request costs at ``batch``: its prefill plus its share of decode steps."""
    prompt = max(1, round(load.prompt_tokens))
    ctx = round(batch * (load.prompt_tokens + load.output_tokens / 2))
    return engine.prefill_s(prompt) + load.output_tokens * engine.decode_step_s(batch, ctx) / batch


def busy_fraction(engine: EngineModel, load: Load, max_batch: int) -> float:
    """Fraction of time the model's engine is busy at its average rate, in [0, 1]."""
    if load.rate <= 0:
        return 0.0
    b = operating_batch(engine, load, max_batch)
    return min(1.0, load.rate * service_time_s(engine, load, b))


def config_factor(own: EngineModel, shared: EngineModel, load: Load, max_batch: int) -> float:
    """First factor of the module formula: the shared configuration's service time over the
    model's own, at its operating batch (1 for an identical configuration)."""
    b = operating_batch(own, load, max_batch)
    return service_time_s(shared, load, b) / service_time_s(own, load, b)


def phase_factors(
    own: EngineModel,
    prefill: EngineModel,
    decode: EngineModel,
    load: Load,
    max_batch: int,
) -> tuple[float, float]:
    """(prefill, decode) configuration factors: the shared configuration's prefill of an
    average prompt and decode step at the operating batch, over the model's own engine's.
    Used when the configuration runs the two phases differently (MuxServe's prefill and decode
    jobs have different SM shares)."""
    b = operating_batch(own, load, max_batch)
    prompt = max(1, round(load.prompt_tokens))
    ctx = round(b * (load.prompt_tokens + load.output_tokens / 2))
    return (
        prefill.prefill_s(prompt) / own.prefill_s(prompt),
        decode.decode_step_s(b, ctx) / own.decode_step_s(b, ctx),
    )


def sharing_slowdown(
    own: EngineModel,
    shared: EngineModel,
    load: Load,
    max_batch: int,
    others_busy: Sequence[float],
) -> float:
    """The module-level formula; never below 1 for an identical configuration."""
    config = config_factor(own, shared, load, max_batch)
    return config * (1.0 + sum(max(0.0, min(1.0, u)) for u in others_busy))


def dynamic_slowdown(config: float, busy_neighbours: int) -> float:
    """The same formula with each neighbour's busy fraction replaced by whether it is busy *now*
    (1 or 0): what the simulator applies at every prefill and decode-step timing of a shared
    instance, so the slowdown follows bursts instead of the period average."""
    if busy_neighbours < 0:
        raise ValueError(f"busy_neighbours must be >= 0, got {busy_neighbours}")
    return config * (1.0 + busy_neighbours)
