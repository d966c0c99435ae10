"""``warmserve up`` from start to end: checks, build, stack, replay(s), report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from warmserve.textfmt import columns

from . import procs
from .controlplane import REPO, check_checkout, ensure_binaries
from .model_mix import ENGINES, UpConfigError, load_default, parse_gpus
from .realengine import SAMPLE_QUESTION, find_vllm_python, real_models, sample_answers
from .realengine import describe as describe_engine
from .report import RunData, headline, table, write
from .run import info_of, replay_once, reset_for_next, settle_note
from .stack import down, start
from .state import (
    Stack,
    StackError,
    check_can_start,
    default_dir,
    kubectl_command,
    warmserve_command,
)
from .workload import plan as make_plan


@dataclass
class UpOptions:
    state_dir: Path
    gpus: str | None = None  # default: DEFAULT_GPUS[engine]
    trace: str | None = None
    speed: float = 20.0
    minutes: float = 30.0
    compare: str | None = None
    port: int = 8000
    rps: float | None = None
    tty: bool | None = None
    engine: str = "simulated"


# The simulated engine's 1/1024 bytes fit a big cluster; real weights (269 MB each, 1:1) fit 1 GiB
# GPUs, two of them: one vLLM engine per GPU is what two CPU cores carry.
DEFAULT_GPUS = {"simulated": "2x8x80GiB", "vllm": "1x2x1GiB"}


def up(opts: UpOptions, say: Callable[[str], None] = print) -> dict[str, object]:
    """Run everything; returns the report's summary. Raises StackError / UpConfigError (one-line
    messages) for bad input or a failed start, after stopping whatever had started."""
    t_begin = time.monotonic()
    if opts.engine not in ENGINES:
        raise UpConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {opts.engine!r}")
    mix = load_default(opts.engine)
    gpus = opts.gpus or DEFAULT_GPUS[opts.engine]
    if opts.rps is not None:
        if not 0 < opts.rps <= 50:
            raise UpConfigError(f"--rps must be in (0, 50], got {opts.rps:g}")
        mix = replace(mix, rps=opts.rps)
    if opts.compare not in (None, "reactive"):
        raise UpConfigError(f"--compare: only 'reactive' is supported, got {opts.compare!r}")
    nodes, per_node, gib = parse_gpus(gpus)
    too_wide = [m.name for m in mix.models if m.tp > per_node]
    if too_wide:
        raise UpConfigError(
            f"--gpus {gpus}: {', '.join(too_wide)} need {max(m.tp for m in mix.models)} GPUs "
            "on one node (tensor parallel)"
        )
    if not 1 <= opts.port <= 65535:
        raise UpConfigError(f"--port must be in 1-65535, got {opts.port}")
    plan = make_plan(mix, opts.trace or mix.arrivals, opts.speed, opts.minutes)
    check_can_start(opts.state_dir)
    if not procs.port_free("0.0.0.0", opts.port):
        raise StackError(
            f"port {opts.port} is in use (the gateway's API port); free it or choose another "
            "with --port"
        )
    check_checkout()
    # Checked before anything starts: without vLLM, one line saying how to get it.
    agent_python = find_vllm_python() if mix.engine == "vllm" else ""
    say(
        f"== warmserve up: {nodes} nodes x {per_node} GPUs ({gib:g} GiB, simulated), "
        f"{len(mix.models)} models, {plan.description}"
    )
    say(f"   engine: {describe_engine(mix)}")
    say(
        f"   replay: {opts.minutes:g} trace minutes at {opts.speed:g}x = {plan.duration_s:.0f}s "
        f"(+{plan.warmup_s:.0f}s warm-up), {len(plan)} requests at {mix.rps:g} req/s; "
        f"{settle_note()}"
    )
    say("== control plane binaries (hack/k8s/build.sh; cached after the first build)")
    bin_dir = ensure_binaries(lambda line: say("   " + line))
    real = real_models(mix, agent_python, lambda m: say("   " + m)) if agent_python else None
    stack = Stack(opts.state_dir)
    stack.save()
    try:
        run = start(
            stack,
            bin_dir,
            mix,
            plan,
            nodes,
            per_node,
            gib,
            opts.port,
            lambda m: say("   " + m),
            real=real,
            agent_python=agent_python,
        )
        say(f"== stack up in {time.monotonic() - t_begin:.0f}s")
        say(f"   export KUBECONFIG={stack.kubeconfig}")
        say(f"   gateway: {run.gateway_urls[0]}  (replicas {', '.join(run.gateway_urls)})")
        labels = ["warmserve"] + (["reactive"] if opts.compare else [])
        runs: list[RunData] = []
        for i, label in enumerate(labels):
            if i:
                say("== resetting the cluster for the reactive baseline")
                reset_for_next(run, lambda m: say("   " + m))
            stack.state = "replaying"
            stack.save()
            data = replay_once(run, mix, plan, label, say, tty=opts.tty)
            runs.append(data)
            if data.interrupted:
                say("== replay interrupted: writing the report of what ran")
                break
        answers = {}
        if real:
            say(f"== asking each real model {SAMPLE_QUESTION!r} through the gateway (greedy)")
            answers = sample_answers(run.gateway_urls[0], [m.name for m in mix.models if m.real])
            for m, a in answers.items():
                say(f"   {m}: {a}")
    except BaseException as exc:
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc)
        say(f"== warmserve up failed ({why}): stopping the stack (logs stay in {stack.dir})")
        down(opts.state_dir, lambda m: say("   " + m))
        raise
    stack.state = "ready"
    stack.save()
    out = stack.dir / "runs" / time.strftime("%Y%m%d-%H%M%S")
    info = {
        **info_of(run),
        "gpus": gpus,
        "engine": describe_engine(mix),
        **{f"answer of {m} to {SAMPLE_QUESTION!r}": a for m, a in answers.items()},
        "wall time of warmserve up until the report": f"{time.monotonic() - t_begin:.0f}s",
    }
    summary = write(runs, out, info)
    say("")
    say(columns(table(runs)))
    say("")
    say(headline(runs))
    say(f"report: {out / 'report.md'}")
    for name, path in summary["plots"].items():  # type: ignore[union-attr]
        say(f"   {name}: {path}")
    say("")
    ws = warmserve_command()
    sd = "" if opts.state_dir == default_dir() else f" --state-dir {opts.state_dir}"
    kubectl = kubectl_command(bin_dir, REPO)
    say("the stack keeps running (the last replay's deployments stay):")
    say(f"   export KUBECONFIG={stack.kubeconfig}")
    say(f"   {kubectl} get wsmd,gpunodes,pods      # or any kubectl")
    say(f"   {ws} status")
    say(f"   curl {run.gateway_urls[0]}/v1/models")
    say(f"   {ws} down{sd}      # stops every process of the stack")
    summary["report"] = str(out / "report.md")
    return summary


def down_cmd(state_dir: Path, say: Callable[[str], None] = print) -> int:
    if not state_dir.exists():
        say(f"no warmserve stack recorded in {state_dir}: nothing to stop")
        return 0
    return down(state_dir, say)


__all__ = ["StackError", "UpOptions", "down_cmd", "up"]
