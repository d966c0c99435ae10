"""The ``/demand`` wire format: what a gateway replica reports of the requests it holds.

Each gateway replica answers ``GET /demand`` on its admin port with a :class:`DemandReport`
(:data:`DEMAND_API_VERSION`) of its own per-model held counts; ``GET /demand?watch=1`` streams
newline-delimited reports, with an empty line every :data:`HEARTBEAT_S` seconds so that a dead
stream is noticed.  The operator reads and sums them (docs/gateway.md, "Demand").

Keys are ``spec.model.name`` (the policy's model key; the operator serves one deployment per
model name); each entry also names the deployment's ``namespace`` (the tenant).  Only ``held``
enters the demand; ``inflight`` (what the replica forwarded and is still streaming) is
informational: those requests are already counted by the agents.

With tracing on, a model's entry may also carry ``traces``: the W3C ``traceparent`` of up to
:data:`MAX_TRACES` of its held (sampled) requests, oldest first, so the operator's start span
links to the requests that woke it.  Optional both ways: a gateway without tracing omits it and
an operator that does not know it ignores it.  Links only: traces never add to the demand.

A report is read as hostile input (:meth:`DemandReport.from_json` checks every field and raises
:class:`DemandError` naming it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from warmserve.tracing import valid_traceparent

DEMAND_API_VERSION = "warmserve.io/demand/v1"
DEMAND_PATH = "/demand"
HEARTBEAT_S = 2.0
MAX_TRACES = 8  # held requests' trace contexts per model in one report, and linked per start
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class DemandError(ValueError):
    """A demand document that does not follow :data:`DEMAND_API_VERSION`."""


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One model at one gateway replica: requests held in its queue, and forwarded ones."""

    held: int = 0
    inflight: int = 0
    namespace: str = ""  # the deployment's namespace ("" from a gateway before tenancy)
    traces: tuple[str, ...] = ()  # traceparents of held requests (tracing on), oldest first


def _model_json(d: ModelDemand) -> dict[str, Any]:
    doc: dict[str, Any] = {"held": d.held, "inflight": d.inflight}
    if d.namespace:
        doc["namespace"] = d.namespace
    if d.traces:
        doc["traces"] = list(d.traces)
    return doc


def _traces(name: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or len(v) > MAX_TRACES:
        raise DemandError(f"models[{name!r}].traces must be a list of at most {MAX_TRACES}")
    for tp in v:
        if not isinstance(tp, str) or not valid_traceparent(tp):
            raise DemandError(f"models[{name!r}].traces: {str(tp)[:80]!r} is not a W3C traceparent")
    return tuple(v)


@dataclass(frozen=True, slots=True)
class DemandReport:
    """What one gateway replica reports (``GET /demand``)."""

    replica: str
    started_unix: float
    seq: int
    models: Mapping[str, ModelDemand] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "apiVersion": DEMAND_API_VERSION,
            "replica": self.replica,
            "startedAt": self.started_unix,
            "seq": self.seq,
            "models": {m: _model_json(d) for m, d in sorted(self.models.items())},
        }

    @classmethod
    def from_json(cls, doc: Any) -> DemandReport:
        if not isinstance(doc, Mapping):
            raise DemandError("a demand report must be a JSON object")
        if doc.get("apiVersion") != DEMAND_API_VERSION:
            raise DemandError(
                f"apiVersion must be {DEMAND_API_VERSION!r}, got {doc.get('apiVersion')!r}"
            )
        models = doc.get("models")
        if not isinstance(models, Mapping):
            raise DemandError("models must be an object")
        out: dict[str, ModelDemand] = {}
        for name, d in models.items():
            if not isinstance(name, str) or not isinstance(d, Mapping):
                raise DemandError(f"models[{name!r}] must be an object")
            held, inflight = d.get("held", 0), d.get("inflight", 0)
            for key, v in (("held", held), ("inflight", inflight)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise DemandError(f"models[{name!r}].{key} must be an integer >= 0, got {v!r}")
            ns = d.get("namespace", "")
            if not isinstance(ns, str) or (ns and not _NAMESPACE.match(ns)):
                raise DemandError(f"models[{name!r}].namespace must be a namespace name")
            out[name] = ModelDemand(held, inflight, ns, _traces(name, d.get("traces", [])))
        started, seq = doc.get("startedAt", 0.0), doc.get("seq", 0)
        if isinstance(started, bool) or not isinstance(started, int | float):
            raise DemandError("startedAt must be a number")
        if not math.isfinite(started):
            raise DemandError("startedAt must be finite")
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise DemandError("seq must be an integer")
        return cls(str(doc.get("replica", "")), float(started), seq, out)
