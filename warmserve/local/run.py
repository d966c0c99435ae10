"""One replay on the running stack: ModelDeployments + seeded history, the operator, a settle
period for the first plan, the warm-up, the measured replay (with the live view), and the data
for the report.  ``--compare reactive`` runs it twice on a reset stack (fresh agents, fresh
deployments with prewarming off, the same seeded history and the same requests)."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Callable
from typing import Any

from .controlplane import REPO
from .history import history_configmap
from .model_mix import ModelMix, model_deployments
from .observe import Sampler
from .replay import Replayer
from .report import RunData
from .stack import NAMESPACE, Running, start_operator, stop_pod
from .state import kubectl_command, warmserve_command
from .view import View
from .workload import ReplayPlan

DRAIN_S = 60.0  # after the last request is sent, wait this long for open answers


def _apply_models(
    run: Running, mix: ModelMix, plan: ReplayPlan, prewarm: bool, warm_unix: float
) -> None:
    mds = model_deployments(mix, NAMESPACE, prewarm=prewarm)
    run.plane.apply(mds)
    end_window = round(warm_unix / plan.window_s)
    cms = []
    for md in mds:
        name = md["metadata"]["name"]
        uid = run.plane.get("-n", NAMESPACE, "modeldeployment", name)["metadata"]["uid"]
        avg, peak = plan.history[name]
        if avg:
            cms.append(
                history_configmap(NAMESPACE, uid, name, plan.window_s, end_window, avg, peak)
            )
    if cms:
        run.plane.apply(cms)


def _delete_models(run: Running, say: Callable[[str], None]) -> None:
    """Delete the deployments; the operator's finalizer drains and evicts everything first."""
    run.plane.kubectl(
        "-n",
        NAMESPACE,
        "delete",
        "modeldeployments",
        "--all",
        "--wait=true",
        "--timeout=180s",
        timeout=200,
    )
    say("deployments deleted (the operator drained their instances and replicas)")


def replay_once(
    run: Running,
    mix: ModelMix,
    plan: ReplayPlan,
    label: str,
    say: Callable[[str], None],
    *,
    tty: bool | None,
) -> RunData:
    prewarm = label == "warmserve"
    # Traffic and the operator start together on a window boundary, and the seeded history ends
    # right before it, as if the operator had been watching the models until then.  (An operator
    # started earlier would record the quiet time before the traffic as a window of zero load.)
    warm_unix = math.ceil((time.time() + 8) / plan.window_s) * plan.window_s
    _apply_models(run, mix, plan, prewarm, warm_unix)
    seeded = sum(1 for a, _ in plan.history.values() if a)
    say(
        f"[{label}] applied {len(mix.models)} ModelDeployments "
        f"(prewarm {'on' if prewarm else 'off'}) and {seeded} seeded load histories"
    )
    t0_unix = warm_unix + plan.warmup_s
    t0_mono = time.monotonic() + (t0_unix - time.time())
    sampler = Sampler(run.stack.kubeconfig, NAMESPACE)
    sampler.set_origin(t0_mono)
    sampler.start()
    time.sleep(max(0.0, warm_unix - time.time()))
    start_operator(run, say)
    learns = "forecasts from the seeded history" if seeded else "learns the load (no history)"
    say(
        f"[{label}] warm-up: {plan.warmup_s:g}s of the trace (not measured) while the operator "
        f"starts, {learns} and prewarms; then the measured replay"
    )
    replayer = Replayer(plan, run.gateway_urls, mix.max_hold_s)
    replayer.t0 = t0_mono
    footer = [
        f"export KUBECONFIG={run.stack.kubeconfig}   "
        f"# then: {kubectl_command(run.plane.bin, REPO)} get wsmd,gpunodes,pods · "
        f"{warmserve_command()} status",
        f"gateway: {run.gateway_urls[0]}/v1/chat/completions   "
        f"logs: {run.stack.dir / 'pods'}/*/log",
        "Ctrl-C: stop the replay and write the report (the stack keeps running)",
    ]
    title = f"warmserve up [{label}] {plan.trace} at {plan.speed:g}x"
    real = [m.name for m in mix.models if m.real]
    if real:  # which models answer with real tokens (the others would be simulated)
        title += f" · real vLLM: {', '.join(real)}"
    interrupted = asyncio.run(
        _drive(replayer, sampler, View(title, sampler, replayer, footer, tty=tty, log=say), t0_mono)
    )
    sampler.stop()
    return RunData(
        label,
        plan,
        list(replayer.results),
        sampler.model_history,
        sampler.node_history,
        t0_unix,
        interrupted,
    )


async def _drive(replayer: Replayer, sampler: Sampler, view: View, t0_mono: float) -> bool:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sampler.recording = True
    try:
        with view:
            task = asyncio.create_task(replayer.run(t0_mono, stop, DRAIN_S))
            while not task.done():
                view.tick()
                await asyncio.wait([task], timeout=0.5)
            await task
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return stop.is_set()


def reset_for_next(run: Running, say: Callable[[str], None]) -> None:
    """Between two systems: remove the deployments through the operator, then restart the
    operator and the agents so the next system starts from the same empty cluster."""
    from .stack import restart_agents

    _delete_models(run, say)
    stop_pod(run, run.operator)
    # The next operator registers the agents again from their pods; stale GPUNode statuses of
    # the agents' previous life would otherwise show until its first poll.
    run.plane.kubectl("delete", "gpunodes", "--all", "--wait=true", "--timeout=60s", timeout=90)
    restart_agents(run, say)


def info_of(run: Running) -> dict[str, Any]:
    return {
        "cluster": f"{len(run.agents)} nodes, agents at {', '.join(a.ip for a in run.agents)}",
        "gateway": ", ".join(run.gateway_urls),
    }


def settle_note() -> str:
    return f"up to {DRAIN_S:g}s after the last request for the answers still open"
