"""ModelDeployments as the gateway sees them, and how a request's ``model`` finds one (pure).

The spec is parsed by the operator's own parser
(:func:`warmserve_operator.spec.parse_model_deployment`, the one home of the CRD types) and
duplicates are resolved by the same rule
(:func:`~warmserve_operator.spec.dedupe_models`: one deployment per ``spec.model.name``, the
oldest wins), so the gateway routes to exactly the deployment the operator serves.  Instances
come from ``status.instances`` (written by the operator from the agents' reports): only those in
phase ``serving`` get requests; ``starting`` ones are not ready and ``grace`` ones get no new
requests (WarmServe §4.1).

A request's ``model`` may name (in this order) a ``spec.model.name``, a ``namespace/name`` of a
deployment, or a deployment's bare name when that is unique among the served deployments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from warmserve_operator.spec import (
    ModelDeploymentSpec,
    SpecError,
    dedupe_models,
    parse_model_deployment,
)

# Ready-condition reasons after which holding a request is pointless: nothing will start until
# a person changes something, so the gateway answers 503 at once with the operator's message.
PERMANENT_REASONS = frozenset({"Unplaceable", "ModelNotFound", "InvalidSpec", "DuplicateModel"})


@dataclass(frozen=True, slots=True)
class InstanceRef:
    instance_id: str
    url: str
    phase: str  # starting | serving | grace
    prewarm_hit: bool = False  # its start was a prewarm hit (status, for tracing)


@dataclass(frozen=True, slots=True)
class Deployment:
    """One ModelDeployment: its spec and what its status says about instances and readiness."""

    spec: ModelDeploymentSpec
    instances: tuple[InstanceRef, ...] = ()
    ready_reason: str = ""  # the Ready condition's reason, "" before the operator wrote one
    ready_message: str = ""

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def serving(self) -> tuple[InstanceRef, ...]:
        return tuple(i for i in self.instances if i.phase == "serving" and i.url)

    def unservable(self) -> str:
        """Why no instance can come (answer 503 at once), or "" when holding makes sense."""
        if self.spec.max_instances == 0:
            return f"ModelDeployment {self.key} has spec.maxInstances 0"
        if self.ready_reason in PERMANENT_REASONS and not self.serving:
            return f"ModelDeployment {self.key} is not ready ({self.ready_reason}): " + (
                self.ready_message or "see its status"
            )
        return ""


def parse_deployment(body: Mapping[str, Any]) -> Deployment:
    """A :class:`Deployment` from a ModelDeployment object; :class:`SpecError` when invalid."""
    spec = parse_model_deployment(body)
    status = body.get("status") or {}
    instances = []
    for i in status.get("instances") or []:
        if isinstance(i, Mapping):
            instances.append(
                InstanceRef(
                    str(i.get("id") or ""),
                    str(i.get("endpoint") or "").rstrip("/"),
                    str(i.get("phase") or ""),
                    i.get("prewarmHit") is True,
                )
            )
    ready = next(
        (
            c
            for c in status.get("conditions") or []
            if isinstance(c, Mapping) and c.get("type") == "Ready"
        ),
        {},
    )
    return Deployment(
        spec, tuple(instances), str(ready.get("reason") or ""), str(ready.get("message") or "")
    )


class Ambiguous(LookupError):
    """A bare deployment name matches deployments in several namespaces."""


class Catalog:
    """The served deployments, by model name; rebuilt from the objects on every change."""

    def __init__(self) -> None:
        self._objects: dict[str, Deployment] = {}  # by namespace/name
        self.owners: dict[str, Deployment] = {}  # by spec.model.name
        self.duplicates: dict[str, Deployment] = {}  # by namespace/name
        self.invalid: dict[str, str] = {}  # namespace/name -> why

    def replace(
        self, bodies: Iterable[Mapping[str, Any]], namespace: str | None = None
    ) -> set[str]:
        """Replace every object (of ``namespace``, or all) by a fresh list; returns the model
        names whose route changed."""
        for store in (self._objects, self.invalid):
            for key in [k for k in store if namespace is None or k.split("/", 1)[0] == namespace]:
                del store[key]
        for body in bodies:
            self._put(body)
        return self._rebuild()

    def upsert(self, body: Mapping[str, Any]) -> set[str]:
        self._put(body)
        return self._rebuild()

    def delete(self, body: Mapping[str, Any]) -> set[str]:
        meta = body.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        self._objects.pop(key, None)
        self.invalid.pop(key, None)
        return self._rebuild()

    def _put(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        try:
            self._objects[key] = parse_deployment(body)
            self.invalid.pop(key, None)
        except SpecError as exc:
            self._objects.pop(key, None)
            self.invalid[key] = str(exc)

    def _rebuild(self) -> set[str]:
        before = self.owners
        specs = {d.spec.key: d for d in self._objects.values()}
        owners, dups = dedupe_models(d.spec for d in self._objects.values())
        self.owners = {m: specs[s.key] for m, s in owners.items()}
        self.duplicates = {s.key: specs[s.key] for s in dups}
        return {
            m for m in set(before) | set(self.owners) if before.get(m) is not self.owners.get(m)
        }

    def lookup(self, name: str) -> Deployment | None:
        """The deployment a request's ``model`` names, ``None`` if none; raises
        :class:`Ambiguous` for a bare name shared by several namespaces."""
        dep = self.owners.get(name)
        if dep is not None:
            return dep
        if "/" in name:
            d = self._objects.get(name)
            return (
                self.owners.get(d.model) if d is not None and d.key not in self.duplicates else None
            )
        hits = [d for d in self.owners.values() if d.spec.name == name]
        if len(hits) > 1:
            raise Ambiguous(
                f"model {name!r} names several ModelDeployments ("
                + ", ".join(sorted(d.key for d in hits))
                + "); use namespace/name or the spec.model.name"
            )
        return hits[0] if hits else None

    def all(self) -> list[Deployment]:
        return sorted(self.owners.values(), key=lambda d: d.model)
