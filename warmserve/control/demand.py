"""The one definition of a model's load (demand), as the predictor learns it and the autoscaler
scales on it.

    demand(model) = requests in flight at its instances (starting, serving and in grace:
                    running + queued there) + requests held for it at gateways

Why each part (one rule for every executor; ``docs/policy.md`` "Load"):

* **Grace instances count.** Their requests are real load the model is serving now; leaving
  them out makes a drain look like a load drop, so the next window's forecast and the
  autoscaler see less than what runs (the simulator did that, the operator did not).  A drain
  is decided with these requests counted, so counting them afterwards never re-triggers a
  scale-up by itself.
* **Held requests count.** A request waiting at a gateway because no instance can take it (none
  runs, or all are full) is demand the paper's load includes (§2.2: requests that arrived and
  are not finished).  It is the only signal a model with no instance has, so a held request is
  what gets a scaled-to-zero model started — by the autoscaler in the controller, never by the
  gateway itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .observation import InstanceObs, Observation


def demand(
    instances: Iterable[InstanceObs], held: Mapping[str, int], models: Iterable[str]
) -> dict[str, float]:
    """``models``' demand from instance facts and gateway-held counts (module docstring)."""
    out = {m: float(max(held.get(m, 0), 0)) for m in models}
    for inst in instances:
        if inst.model in out and not inst.foreign:
            out[inst.model] += max(inst.in_flight, 0)
    return out


def observed_demand(obs: Observation, models: Iterable[str]) -> dict[str, float]:
    return demand(obs.instances, obs.held, models)
