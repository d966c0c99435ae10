"""``warmserve operator``: run the kopf operator (ModelDeployment reconciliation, window loop).

The flags are here; :mod:`.run` checks them and runs kopf.  Every default that a settings
dataclass holds is read from it (:func:`warmserve.flags.default`): the loop's
(:class:`~warmserve_operator.config.OperatorConfig`, the policy's ``AutoscalerConfig``), the
leader election's (:class:`~warmserve_operator.leader.ElectionTiming`), the agents' discovery
(:class:`~warmserve_operator.ports.AgentDiscovery`) and the gateways' (``GatewaySources``).
"""

from __future__ import annotations

import os
from typing import Any

from warmserve.flags import DefaultsHelpFormatter, default, engine_args, tracing
from warmserve.policy.autoscaler import AutoscalerConfig

from ..config import OperatorConfig
from ..gateway_demand import GatewaySources
from ..leader import RENEW_DEADLINE_SHARE, RETRY_SHARE, ElectionTiming
from ..ports import AgentDiscovery
from .run import run

__all__ = ["register", "run"]


def _env_float(name: str, fallback: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else fallback


def register(subparsers: Any) -> None:
    timing = ElectionTiming()
    p = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator (kopf)",
        description=(
            "Run the warmserve operator: reconciles ModelDeployments, polls the node agents "
            "registered as GPUNodes, predicts each model's load every window and prewarms / "
            "starts / drains instances through the agents' gRPC API. Uses the kubeconfig "
            "($KUBECONFIG or ~/.kube/config) or the in-cluster service account."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--window-seconds",
        "--window",
        dest="window",
        type=float,
        default=_env_float("WARMSERVE_WINDOW_S", default(OperatorConfig, "window_s")),
        help="prediction window W in seconds (must divide a day; env WARMSERVE_WINDOW_S)",
    )
    p.add_argument(
        "--poll-seconds",
        "--poll",
        dest="poll",
        type=float,
        default=_env_float("WARMSERVE_POLL_S", default(OperatorConfig, "poll_s")),
        help="agent poll / autoscaling interval in seconds (env WARMSERVE_POLL_S)",
    )
    p.add_argument(
        "--day-seconds",
        dest="day",
        type=float,
        default=_env_float("WARMSERVE_DAY_S", default(OperatorConfig, "day_s")),
        help="length of the predictor's seasonal day in seconds: 86400, except for a "
        "time-compressed trace replay (`warmserve up --speed 20` passes 4320); the window must "
        "divide it (env WARMSERVE_DAY_S)",
    )
    p.add_argument(
        "--predictor",
        default=os.environ.get("WARMSERVE_PREDICTOR") or default(OperatorConfig, "predictor"),
        help="predictor name (default: the policy core's default)",
    )
    p.add_argument(
        "--load-bandwidth-gib",
        type=float,
        default=default(OperatorConfig, "load_bandwidth") / 1024**3,
        help="host->GPU GiB/s used to estimate T_c when a spec gives no coldStartSeconds",
    )
    p.add_argument(
        "--agent-lost-after",
        type=int,
        default=default(OperatorConfig, "agent_lost_after"),
        help="failed polls after which an agent counts as lost",
    )
    p.add_argument(
        "--scale-down-delay",
        type=float,
        default=default(AutoscalerConfig, "scale_down_delay_s"),
        help="seconds the load must stay low before an instance is drained",
    )
    p.add_argument(
        "--max-grace",
        type=float,
        default=default(AutoscalerConfig, "max_grace_s"),
        help="longest grace period (seconds) of a drained instance",
    )
    p.add_argument(
        "--spare-replicas",
        type=int,
        default=default(OperatorConfig, "spare_replicas"),
        help="extra burst prewarm replicas per model beyond Eq. 6, kept warm behind each start "
        "(docs/policy.md 'Spare replicas'; 0: the paper's Eq. 6)",
    )
    p.add_argument(
        "--overshoot-spares",
        type=int,
        default=default(OperatorConfig, "overshoot_spares"),
        help="extra burst prewarm replicas for a model whose demand passed its forecast peak "
        "this window or the last (docs/policy.md 'Overshoot spares'; 0: off; default "
        "%(default)s)",
    )
    p.add_argument(
        "--overshoot-headroom",
        type=float,
        default=default(OperatorConfig, "overshoot_headroom"),
        help="... and for a model whose forecast peak leaves less than this share of a batch of "
        "room in the instances Eq. 6 sizes for (0: never; default %(default)s)",
    )
    p.add_argument(
        "--peering",
        default=os.environ.get("WARMSERVE_PEERING", "warmserve"),
        help="kopf ClusterKopfPeering name used for leader election",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="no leader election (only ever run one replica like this)",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the live replica with the highest one acts "
        "(default: random, so equal priorities are unlikely)",
    )
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        dest="namespaces",
        help="serve ModelDeployments of this namespace only (repeatable; default: all)",
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=20,
        help="seconds a replica that stopped heart-beating still counts as alive",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=timing.lease_s,
        help="duration of the loop's leader Lease (whole seconds): a replacement takes over at "
        "most this long (plus one retry period) after a leader dies",
    )
    p.add_argument(
        "--renew-deadline-seconds",
        type=float,
        default=None,
        help="the leader stops acting (fences itself) when it has not renewed its Lease for "
        "this long; must be shorter than --lease-seconds (client-go's renewDeadline; default: "
        f"{RENEW_DEADLINE_SHARE:g} x --lease-seconds, {timing.renew_deadline_s:g} s)",
    )
    p.add_argument(
        "--retry-period-seconds",
        type=float,
        default=None,
        help="time between Lease renewals by the leader and acquisition attempts by the other "
        "replicas, on their own schedule whatever a poll takes; must be shorter than "
        "--renew-deadline-seconds (client-go's retryPeriod; default: "
        f"{RETRY_SHARE:g} x --lease-seconds, {timing.retry_s:g} s)",
    )
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (0: off)")
    p.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        help="Prometheus bind address (loopback by default; the Helm chart passes 0.0.0.0 so "
        "Prometheus can scrape the pod)",
    )
    p.add_argument(
        "--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    p.add_argument(
        "--agent-token-file",
        default=os.environ.get("WARMSERVE_AGENT_TOKEN_FILE"),
        help="bearer token file for the agents' gRPC API",
    )
    p.add_argument("--agent-ca", default=None, help="CA certificate (PEM) of the agents' TLS")
    p.add_argument("--agent-cert", default=None, help="client certificate (PEM) for mutual TLS")
    p.add_argument("--agent-key", default=None, help="client key (PEM) for mutual TLS")
    p.add_argument(
        "--agent-server-name",
        default=None,
        help="DNS name expected in the agents' TLS certificates",
    )
    p.add_argument(
        "--agent-namespace",
        default=os.environ.get("POD_NAMESPACE") or None,
        help="discover agent pods in this namespace and register them as GPUNodes "
        "(default: $POD_NAMESPACE; unset: discovery off, GPUNodes are made by hand)",
    )
    p.add_argument(
        "--agent-pod-selector",
        default=default(AgentDiscovery, "selector"),
        help="label selector of the agent pods",
    )
    p.add_argument(
        "--agent-port", type=int, default=default(AgentDiscovery, "port"), help="agents' gRPC port"
    )
    p.add_argument(
        "--gateway-service",
        default=os.environ.get("WARMSERVE_GATEWAY_SERVICE") or None,
        metavar="NAMESPACE/NAME",
        help="read the requests held at every gateway replica (demand for scale from zero) "
        "from the replicas listed in this Service's EndpointSlices (env "
        "WARMSERVE_GATEWAY_SERVICE; the chart sets <release>-gateway-demand)",
    )
    p.add_argument(
        "--gateway-port-name",
        default=default(GatewaySources, "port_name"),
        help="name of the Service port that serves the gateways' /demand",
    )
    p.add_argument(
        "--gateway-url",
        action="append",
        default=[],
        dest="gateway_urls",
        metavar="URL",
        help="admin URL of a gateway replica, e.g. http://127.0.0.1:9092 (repeatable; for "
        "gateways run outside the cluster; with --gateway-service both are read)",
    )
    p.add_argument(
        "--gateway-timeout",
        type=float,
        default=default(GatewaySources, "timeout_s"),
        help="seconds a gateway replica may take to report its held requests",
    )
    p.add_argument(
        "--gateway-token-file",
        default=os.environ.get("WARMSERVE_GATEWAY_TOKEN_FILE") or None,
        metavar="PATH",
        help="bearer token the gateways' /demand requires (their --demand-token-file; re-read "
        "at every poll; the chart mounts <release>-demand-token)",
    )
    p.add_argument(
        "--held-demand-per-namespace",
        type=int,
        default=None,
        metavar="N",
        help="count at most N requests held at the gateways as one namespace's demand (summed "
        "over replicas, spread over its models), so flooding cannot buy GPUs (default: no cap)",
    )
    p.add_argument(
        "--model-source",
        action="append",
        default=[],
        dest="model_sources",
        metavar="NAMESPACE=PREFIX",
        help="a spec.model.source prefix NAMESPACE may fetch from ('*': every namespace; "
        "repeatable; default when none is given: *=hf://, any Hugging Face repo, no s3/pvc/"
        "file); other sources are refused with a SourceNotAllowed condition",
    )
    p.add_argument(
        "--history-namespace",
        default=None,
        help="namespace of the per-model load history ConfigMaps (the operator's own; default: "
        "$POD_NAMESPACE, the in-cluster namespace, else the kubeconfig context's namespace)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )
    p.add_argument("--verbose", action="store_true", help="debug logging (= --log-level debug)")
    tracing.add_arguments(p)  # its decisions as spans, linked to the held requests
    engine_args.add_flags(p)
    p.set_defaults(func=run)
