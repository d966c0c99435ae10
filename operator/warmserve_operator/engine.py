"""The operator's side of the engine boundary: ``spec.engine`` at admission, TTFT in status.

* :func:`admit_model_deployment` is the operator's admission of a ModelDeployment: the API
  type's parser (:mod:`warmserve.api.crd`: ``spec.engine.name`` one of the engines,
  ``spec.engine.args`` a bounded list of strings), then the arguments against the schema of
  vLLM's engine arguments that warmserve ships (``warmserve.engine_args``; the operator does not
  install vLLM) and the tenant allowlist as the admin widened it
  (``warmserve.engine_arg_policy``).  A bad or disallowed argument raises :class:`SpecError`
  naming it, so the deployment is refused when it is admitted (``Degraded`` with reason
  ``InvalidSpec``, and a Warning Event) and no instance ever starts with it.  The gateway reads
  that reason from the deployment's Ready condition instead of judging vLLM's arguments itself.
* :func:`ttft_report` compares the engines' observed time to first token with
  ``spec.ttftObjectiveSeconds`` for ``status.ttft`` and the ``TTFTObjectiveMet`` condition.
  The observation is each instance's p95 over the agent's TTFT window (engines measure it; a
  gateway, when it exists, can feed the same status); the deployment's figure is the worst
  instance's (an objective is missed if any instance misses it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from warmserve.api.crd import (
    ModelDeploymentSpec,
    SpecError,
    parse_engine_spec,
    parse_model_deployment,
)
from warmserve.engine_args import EngineArgPolicy, EngineArgsError, parse_engine_args

TTFT_CONDITION = "TTFTObjectiveMet"


def parse_engine(
    spec: Mapping[str, Any], policy: EngineArgPolicy | None = None
) -> tuple[str, tuple[str, ...]]:
    """(engine name or "" for the agent's default, engine args) of a ModelDeployment spec,
    admitted; ``policy``: the tenant allowlist to apply (None: vLLM's schema and the arguments
    warmserve sets itself only)."""
    name, args = parse_engine_spec(spec)
    admit_engine_args(args, policy)
    return name, args


def admit_engine_args(args: Sequence[str], policy: EngineArgPolicy | None = None) -> None:
    """Raise :class:`SpecError` naming the first argument vLLM's schema or ``policy`` refuses."""
    try:
        parse_engine_args(list(args), policy=policy)
    except EngineArgsError as exc:
        raise SpecError(str(exc)) from None


def admit_model_deployment(
    body: Mapping[str, Any], policy: EngineArgPolicy | None = None
) -> ModelDeploymentSpec:
    """Parse a ModelDeployment and admit its engine arguments or raise :class:`SpecError`.

    ``policy``: the engine-argument allowlist of the operator's ``--allow-engine-arg`` flags,
    applied when deployments are admitted; the finalizer leaves it out and checks vLLM's schema
    only, so it never misreads a deployment the admin widened."""
    md = parse_model_deployment(body)
    admit_engine_args(md.engine_args, policy)
    return md


def ttft_report(
    observations: Sequence[tuple[float, int, float]], objective_s: float
) -> tuple[dict[str, Any], tuple[str, bool | None, str, str]]:
    """``status.ttft`` and the ``TTFTObjectiveMet`` condition (type, status, reason, message)
    from per-instance ``(p95 seconds, samples, window seconds)``; instances without samples are
    ignored."""
    seen = [(p, n, w) for p, n, w in observations if n > 0]
    status: dict[str, Any] = {"objectiveSeconds": objective_s, "source": "engines"}
    if not seen:
        status["samples"] = 0
        return status, (
            TTFT_CONDITION,
            None,
            "NoObservations",
            "no request reached a serving instance in the TTFT window",
        )
    worst = max(p for p, _, _ in seen)
    samples = sum(n for _, n, _ in seen)
    status.update(
        observedP95Seconds=round(worst, 4),
        samples=samples,
        windowSeconds=max(w for _, _, w in seen),
    )
    met = worst <= objective_s
    return status, (
        TTFT_CONDITION,
        met,
        "ObjectiveMet" if met else "ObjectiveMissed",
        # no figures here (they move with every request): status.ttft has them
        f"p95 time to first token {'is within' if met else 'exceeds'} the objective "
        f"{objective_s:g}s (status.ttft.observedP95Seconds)",
    )
