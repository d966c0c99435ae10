"""The systems compared, each a configuration of the one simulator.

Every system runs the same event loop, engine model, workload and metrics; they differ only in
the switches below.  ``docs/simulator.md`` says, per system, what the paper states, what we
assumed where it is silent, and why.

============================  ======================================================================
system                        what it is
============================  ======================================================================
``warmserve``                 prediction every window, basic/burst replicas (Eq. 5-8), evict-aware
                              placement (Alg. 1), prewarm-hit starts, proactive prewarming into lent
                              KV memory (Eq. 1), partially prewarmed starts streaming the rest
``warmserve-no-proactive``    §7.5 ablation: grace instances lend nothing and released GPUs go
                              idle (both halves of §4.1 off, as the paper's ablation)
``warmserve-no-lending``      split ablation: no grace-period lending (Eq. 1); a stopped
                              instance still leaves its weights as a replica
``warmserve-no-keep-weights`` split ablation: grace lending on, but a stopped instance's GPUs
                              go idle (its weights are not kept)
``warmserve-no-evict-aware``  §7.5 ablation: first-fit placement
                              (``plan_prewarm(evict_aware=False)``)
``warmserve-no-reclaim``      no reclaim: a starving model waits for other models to scale down
``warmserve-no-prediction``   split ablation: no forecasts, so no basic/burst replicas
                              (Algorithm 1 never runs); pool, streaming and kept weights stay
``reactive``                  Kubernetes HPA in front of vLLM: same autoscaler, every start cold
                              from host memory (process, import, device, engine, comm group,
                              all weights)
``sllm-gpu``                  ServerlessLLM with a GPU cache (§7.1): stopped instances' weights stay
                              on their GPUs and a start of the same model there skips the load;
                              every start creates its process and engine (no pool)
``sllm-gpu-pooled``           the same with WarmServe's model-agnostic process pool and engines
                              (an upper bound for SLLM-GPU; the paper does not say which)
``muxserve``                  static colocation from average rates, MuxServe placement, ADBS
                              batch caps capped at the scenario's batch (32), KV quotas,
                              load-following sharing slowdown
``muxserve-adbs``             the same with MuxServe's own ADBS batch caps (up to 256, §7.1)
``prism``                     KV-pressure placement, idle eviction, fast activation on a pooled
                              engine, scale-out onto idle GPUs (our extension, documented), at
                              the scenario's batch (32)
``prism-256``                 the same at Prism's own engine default (vLLM max_num_seqs 256)
``dedicated``                 the best static allocation of the GPUs, sized from simulated
                              service times (:mod:`warmserve.sim.baselines.dedicated`)
============================  ======================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from warmserve.policy.cluster import PolicyInputError


@dataclass(frozen=True)
class SystemConfig:
    """Switches of one system.

    ``mode``: ``autoscale`` (instances come and go with the autoscaler), ``dedicated`` or
    ``muxserve`` (a fixed set of instances created before the run), ``prism``.
    Start-up: which non-weight stages are already done at a start (``pooled_process``,
    ``engine_ready``; the communication group is ready only on a prewarm hit when
    ``comm_group_on_hit``), and whether serving may begin after the first layers
    (``stream_layers``) or waits for all weights.
    ``reclaim``: a model with waiting requests and no GPU group may drain instances other models
    can spare (:mod:`warmserve.policy.reclaim`; WarmServe systems only).
    ``on_stop``: what a stopped instance leaves on its GPUs — ``none`` (idle), ``replica``
    (WarmServe: the old model stays as a prewarm slot, §4.1) or ``cache`` (SLLM-GPU).
    ``stock_loader``: weights load through stock vLLM's own loader, slower than the weight path
    by the start-up profile's ``load.stock_slowdown`` (:mod:`warmserve.sim.startup`).
    Eviction, grace, load and re-planning are the control layer's rules
    (:mod:`warmserve.control.controller`), the same as the operator's.
    ``own_batch`` (MuxServe, Prism): the baseline's own batch cap instead of the scenario's.
    ``activate`` (Prism only): a request no instance can take activates one more instance of
    its model on a pooled engine, on the lowest-KVPR GPUs with room, evicting idle models when
    memory is short (Prism §5.2, §6.2; :mod:`warmserve.sim.baselines.prism`).
    """

    name: str
    mode: str = "autoscale"
    prewarm: bool = False
    evict_aware: bool = True
    proactive: bool = False
    reclaim: bool = False
    pooled_process: bool = False
    engine_ready: bool = False
    comm_group_on_hit: bool = False
    stream_layers: bool = False
    on_stop: str = "none"
    stock_loader: bool = False
    activate: bool = False
    own_batch: bool = False
    description: str = ""


SYSTEMS: dict[str, SystemConfig] = {
    s.name: s
    for s in (
        SystemConfig(
            "warmserve", reclaim=True,
            prewarm=True, proactive=True, pooled_process=True, engine_ready=True,
            comm_group_on_hit=True, stream_layers=True, on_stop="replica",
            description="WarmServe (full)",
        ),
        SystemConfig(
            "warmserve-no-proactive", reclaim=True,
            prewarm=True, proactive=False, pooled_process=True,
            engine_ready=True, comm_group_on_hit=True, stream_layers=True, on_stop="none",
            description="WarmServe without proactive prewarming (§7.5)",
        ),
        SystemConfig(
            "warmserve-no-lending", reclaim=True,
            prewarm=True, proactive=False, pooled_process=True,
            engine_ready=True, comm_group_on_hit=True, stream_layers=True, on_stop="replica",
            description="WarmServe without grace-period lending (weights still kept on stop)",
        ),
        SystemConfig(
            "warmserve-no-keep-weights", reclaim=True,
            prewarm=True, proactive=True, pooled_process=True,
            engine_ready=True, comm_group_on_hit=True, stream_layers=True, on_stop="none",
            description="WarmServe whose stopped instances leave nothing (lending still on)",
        ),
        SystemConfig(
            "warmserve-no-evict-aware", reclaim=True,
            prewarm=True, evict_aware=False, proactive=True,
            pooled_process=True, engine_ready=True, comm_group_on_hit=True, stream_layers=True,
            on_stop="replica",
            description="WarmServe with first-fit placement (§7.5)",
        ),
        SystemConfig(
            "warmserve-no-reclaim", prewarm=True, proactive=True, pooled_process=True,
            engine_ready=True, comm_group_on_hit=True, stream_layers=True, on_stop="replica",
            description="WarmServe without reclaim (a starving model waits for scale-downs)",
        ),
        SystemConfig(
            "warmserve-no-prediction", reclaim=True,
            prewarm=False, proactive=False, pooled_process=True,
            engine_ready=True, comm_group_on_hit=True, stream_layers=True, on_stop="replica",
            description="WarmServe without forecasts: no prewarm replicas are planned",
        ),
        SystemConfig(
            "reactive", stock_loader=True,
            description="HPA-style autoscaling, vLLM cold starts from host memory",
        ),
        SystemConfig(
            "sllm-gpu", on_stop="cache",
            description="ServerlessLLM with weights cached on GPUs (§7.1 SLLM-GPU)",
        ),
        SystemConfig(
            "sllm-gpu-pooled", pooled_process=True, engine_ready=True, on_stop="cache",
            description="SLLM-GPU given WarmServe's model-agnostic process pool and engines",
        ),
        SystemConfig("muxserve", mode="muxserve", description="MuxServe static colocation"),
        SystemConfig(
            "muxserve-adbs", mode="muxserve", own_batch=True,
            description="MuxServe with its own ADBS batch caps (up to 256)",
        ),
        SystemConfig(
            "prism", mode="prism", activate=True,
            description="Prism KV-pressure sharing, idle eviction, fast activation",
        ),
        SystemConfig(
            "prism-256", mode="prism", activate=True, own_batch=True,
            description="Prism at its own engine default batch (256)",
        ),
        SystemConfig(
            "dedicated", mode="dedicated",
            description="the best static allocation of the GPUs (simulated service times)",
        ),
    )
}

DEFAULT_SYSTEMS: tuple[str, ...] = tuple(SYSTEMS)
STATIC_MODES = ("dedicated", "muxserve", "prism")  # no start-up profile enters their results


def get_system(name: str) -> SystemConfig:
    try:
        return SYSTEMS[name]
    except KeyError:
        raise PolicyInputError(
            f"unknown system {name!r} (known: {', '.join(SYSTEMS)})"
        ) from None


def parse_systems(spec: str | None, default: tuple[str, ...] = DEFAULT_SYSTEMS) -> list[str]:
    """``"a,b"`` → validated names (``None``/empty: ``default``)."""
    names = [s.strip() for s in spec.split(",") if s.strip()] if spec else list(default)
    if not names:
        raise PolicyInputError("no system selected")
    for n in names:
        get_system(n)
    if len(set(names)) != len(names):
        raise PolicyInputError("a system is listed twice")
    return names
