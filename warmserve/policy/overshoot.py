"""Spare replicas after a peak-forecast miss: a learned, per-model deviation from Eq. 6
(docs/policy.md, "Overshoot spares").

Eq. 6 (WarmServe §5.2) prewarms burst replicas up to ``ceil(L_P / B)`` instances and nothing
beyond, so once a model's demand passes its forecast peak ``L_P`` every further start is a cold
start however good the forecast is on average.  The peak forecast is a calibrated upper quantile
(:mod:`warmserve.policy.peak_forecast`, 92 % of windows at or below it), so such windows are
expected about one in twelve, and a forecast whose peak sits just under a batch boundary (25-31
requests in flight with ``B`` = 32) leaves no burst replica for the 33rd request.

The rule (*overshoot spares*), two triggers, each giving the model ``overshoot`` extra burst
replicas (:func:`warmserve.policy.scoring.model_replicas`' ``spare``: score 0, below every
replica Eq. 5-6 ask for, of any model):

* **missed forecast**: the current window's demand so far (the load tracker's peak) is above
  that window's forecast peak ``L_P``; the flag holds for the rest of the window and the next
  ``hold_windows``.  The control loop re-plans when it sets the flag and after every start that
  uses a replica of a model with a spare, so a spare is loaded behind each start while the load
  climbs past the forecast.
* **batch boundary** (:func:`near_batch_boundary`): the ``ceil(L_P / B)`` instances Eq. 6 sizes
  for leave less than ``headroom * B`` requests of room (default a quarter batch).  Placed at the
  window's plan, before the burst: the missed-forecast trigger comes too late for a peak two
  requests under a boundary.

Deviation from the paper (Eq. 6), and why: measured on the paper testbed at RPS 25, seeds 0-2
(``bench/policy_breakdown.py``), 25 of 33 misses at alpha 2 and 29 of 52 at alpha 0.5 had no
replica left; 50 of those 54 were starts past the forecast peak (by construction: beyond
``ceil(L_P / B)`` instances), 26 of them with a forecast peak less than a quarter batch under a
boundary (e.g. 25.2-30.8 for B = 32: the 33rd request started cold), where the missed-forecast
trigger alone fires too late, hence the boundary trigger. Against one spare for every model
(``spare_replicas``), the models whose forecast holds keep exactly Eq. 5-6's replicas. Effect
(docs/policy.md "Overshoot spares", 18 runs: seeds 0-2 x two polls): hit ratio up at RPS 25
(alpha 2: 87-93 % -> 93-100 %), the tail unchanged at alpha 2 and leaning worse at the
capacity-bound alpha 0.5 points without leaving the run-to-run noise.

Everything here is pure; the controller (:mod:`warmserve.control.spares`) keeps, per model,
the last window in which its forecast was exceeded.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from warmserve.policy.cluster import LoadForecast, PolicyInputError
from warmserve.policy.scoring import instances_for

DEFAULT_HOLD_WINDOWS = 1  # the flag outlives its window by one window
DEFAULT_OVERSHOOT_SPARES = 1  # ControlConfig.overshoot_spares (docs/policy.md)
DEFAULT_OVERSHOOT_HEADROOM = 0.25  # ControlConfig.overshoot_headroom: a quarter of a batch


def peak_exceeded(peak_so_far: float, forecast: LoadForecast | None) -> bool:
    """Whether the window's demand so far has passed its forecast peak (no forecast: never)."""
    return forecast is not None and peak_so_far > forecast.peak


def near_batch_boundary(forecast: LoadForecast | None, max_batch: int, headroom: float) -> bool:
    """Whether the forecast peak leaves less than ``headroom`` batches (a fraction of ``B``) of
    room in the ``ceil(L_P / B)`` instances Eq. 6 sizes for: a peak of 30 with ``B`` = 32 and
    ``headroom`` 0.25 is (2 < 8 requests of room); 0 headroom or no peak: never."""
    if headroom < 0 or max_batch < 1:
        raise PolicyInputError(
            f"need headroom >= 0 and max_batch >= 1, got {headroom}, {max_batch}"
        )
    if forecast is None or forecast.peak <= 0 or headroom == 0:
        return False
    room = instances_for(forecast.peak, max_batch) * max_batch - forecast.peak
    return room < headroom * max_batch


def spares_for(
    models: Mapping[str, int | None],
    window_index: int,
    *,
    base: int = 0,
    overshoot: int = 1,
    hold_windows: int = DEFAULT_HOLD_WINDOWS,
    near: Collection[str] = (),
) -> dict[str, int]:
    """Extra burst replicas per model: ``base`` for every model, plus ``overshoot`` for a model
    whose forecast peak was last exceeded in window ``w`` with
    ``window_index - hold_windows <= w <= window_index`` (``models`` maps each model to its
    last such window, ``None`` when never) or that is in ``near`` (its forecast peak is near a
    batch boundary: :func:`near_batch_boundary`)."""
    if min(base, overshoot, hold_windows) < 0:
        raise PolicyInputError(
            f"spares and hold windows must be >= 0, got base={base} overshoot={overshoot} "
            f"hold_windows={hold_windows}"
        )
    out = {}
    for model, last in models.items():
        hot = model in near or (
            last is not None and window_index - hold_windows <= last <= window_index
        )
        out[model] = base + (overshoot if hot else 0)
    return out
