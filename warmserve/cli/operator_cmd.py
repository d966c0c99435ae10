"""``warmserve operator``: run the kopf operator (ModelDeployment reconciliation, window loop).

(The module is not called ``operator.py``: that name would shadow the standard library.)
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import uuid
from typing import Any

from warmserve import tracing
from warmserve.cli import DefaultsHelpFormatter, engine_arg_flags
from warmserve.policy.overshoot import DEFAULT_OVERSHOOT_HEADROOM, DEFAULT_OVERSHOOT_SPARES


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def register(subparsers: Any) -> None:
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
        default=_env_float("WARMSERVE_WINDOW_S", 300.0),
        help="prediction window W in seconds (must divide a day; env WARMSERVE_WINDOW_S)",
    )
    p.add_argument(
        "--poll-seconds",
        "--poll",
        dest="poll",
        type=float,
        default=_env_float("WARMSERVE_POLL_S", 5.0),
        help="agent poll / autoscaling interval in seconds (env WARMSERVE_POLL_S)",
    )
    p.add_argument(
        "--day-seconds",
        dest="day",
        type=float,
        default=_env_float("WARMSERVE_DAY_S", 86400.0),
        help="length of the predictor's seasonal day in seconds: 86400, except for a "
        "time-compressed trace replay (`warmserve up --speed 20` passes 4320); the window must "
        "divide it (env WARMSERVE_DAY_S)",
    )
    p.add_argument(
        "--predictor",
        default=os.environ.get("WARMSERVE_PREDICTOR") or None,
        help="predictor name (default: the policy core's default)",
    )
    p.add_argument(
        "--load-bandwidth-gib",
        type=float,
        default=2.0,
        help="host->GPU GiB/s used to estimate T_c when a spec gives no coldStartSeconds",
    )
    p.add_argument(
        "--agent-lost-after",
        type=int,
        default=3,
        help="failed polls after which an agent counts as lost",
    )
    p.add_argument(
        "--scale-down-delay",
        type=float,
        default=60.0,
        help="seconds the load must stay low before an instance is drained",
    )
    p.add_argument(
        "--max-grace",
        type=float,
        default=300.0,
        help="longest grace period (seconds) of a drained instance",
    )
    p.add_argument(
        "--spare-replicas",
        type=int,
        default=0,
        help="extra burst prewarm replicas per model beyond Eq. 6, kept warm behind each start "
        "(docs/policy.md 'Spare replicas'; 0: the paper's Eq. 6)",
    )
    p.add_argument(
        "--overshoot-spares",
        type=int,
        default=DEFAULT_OVERSHOOT_SPARES,
        help="extra burst prewarm replicas for a model whose demand passed its forecast peak "
        "this window or the last (docs/policy.md 'Overshoot spares'; 0: off; default "
        "%(default)s)",
    )
    p.add_argument(
        "--overshoot-headroom",
        type=float,
        default=DEFAULT_OVERSHOOT_HEADROOM,
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
        default=10.0,
        help="duration of the loop's leader Lease (whole seconds): a replacement takes over at "
        "most this long (plus one retry period) after a leader dies",
    )
    p.add_argument(
        "--renew-deadline-seconds",
        type=float,
        default=None,
        help="the leader stops acting (fences itself) when it has not renewed its Lease for "
        "this long; must be shorter than --lease-seconds (client-go's renewDeadline; default: "
        "0.7 x --lease-seconds, 7 s)",
    )
    p.add_argument(
        "--retry-period-seconds",
        type=float,
        default=None,
        help="time between Lease renewals by the leader and acquisition attempts by the other "
        "replicas, on their own schedule whatever a poll takes; must be shorter than "
        "--renew-deadline-seconds (client-go's retryPeriod; default: 0.2 x --lease-seconds, "
        "2 s)",
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
        default="app.kubernetes.io/part-of=warmserve,app.kubernetes.io/component=agent",
        help="label selector of the agent pods",
    )
    p.add_argument("--agent-port", type=int, default=50051, help="agents' gRPC port")
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
        default="admin",
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
        default=1.0,
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
    engine_arg_flags.add_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, connect_agent: Any = None) -> int:
    """``connect_agent``: ``(node, address, fencing) -> AgentPort`` in place of gRPC clients
    (in-process agents: ``python -m warmserve.testing.fake_operator``); None in production."""
    import asyncio
    import logging

    from warmserve.cli import CliError
    from warmserve.policy.autoscaler import AutoscalerConfig
    from warmserve.policy.cluster import PolicyInputError

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper()),
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    for path in (
        args.agent_token_file, args.agent_ca, args.agent_cert, args.agent_key,
        args.gateway_token_file,
    ):
        if path and not os.path.isfile(path):
            raise CliError(f"file not found: {path}")
    gateway_service = _gateway_service(args.gateway_service)
    for url in args.gateway_urls:
        if not url.startswith(("http://", "https://")):
            raise CliError(f"--gateway-url must be an http(s) URL, got {url!r}")
    if not args.gateway_timeout > 0:
        raise CliError(f"--gateway-timeout must be > 0, got {args.gateway_timeout}")
    engine_policy = engine_arg_flags.policy(args)
    engine_arg_flags.log_policy(engine_policy, logging.getLogger("warmserve.operator"))
    if args.held_demand_per_namespace is not None and args.held_demand_per_namespace < 0:
        raise CliError(
            f"--held-demand-per-namespace must be >= 0, got {args.held_demand_per_namespace}"
        )
    from warmserve_operator.tenancy import SourcePolicy, TenancyError

    try:
        sources = SourcePolicy.parse(args.model_sources)
    except TenancyError as exc:
        raise CliError(str(exc)) from exc
    try:
        traces = tracing.from_args(args, "warmserve-operator")
    except tracing.TracingConfigError as exc:
        raise CliError(str(exc)) from None
    try:
        from warmserve_operator.reconciler import OperatorConfig

        config = OperatorConfig(
            window_s=args.window,
            poll_s=min(args.poll, args.window),
            day_s=args.day,
            predictor=args.predictor,
            load_bandwidth=args.load_bandwidth_gib * 1024**3,
            agent_lost_after=args.agent_lost_after,
            spare_replicas=args.spare_replicas,
            overshoot_spares=args.overshoot_spares,
            overshoot_headroom=args.overshoot_headroom,
            autoscaler=AutoscalerConfig(
                scale_down_delay_s=args.scale_down_delay, max_grace_s=args.max_grace
            ),
            engine_policy=engine_policy,
            model_sources=sources,
        )
        from warmserve.policy.predictor import make_predictor

        make_predictor(args.predictor)
    except (PolicyInputError, KeyError, ValueError) as exc:
        raise CliError(str(exc).strip("'\"")) from exc
    election = _election(args)
    _check_cluster()

    import kopf
    import warmserve_operator.handlers  # noqa: F401  (registers the handlers)
    from warmserve_operator.agents import AgentAuth
    from warmserve_operator.gateway_demand import GatewaySources
    from warmserve_operator.ports import AgentDiscovery

    if traces is not None:
        from warmserve_operator import tracing as operator_tracing

        operator_tracing.enable(traces)
    identity = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
    priority = args.priority if args.priority is not None else random.randint(1, 2**30)
    peering = None if args.standalone else args.peering
    memo = kopf.Memo(
        config=config,
        identity=identity,
        priority=priority,
        peering=peering,
        peering_lifetime=args.peering_lifetime,
        election=election,
        namespaces=tuple(args.namespaces),
        history_namespace=args.history_namespace,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        agent_auth=AgentAuth(
            token_file=args.agent_token_file,
            ca_cert=args.agent_ca,
            client_cert=args.agent_cert,
            client_key=args.agent_key,
            server_name=args.agent_server_name,
        ),
        discovery=(
            AgentDiscovery(args.agent_namespace, args.agent_pod_selector, args.agent_port)
            if args.agent_namespace
            else None
        ),
        gateways=GatewaySources(
            gateway_service, args.gateway_port_name, tuple(args.gateway_urls), args.gateway_timeout,
            token_file=args.gateway_token_file,
            held_per_namespace=args.held_demand_per_namespace,
        ),
        connect_agent=connect_agent,
    )
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespaces,
            namespaces=args.namespaces,
            standalone=args.standalone,
            peering_name=peering,
            priority=priority,
            identity=identity,  # type: ignore[arg-type]
            liveness_endpoint=args.liveness,
            memo=memo,
        )
    )
    return 0


def _election(args: argparse.Namespace) -> Any:
    """The leader-election timings, checked (a renew deadline not shorter than the Lease would
    let two replicas act at once)."""
    from warmserve_operator.leader import ElectionConfigError, ElectionTiming

    from warmserve.cli import CliError

    try:
        return ElectionTiming.for_lease(
            args.lease_seconds, args.renew_deadline_seconds, args.retry_period_seconds
        )
    except ElectionConfigError as exc:
        raise CliError(f"{exc}; see --lease-seconds, --renew-deadline-seconds") from exc


def _gateway_service(value: str | None) -> tuple[str, str] | None:
    from warmserve.cli import CliError

    if not value:
        return None
    ns, sep, name = value.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise CliError(f"--gateway-service must be NAMESPACE/NAME, got {value!r}")
    return ns, name


def _check_cluster() -> None:
    """A clear one-line error when there is no kubeconfig and no in-cluster service account."""
    from kubernetes import config

    from warmserve.cli import CliError

    try:
        config.load_incluster_config()
        return
    except config.ConfigException:
        pass
    try:
        # $KUBECONFIG read now, not at import time (the client caches its default path).
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    except (config.ConfigException, FileNotFoundError, TypeError) as exc:
        raise CliError(
            f"no Kubernetes cluster configured ({exc}); set KUBECONFIG or run in a cluster"
        ) from exc
