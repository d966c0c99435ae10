"""``warmserve operator``'s handler: the flags checked into the operator's settings, then kopf.

(The package is not called ``operator``: that name would shadow the standard library.)
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import uuid
from typing import Any

from warmserve.flags import CliError, engine_args, tracing
from warmserve.tracing import TracingConfigError


def run(args: argparse.Namespace, connect_agent: Any = None) -> int:
    """``connect_agent``: ``(node, address, fencing) -> AgentPort`` in place of gRPC clients
    (in-process agents: ``python -m warmserve_operator.testing``); None in production."""
    import asyncio
    import logging

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
    engine_policy = engine_args.policy(args)
    engine_args.log_policy(engine_policy, logging.getLogger("warmserve.operator"))
    if args.held_demand_per_namespace is not None and args.held_demand_per_namespace < 0:
        raise CliError(
            f"--held-demand-per-namespace must be >= 0, got {args.held_demand_per_namespace}"
        )
    from ..tenancy import SourcePolicy, TenancyError

    try:
        sources = SourcePolicy.parse(args.model_sources)
    except TenancyError as exc:
        raise CliError(str(exc)) from exc
    try:
        traces = tracing.from_args(args, "warmserve-operator")
    except TracingConfigError as exc:
        raise CliError(str(exc)) from None
    try:
        from ..config import OperatorConfig

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

    from .. import handlers  # noqa: F401  (registers the handlers)
    from ..agents import AgentAuth
    from ..gateway_demand import GatewaySources
    from ..ports import AgentDiscovery

    if traces is not None:
        from .. import tracing as operator_tracing

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
    from ..leader import ElectionConfigError, ElectionTiming

    try:
        return ElectionTiming.for_lease(
            args.lease_seconds, args.renew_deadline_seconds, args.retry_period_seconds
        )
    except ElectionConfigError as exc:
        raise CliError(f"{exc}; see --lease-seconds, --renew-deadline-seconds") from exc


def _gateway_service(value: str | None) -> tuple[str, str] | None:
    if not value:
        return None
    ns, sep, name = value.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise CliError(f"--gateway-service must be NAMESPACE/NAME, got {value!r}")
    return ns, name


def _check_cluster() -> None:
    """A clear one-line error when there is no kubeconfig and no in-cluster service account."""
    from kubernetes import config

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
