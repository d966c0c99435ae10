"""GPU-sharing baselines the simulator compares WarmServe with.

* :mod:`warmserve.sim.baselines.muxserve` -- MuxServe (ICML'24): static colocation computed once
  from average rates (Algorithms 1-2, Eq. 3), instances created in advance, colocated models
  sharing SMs and a unified KV pool.
* :mod:`warmserve.sim.baselines.prism` -- Prism: KV-pressure-ratio placement, idle-model
  eviction and fast activation from a pre-initialised engine pool.

Both are pure, deterministic functions of their inputs; the simulator (``warmserve.sim.systems``)
calls them and applies the timing helpers to its own event loop.  Each module's docstring says
what its paper specifies, what we assumed where the paper is silent, and why.
"""

from warmserve.sim.baselines.muxserve import decode_engine, power_law_rates, prefill_engine
from warmserve.sim.baselines.muxserve_estimator import MuxMember, MuxModel, MuxServeError
from warmserve.sim.baselines.muxserve_placement import MuxPlacement, MuxUnit, plan_muxserve
from warmserve.sim.baselines.prism import (
    ResidentModel,
    activation_s,
    idle_evictions,
    idle_threshold_s,
    plan_activation,
)
from warmserve.sim.baselines.prism_placement import (
    PrismError,
    PrismGpu,
    PrismModel,
    PrismPlacement,
    choose_activation_gpus,
    kvpr_placement,
)

__all__ = [
    "MuxMember",
    "MuxModel",
    "MuxPlacement",
    "MuxServeError",
    "MuxUnit",
    "PrismError",
    "PrismGpu",
    "PrismModel",
    "PrismPlacement",
    "ResidentModel",
    "activation_s",
    "choose_activation_gpus",
    "decode_engine",
    "idle_evictions",
    "idle_threshold_s",
    "kvpr_placement",
    "plan_activation",
    "plan_muxserve",
    "power_law_rates",
    "prefill_engine",
]
