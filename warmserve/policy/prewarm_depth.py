"""Prewarm depth: how many leading layers a prewarm replica keeps resident (WarmServe §4).

A prewarm replica keeps "the first several layers", a number "profiled offline": when it is
activated the missing layers stream in (layer by layer, in order) while the forward pass already
runs, so the replica needs only as many layers as keep the forward from ever waiting for one.
This module is that rule, shared by the operator (from the node agents' measured profile of a
model) and the simulator (from its engine model), so both choose the same depth from the same
numbers.

The model of a start (one forward of a representative prompt, layers ``0..L-1``):

* ``l``: seconds to load one layer's shard onto a GPU (the node's load bandwidth and the layer's
  bytes, or the loader's measured per-layer time);
* ``c``: seconds of one layer's forward compute for the prompt;
* ``h``: the head start: the missing layers begin streaming ``h`` seconds before the forward
  begins (the activation's own work);
* ``head``: the LM head after the last layer (the same with any depth).

With ``r`` layers resident, layer ``i >= r`` arrives at ``a_i = max(0, (i - r + 1) l - h)`` and
starts computing at ``max(finish_{i-1}, a_i)``.  Unrolling the recurrence, the forward ends at
``max_i (a_i + (L - i) c)``, linear in ``i`` over the streamed range, so at an end:

    T(r) = max(L c,  l - h + (L - r) c,  (L - r) l - h + c)  + head

:func:`min_resident_layers` is the fewest ``r`` with ``T(r)`` within ``(1 + tolerance)`` of the
fully resident ``T(L)``; :func:`choose_depth` wraps it with the fallback (no profile: all
layers) and the reason the operator reports.  Pure and deterministic; property-tested in
``tests/policy/test_prewarm_depth.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from warmserve.policy.cluster import PolicyInputError


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise PolicyInputError(message)


def forward_time_s(
    num_layers: int,
    resident_layers: int,
    layer_load_s: float,
    layer_compute_s: float,
    *,
    head_s: float = 0.0,
    head_start_s: float = 0.0,
    streaming: bool = True,
) -> float:
    """Seconds from the forward's start to its end with ``resident_layers`` on the GPU
    (module docstring).  ``streaming=False``: an engine that waits for every weight first
    (stock vLLM): ``max(0, (L - r) l - h) + L c``."""
    L, r, ell, c, h = num_layers, resident_layers, layer_load_s, layer_compute_s, head_start_s
    missing = L - r
    if missing == 0:
        return L * c + head_s
    if not streaming:
        return max(0.0, missing * ell - h) + L * c + head_s
    forward = max(L * c, ell - h + missing * c, missing * ell - h + c)
    return forward + head_s


def min_resident_layers(
    num_layers: int,
    layer_load_s: float,
    layer_compute_s: float,
    *,
    head_s: float = 0.0,
    head_start_s: float = 0.0,
    tolerance: float = 0.0,
) -> int:
    """Fewest leading layers (0..L) whose forward, with the rest streamed, ends within
    ``(1 + tolerance)`` of a fully resident model's.  ``T(r)`` is non-increasing in ``r``, so
    this is a binary search."""
    _check(
        isinstance(num_layers, int) and num_layers >= 1,
        f"num_layers must be >= 1, got {num_layers!r}",
    )
    for name, v in (
        ("layer_load_s", layer_load_s),
        ("layer_compute_s", layer_compute_s),
        ("head_s", head_s),
        ("head_start_s", head_start_s),
        ("tolerance", tolerance),
    ):
        _check(math.isfinite(v) and v >= 0, f"{name} must be finite and >= 0, got {v!r}")
    full = forward_time_s(num_layers, num_layers, layer_load_s, layer_compute_s, head_s=head_s)
    bound = full * (1.0 + tolerance) + 1e-12
    lo, hi = 0, num_layers
    while lo < hi:
        mid = (lo + hi) // 2
        t = forward_time_s(
            num_layers, mid, layer_load_s, layer_compute_s, head_s=head_s,
            head_start_s=head_start_s,
        )
        if t <= bound:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True, slots=True)
class DepthProfile:
    """What the depth rule needs to know about one model on one GPU group (module docstring):
    per-layer load and compute seconds, the LM head's seconds and the activation's head start,
    and the prompt size the compute was measured for (reported, not used by the rule)."""

    layer_load_s: float
    layer_compute_s: float
    head_s: float = 0.0
    head_start_s: float = 0.0
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("layer_load_s", "layer_compute_s", "head_s", "head_start_s"):
            v = getattr(self, name)
            _check(
                math.isfinite(v) and v >= 0, f"profile {name} must be finite and >= 0, got {v!r}"
            )
        _check(self.prompt_tokens >= 0, "profile prompt_tokens must be >= 0")


class DepthSource(StrEnum):
    """Where a model's prewarm depth came from (the operator reports it in status)."""

    SPEC = "spec"  # spec.prewarm.layers: an integer the tenant set
    PROFILED = "profiled"  # auto, from a measured profile
    FALLBACK = "fallback"  # auto without a usable profile: all layers


@dataclass(frozen=True, slots=True)
class DepthChoice:
    layers: int
    source: DepthSource
    reason: str


def choose_depth(
    num_layers: int,
    requested: int | None,
    profile: DepthProfile | None,
    *,
    tolerance: float = 0.0,
) -> DepthChoice:
    """The prewarm depth of a model with ``num_layers`` layers: ``requested`` when an integer
    was asked for (``None``: auto), else the profiled minimum (at least 1 layer: a replica
    with nothing resident is no replica), else all layers when there is no profile or it
    measured no load time (nothing known to stream against)."""
    _check(num_layers >= 1, f"num_layers must be >= 1, got {num_layers}")
    if requested is not None:
        _check(
            1 <= requested <= num_layers,
            f"prewarm layers must be in [1, {num_layers}], got {requested}",
        )
        return DepthChoice(requested, DepthSource.SPEC, f"spec.prewarm.layers: {requested}")
    if profile is None or profile.layer_load_s <= 0:
        return DepthChoice(
            num_layers, DepthSource.FALLBACK,
            f"auto: no measured profile yet, all {num_layers} layers",
        )
    r = max(
        1,
        min_resident_layers(
            num_layers, profile.layer_load_s, profile.layer_compute_s, head_s=profile.head_s,
            head_start_s=profile.head_start_s, tolerance=tolerance,
        ),
    )
    tokens = f" for {profile.prompt_tokens} prompt tokens" if profile.prompt_tokens else ""
    return DepthChoice(
        r, DepthSource.PROFILED,
        f"auto: {r} of {num_layers} layers keep the forward from waiting (profiled: "
        f"{profile.layer_load_s * 1e3:.3g} ms load and {profile.layer_compute_s * 1e3:.3g} ms "
        f"compute per layer{tokens}, {profile.head_start_s * 1e3:.3g} ms head start)",
    )
