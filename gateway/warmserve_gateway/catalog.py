"""ModelDeployments as the gateway sees them, and how a request's ``model`` finds one (pure).

The spec is parsed by the API types' parser (:func:`warmserve.api.crd.parse_model_deployment`,
the one home of the CRD types, which the operator uses too) and duplicates are resolved by the
same rule (:func:`~warmserve.api.crd.dedupe_models`: one deployment per ``spec.model.name``, the
oldest wins), so the gateway routes to the deployment the operator serves.  Whether vLLM takes a
deployment's ``spec.engine.args`` is the operator's admission: a refused deployment carries the
Ready reason ``InvalidSpec``, which the gateway answers at once (:data:`PERMANENT_REASONS`).
Instances come from ``status.instances`` (written by the operator from the agents' reports):
only those in phase ``serving`` get requests; ``starting`` ones are not ready and ``grace`` ones
get no new requests (WarmServe §4.1).  An instance is kept only when the gateway can tie it to an
agent's record in a GPUNode's status (:mod:`.records`): a status a tenant wrote never makes the
gateway contact an address no agent reported.

A request's ``model`` is resolved per caller: among the deployments of the caller's namespaces,
then the admin's cluster-wide names (:mod:`.names`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from warmserve.api.crd import (
    NODE_PLURAL,
    ModelDeploymentSpec,
    SpecError,
    dedupe_models,
    parse_model_deployment,
)

from . import names
from .names import Ambiguous, Named, NameIndex
from .records import NO_RECORD, AgentNode, Records, parse_gpunode

__all__ = ["Ambiguous", "Catalog", "Deployment", "InstanceRef", "parse_deployment"]

log = logging.getLogger("warmserve.gateway.catalog")

# Ready-condition reasons after which holding a request is pointless: nothing will start until
# a person changes something, so the gateway answers 503 at once with the operator's message.
PERMANENT_REASONS = frozenset(
    {"Unplaceable", "ModelNotFound", "InvalidSpec", "DuplicateModel", "SourceNotAllowed"}
)


@dataclass(frozen=True, slots=True)
class InstanceRef:
    instance_id: str
    url: str
    phase: str  # starting | serving | grace
    node: str = ""  # the node the deployment's status names ("" when it names none)
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
    def named(self) -> Named:
        return Named(self.spec.namespace, self.spec.name, self.spec.model)

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
                    str(i.get("node") or ""),
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


def _named(d: Deployment) -> Named:
    return d.named


_WARNED_MAX = 10_000  # distinct refused endpoints logged before the memory of them is reset


class Catalog:
    """The served deployments, by model name; rebuilt from the objects on every change."""

    def __init__(self, global_models: Mapping[str, str] | None = None) -> None:
        self.global_models = dict(global_models or {})  # name -> namespace/deployment
        self._objects: dict[str, Deployment] = {}  # by namespace/name, instances as listed
        self._nodes: dict[str, AgentNode] = {}
        self.records = Records.of(())
        self._raw_owners: dict[str, Deployment] = {}
        self.owners: dict[str, Deployment] = {}  # by spec.model.name, agent-tied instances only
        self.served: dict[str, Deployment] = {}  # the owners by namespace/name
        self.duplicates: dict[str, Deployment] = {}  # by namespace/name
        self._served_names: NameIndex[Deployment] = NameIndex({}, _named)
        self._duplicate_names: NameIndex[Deployment] = NameIndex({}, _named)
        self.invalid: dict[str, str] = {}  # namespace/name -> why
        self._memo: dict[str, tuple[Deployment, tuple[object, ...], Deployment]] = {}
        self._warned: set[tuple[str, str, str]] = set()
        self._by_instance: dict[str, set[str]] = {}  # instance id -> deployments listing it
        self._nodes_listed = False  # no warning about missing records before the first list

    # ---- what a Source hands over (discovery.Scope: (plural, namespace)) ----

    def listed(self, scope: tuple[str, str | None], items: Iterable[Mapping[str, Any]]) -> set[str]:
        """A full list of one scope; returns the model names whose route changed."""
        if scope[0] == NODE_PLURAL:
            return self.replace_nodes(items)
        return self.replace(items, scope[1])

    def event(self, scope: tuple[str, str | None], typ: str, body: Mapping[str, Any]) -> set[str]:
        """One watch event of one scope; returns the model names whose route changed."""
        if scope[0] == NODE_PLURAL:
            return self.delete_node(body) if typ == "DELETED" else self.upsert_node(body)
        return self.delete(body) if typ == "DELETED" else self.upsert(body)

    # ---- ModelDeployments ----

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
        meta = body.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        old = self._objects.get(key)
        self._put(body)
        new = self._objects.get(key)
        if old is None or new is None or new.spec != old.spec:
            return self._rebuild()
        # Only the status changed (the operator's writes; the common event): who serves which
        # name is unchanged, so re-check this deployment's instances only.
        for i in old.instances:
            self._by_instance.get(i.instance_id, set()).discard(key)
        for i in new.instances:
            self._by_instance.setdefault(i.instance_id, set()).add(key)
        if key in self.duplicates:
            self.duplicates[key] = new
            self._duplicate_names.rebind(self.duplicates)
            return set()
        if self._raw_owners.get(new.model) is not old:
            return self._rebuild()
        self._raw_owners[new.model] = new
        now, before = self._verified(new), self.owners.get(new.model)
        if now is before or now == before:
            return set()
        self.owners[new.model] = self.served[key] = now
        self._served_names.rebind(self.served)
        return {new.model}

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

    # ---- GPUNodes: the agents' records ----

    def replace_nodes(self, bodies: Iterable[Mapping[str, Any]]) -> set[str]:
        before = list(self._nodes.values())
        self._nodes = {}
        for body in bodies:
            node = parse_gpunode(body)
            if node is not None:
                self._nodes[node.name] = node
        self._nodes_listed = True
        return self._nodes_changed([*before, *self._nodes.values()])

    def upsert_node(self, body: Mapping[str, Any]) -> set[str]:
        node = parse_gpunode(body)
        name = str((body.get("metadata") or {}).get("name") or "")
        old = self._nodes.get(name)
        if node == old:
            return set()  # e.g. only the requests in flight changed: the records did not
        if node is None:
            self._nodes.pop(name, None)
        else:
            self._nodes[node.name] = node
        return self._nodes_changed([n for n in (old, node) if n is not None])

    def delete_node(self, body: Mapping[str, Any]) -> set[str]:
        old = self._nodes.pop(str((body.get("metadata") or {}).get("name") or ""), None)
        return self._nodes_changed([old] if old is not None else [])

    def _nodes_changed(self, touched: Iterable[AgentNode]) -> set[str]:
        """Re-check the deployments listing an instance of the ``touched`` nodes (before or
        after the change) only: a GPUNode's status changes at every poll."""
        self.records = Records.of(self._nodes.values())
        ids = {r.instance_id for n in touched for r in n.records}
        keys = {k for i in ids for k in self._by_instance.get(i, ())}
        changed: set[str] = set()
        for key in keys:
            d = self._objects.get(key)
            if d is None or self._raw_owners.get(d.model) is not d:
                continue
            now, old = self._verified(d), self.owners.get(d.model)
            if now is not old and now != old:
                self.owners[d.model] = self.served[key] = now
                changed.add(d.model)
        if changed:
            self._served_names.rebind(self.served)
        return changed

    # ---- derived ----

    def _rebuild(self) -> set[str]:
        owners, dups = dedupe_models(d.spec for d in self._objects.values())
        self._raw_owners = {m: self._objects[s.key] for m, s in owners.items()}
        self.duplicates = {s.key: self._objects[s.key] for s in dups}
        self._duplicate_names = NameIndex(self.duplicates, _named)
        self._memo = {k: v for k, v in self._memo.items() if k in self._objects}
        self._by_instance = {}
        for key, d in self._objects.items():
            for i in d.instances:
                self._by_instance.setdefault(i.instance_id, set()).add(key)
        before = self.owners
        self.owners = {m: self._verified(d) for m, d in self._raw_owners.items()}
        self.served = {d.key: d for d in self.owners.values()}
        self._served_names = NameIndex(self.served, _named)
        changed = set()
        for m in set(before) | set(self.owners):
            a, b = before.get(m), self.owners.get(m)
            if a is not b and a != b:
                changed.add(m)
        return changed

    def _verified(self, d: Deployment) -> Deployment:
        """``d`` with only the instances an agent's record backs (:mod:`.records`)."""
        by_id = self.records.by_instance
        sig = tuple(
            (r, self.records.nodes[r.node].host) if r is not None else None
            for r in (by_id.get(i.instance_id) for i in d.instances)
        )
        memo = self._memo.get(d.key)
        if memo is not None and memo[0] is d and memo[1] == sig:
            return memo[2]
        kept = []
        for i in d.instances:
            why = self.records.why_not(d.model, i.instance_id, i.url, i.node)
            if not why:
                kept.append(i)
                continue
            seen = (d.key, i.instance_id, i.url)
            if self._nodes_listed and seen not in self._warned:
                if len(self._warned) >= _WARNED_MAX:
                    self._warned.clear()
                self._warned.add(seen)
                # No record yet is also the moment between two status writes: info; a record
                # that disagrees, or an address never to contact: warning.
                level = logging.INFO if why.startswith(NO_RECORD) else logging.WARNING
                log.log(
                    level,
                    "event=instance_not_routed deployment=%s instance=%r endpoint=%r why=%r",
                    d.key, i.instance_id[:80], i.url[:200], why,
                )  # fmt: skip
        out = d if len(kept) == len(d.instances) else replace(d, instances=tuple(kept))
        self._memo[d.key] = (d, sig, out)
        return out

    # ---- requests ----

    def resolve(self, name: str, namespaces: frozenset[str]) -> Deployment | None:
        """The deployment a request's ``model`` names for a caller of ``namespaces``
        (:mod:`.names`), ``None`` if none; raises :class:`Ambiguous`.  A deployment of the
        caller's that the operator does not serve (a duplicate model) is returned too: check
        :meth:`is_served`."""
        dep = self._served_names.resolve(name, namespaces, self.global_models)
        if dep is not None:
            return dep
        return self._duplicate_names.resolve(name, namespaces, {})

    def is_served(self, dep: Deployment) -> bool:
        return self.served.get(dep.key) is dep

    def visible(self, namespaces: frozenset[str]) -> list[tuple[str, Deployment]]:
        """(listed id, deployment) for ``GET /v1/models`` (:func:`.names.visible`)."""
        return names.visible(
            namespaces, self.served, _named, self.global_models, self._served_names
        )
