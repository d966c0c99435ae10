"""kopf registrations (thin): startup/cleanup of the window loop, ModelDeployment handlers.

Importing this module registers the handlers in kopf's default registry; ``warmserve operator``
(:mod:`warmserve.cli.operator_cmd`) imports it and runs kopf.  Everything with a decision in it
lives in :mod:`.reconciler` / :mod:`.planning`; the handlers only

* validate a ModelDeployment when it is created, changed or seen again after a restart, and say
  so in an Event (the API server's schema already refused malformed specs);
* tear a deployment down on delete: kopf adds the finalizer ``warmserve.io/teardown`` because a
  delete handler exists, and removes it only when :meth:`Reconciler.teardown` reports that no
  instance or slot of the model is left on any agent (otherwise it retries);
* start the cluster-level loop at startup and stop it at cleanup.

kopf's own bookkeeping goes to annotations with the ``warmserve.io`` prefix (not to ``status``,
which the operator writes as a whole), and kopf only posts Events for warnings and errors; the
decision Events come from the reconciler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from .agents import AgentAuth, AgentPool
from .kube import KubeApi
from .metrics import Metrics
from .reconciler import OperatorConfig, Reconciler
from .spec import GROUP, MD_PLURAL, VERSION, SpecError, parse_model_deployment

log = logging.getLogger("warmserve.operator")

FINALIZER = "warmserve.io/teardown"


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.peering.lifetime = int(memo.get("peering_lifetime", 60))
    # One leader for the whole cluster, also when serving a few namespaces only: the window
    # loop places every model on the shared GPUs, so the peering object is the cluster one.
    settings.peering.clusterwide = True
    settings.watching.server_timeout = 60
    config: OperatorConfig = memo["config"]
    kube = KubeApi(
        peering=memo.get("peering"),
        identity=memo["identity"],
        priority=int(memo.get("priority", 0)),
        discovery=memo.get("discovery"),
        namespaces=tuple(memo.get("namespaces") or ()),
        history_namespace=memo.get("history_namespace"),
    )
    await kube.ensure_peering()
    metrics = Metrics()
    if memo.get("metrics_port"):
        metrics.serve(int(memo["metrics_port"]), memo.get("metrics_address", "0.0.0.0"))
    auth: AgentAuth = memo.get("agent_auth") or AgentAuth()
    gateways = memo.get("gateways")
    demand = gateways.build() if gateways is not None else None
    reconciler = Reconciler(config, kube, AgentPool(auth), metrics, demand=demand)
    stop = asyncio.Event()
    memo["reconciler"] = reconciler
    memo["stop"] = stop
    memo["loop_task"] = asyncio.get_running_loop().create_task(reconciler.run(stop))
    log.info(
        "event=operator_started window_s=%s poll_s=%s peering=%s priority=%s identity=%s",
        config.window_s,
        config.poll_s,
        memo.get("peering"),
        memo.get("priority"),
        memo["identity"],
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    stop = memo.get("stop")
    task = memo.get("loop_task")
    if stop is not None:
        stop.set()
    if task is not None:
        try:
            await asyncio.wait_for(task, timeout=10)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
    reconciler = memo.get("reconciler")
    if reconciler is not None:
        await reconciler.agents.close()


@kopf.on.create(GROUP, VERSION, MD_PLURAL)
@kopf.on.update(GROUP, VERSION, MD_PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, MD_PLURAL)
async def model_deployment_changed(body: kopf.Body, reason: str, **_: Any) -> None:
    """Validate; the window loop picks the deployment up on its next poll."""
    try:
        md = parse_model_deployment(body)
    except SpecError as exc:
        raise kopf.PermanentError(f"invalid ModelDeployment: {exc}") from exc
    if reason in ("create", "update"):
        kopf.info(
            body,
            reason="Accepted" if reason == "create" else "SpecChanged",
            message=f"model {md.model}, tensorParallel {md.tp}, maxBatchSize {md.max_batch}, "
            f"instances {md.min_instances}..{md.max_instances}, prewarm "
            f"{'on' if md.prewarm else 'off'}",
        )


@kopf.on.delete(GROUP, VERSION, MD_PLURAL)
async def model_deployment_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer: evict every instance and replica of the model before the object goes."""
    try:
        md = parse_model_deployment(body)
    except SpecError:
        return  # never accepted, so nothing was started for it
    reconciler: Reconciler = memo["reconciler"]
    left = await reconciler.teardown(md)
    if left:
        raise kopf.TemporaryError(
            f"waiting for {len(left)} instance(s)/slot(s) to go: {'; '.join(left)[:500]}", delay=2
        )
    log.info("event=teardown_done model=%s deployment=%s", md.model, md.key)
