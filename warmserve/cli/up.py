"""``warmserve up`` / ``warmserve down``: a whole warmserve cluster on this machine.

``up`` starts (or builds first, with progress) the embedded control plane of ``hack/k8s``,
installs the Helm chart into it, runs the chart's operator, one agent per simulated GPU node and
the gateway replicas as local processes wired exactly as the chart wires them, applies a mix of
ModelDeployments, replays a bundled real trace through the gateway (time-compressed), shows it
live and writes a report.  The stack keeps running afterwards; ``down`` stops all of it.
See docs/up.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    from warmserve.local.state import default_dir

    p = subparsers.add_parser(
        "up",
        help="run a local warmserve cluster and replay a real trace through it (live view, report)",
        description=(
            "Start a local warmserve cluster — the real kube-apiserver + etcd built by hack/k8s "
            "(built and cached on first use, 5-30 min; progress is shown), the Helm chart "
            "installed with the real helm, and the chart's operator, node agents (simulated "
            "GPUs) and gateway replicas as local processes with the chart's flags and "
            "ServiceAccount tokens — apply four models (tensor parallel 1, 1, 2, 4), replay a "
            "bundled real trace through the gateway with real HTTP requests, time-compressed, "
            "show the cluster live and write a report with plots. The stack keeps running "
            "afterwards for kubectl and `warmserve status`; `warmserve down` stops it."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--gpus",
        default=None,
        help="NODESxGPUSxMEMORY of the simulated cluster (default 2x8x80GiB; 1x2x1GiB with "
        "--engine vllm)",
    )
    p.add_argument(
        "--engine",
        choices=["simulated", "vllm"],
        default="simulated",
        help="simulated: four Llama-2 stand-ins on the simulated engine (needs nothing); vllm: "
        "real tokens from real vLLM on the CPU for the models that fit one (SmolLM2-135M, twice), "
        "after hack/vllm/setup.sh (~5 GB, once)",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="arrival trace: a bundled name (per-minute counts, e.g. "
        "azure_lmm_2025_multimodal_1week_per_minute; request-level, e.g. azure_conv_2023_1h) "
        "or a CSV path (default: the Azure multimodal week)",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=20.0,
        help="time compression: trace seconds per wall-clock second (the operator's 5-minute "
        "window becomes 300/speed seconds)",
    )
    p.add_argument(
        "--minutes", type=float, default=30.0, help="trace minutes to replay (after a warm-up)"
    )
    p.add_argument(
        "--compare",
        choices=["reactive"],
        default=None,
        help="replay the same requests again with prewarming off (reactive autoscaling) and "
        "put both side by side",
    )
    p.add_argument("--port", type=int, default=8000, help="the gateway's API port on this machine")
    p.add_argument(
        "--rps",
        type=float,
        default=None,
        help="mean requests/s over all models (default 2: warmserve/data/examples/up.yaml)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=default_dir(),
        help="where the stack keeps its state, logs and reports (env WARMSERVE_UP_DIR)",
    )
    p.add_argument(
        "--plain", action="store_true", help="log lines instead of the live table (no TTY)"
    )
    p.set_defaults(func=run_up)

    d = subparsers.add_parser(
        "down",
        help="stop the local cluster `warmserve up` started",
        description="Stop every process `warmserve up` started (recorded in STATE_DIR/stack.json, "
        "and anything else carrying the stack's marker), including the control plane.",
    )
    d.add_argument("--state-dir", type=Path, default=default_dir(), help="as for `up`")
    d.set_defaults(func=run_down)


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_up(args: argparse.Namespace) -> int:
    from warmserve.cli import CliError
    from warmserve.local.model_mix import UpConfigError
    from warmserve.local.session import UpOptions, up
    from warmserve.local.state import StackError

    opts = UpOptions(
        state_dir=args.state_dir.expanduser().absolute(),
        gpus=args.gpus,
        trace=args.trace,
        speed=args.speed,
        minutes=args.minutes,
        compare=args.compare,
        port=args.port,
        rps=args.rps,
        tty=False if args.plain else None,
        engine=args.engine,
    )
    try:
        up(opts, _say)
    except (StackError, UpConfigError) as exc:
        raise CliError(str(exc)) from None
    return 0


def run_down(args: argparse.Namespace) -> int:
    from warmserve.cli import CliError
    from warmserve.local.session import down_cmd
    from warmserve.local.state import StackError

    try:
        return down_cmd(args.state_dir.expanduser().absolute(), _say)
    except StackError as exc:
        raise CliError(str(exc)) from None
