"""The operator's side of the engine boundary: ``spec.engine`` at admission, TTFT in status.

* :func:`parse_engine` validates ``spec.engine.name`` against the agent's engine registry and
  ``spec.engine.args`` against the schema of vLLM's engine arguments that warmserve ships
  (``warmserve.engine_args``; the operator does not install vLLM) and, at admission, against the
  tenant allowlist as the admin widened it (``warmserve.engine_arg_policy``).  A bad or
  disallowed argument raises :class:`SpecError` naming it, so the deployment is refused when it
  is admitted (``Degraded`` with reason ``InvalidSpec``, and a Warning Event) and no instance
  ever starts with it.
* :func:`ttft_report` compares the engines' observed time to first token with
  ``spec.ttftObjectiveSeconds`` for ``status.ttft`` and the ``TTFTObjectiveMet`` condition.
  The observation is each instance's p95 over the agent's TTFT window (engines measure it; a
  gateway, when it exists, can feed the same status); the deployment's figure is the worst
  instance's (an objective is missed if any instance misses it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from warmserve.engine_args import (
    ENGINE_NAMES,
    EngineArgPolicy,
    EngineArgsError,
    parse_engine_args,
)

from .spec import SpecError

TTFT_CONDITION = "TTFTObjectiveMet"


def parse_engine(
    spec: Mapping[str, Any], policy: EngineArgPolicy | None = None
) -> tuple[str, tuple[str, ...]]:
    """(engine name or "" for the agent's default, engine args) of a ModelDeployment spec;
    ``policy``: the tenant allowlist to apply (None: vLLM's schema and the arguments warmserve
    sets itself only)."""
    eng = spec.get("engine") or {}
    if not isinstance(eng, Mapping):
        raise SpecError("spec.engine must be an object")
    name = eng.get("name") or ""
    if not isinstance(name, str) or (name and name not in ENGINE_NAMES):
        raise SpecError(
            f"spec.engine.name {name!r} is not an engine; choose from {list(ENGINE_NAMES)}"
        )
    args = eng.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SpecError("spec.engine.args must be a list of strings")
    try:
        parse_engine_args(args, policy=policy)
    except EngineArgsError as exc:
        raise SpecError(str(exc)) from None
    return name, tuple(args)


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
