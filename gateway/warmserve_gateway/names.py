"""How a request's ``model`` names a deployment, per caller (pure; property-tested).

A tenant is a namespace.  A caller may use the deployments of its namespaces (an API key's
scope, or ``--anonymous-namespace`` when keys are off) and the names the platform admin claimed
cluster-wide (``--global-model NAME=NAMESPACE/DEPLOYMENT``, Helm ``gateway.globalModels``).
Creating a deployment never makes a name visible outside its namespace.

Resolution of ``name`` for a caller with namespaces ``S``:

1. every deployment in ``S`` whose canonical id ``<namespace>/<name>``, ``spec.model.name`` or
   ``metadata.name`` equals ``name``: one → it; several → :class:`Ambiguous` (400), listing
   their canonical ids (all in ``S``: nothing about other namespaces is revealed);
2. else a global claim of ``name`` whose deployment exists → it;
3. else nothing (404, the same answer as for a name that exists in another namespace).

So a caller's own namespaces come first: a tenant's deployment may shadow a global name for
that tenant's callers only.  The canonical id ``<namespace>/<name>`` always resolves for a
caller of that namespace.  ``GET /v1/models`` lists :func:`visible`: the deployments in ``S``
and the global names not shadowed that way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

NAMESPACE_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS label


class Ambiguous(LookupError):
    """A name matches several deployments the caller may use."""


@dataclass(frozen=True, slots=True)
class Named:
    """What resolution reads of one deployment."""

    namespace: str
    name: str
    model: str  # spec.model.name

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


D = TypeVar("D")


def parse_global(items: Iterable[str]) -> dict[str, str]:
    """``NAME=NAMESPACE/DEPLOYMENT`` flags -> {name: "namespace/deployment"}; ValueError
    (naming the item) when malformed or a name is claimed twice."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, target = item.partition("=")
        name, target = name.strip(), target.strip()
        ns, slash, dep = target.partition("/")
        if not sep or not name or not slash or not ns or not dep or "/" in dep:
            raise ValueError(f"--global-model must be NAME=NAMESPACE/DEPLOYMENT, got {item!r}")
        if name in out and out[name] != target:
            raise ValueError(f"--global-model: {name!r} is claimed twice")
        out[name] = target
    return out


def resolve(
    name: str,
    namespaces: frozenset[str],
    deployments: Mapping[str, D],
    named: Callable[[D], Named],
    global_models: Mapping[str, str],
) -> D | None:
    """The deployment ``name`` means for a caller of ``namespaces`` (module docstring).
    ``deployments`` by canonical id."""
    hits = []
    for key, d in deployments.items():
        n = named(d)
        if n.namespace in namespaces and name in (key, n.model, n.name):
            hits.append((key, d))
    if len(hits) > 1:
        raise Ambiguous(
            f"model {name!r} names several ModelDeployments you may use ("
            + ", ".join(sorted(k for k, _ in hits))
            + "); send one of these ids (namespace/name)"
        )
    if hits:
        return hits[0][1]
    target = global_models.get(name)
    if target is not None:
        return deployments.get(target)
    return None


class NameIndex(Generic[D]):
    """:func:`resolve` in O(caller's namespaces) instead of O(deployments): the same answers
    (property-tested against :func:`resolve`), for the request path."""

    def __init__(self, deployments: Mapping[str, D], named: Callable[[D], Named]) -> None:
        self.deployments = deployments
        self._by: dict[tuple[str, str], list[str]] = {}
        for key, d in deployments.items():
            n = named(d)
            for alias in {key, n.model, n.name}:
                self._by.setdefault((n.namespace, alias), []).append(key)

    def rebind(self, deployments: Mapping[str, D]) -> None:
        """The same deployments (same keys and names) as other objects (new instances)."""
        self.deployments = deployments

    def resolve(
        self, name: str, namespaces: frozenset[str], global_models: Mapping[str, str]
    ) -> D | None:
        keys = sorted({k for ns in namespaces for k in self._by.get((ns, name), ())})
        if len(keys) > 1:
            raise Ambiguous(
                f"model {name!r} names several ModelDeployments you may use ("
                + ", ".join(keys)
                + "); send one of these ids (namespace/name)"
            )
        if keys:
            return self.deployments[keys[0]]
        target = global_models.get(name)
        return self.deployments.get(target) if target is not None else None


def visible(
    namespaces: frozenset[str],
    deployments: Mapping[str, D],
    named: Callable[[D], Named],
    global_models: Mapping[str, str],
    index: NameIndex[D] | None = None,
) -> list[tuple[str, D]]:
    """(id to list, deployment) for ``GET /v1/models``: each of the caller's deployments under
    its ``spec.model.name`` when that resolves to it for this caller (else its canonical id),
    then each global name that resolves to its claim for this caller.  Every listed id resolves
    to the deployment it is listed with.  ``index``: :class:`NameIndex` of ``deployments``."""

    def means(name: str) -> D | None:
        try:
            if index is not None:
                return index.resolve(name, namespaces, global_models)
            return resolve(name, namespaces, deployments, named, global_models)
        except Ambiguous:
            return None

    out: list[tuple[str, D]] = []
    for key, d in deployments.items():
        n = named(d)
        if n.namespace in namespaces:
            listed = next((i for i in (n.model, key) if means(i) is d), None)
            if listed is not None:
                out.append((listed, d))
    ids = {i for i, _ in out}
    for gname, target in sorted(global_models.items()):
        d = deployments.get(target)
        if d is not None and gname not in ids and means(gname) is d:
            out.append((gname, d))
    return sorted(out, key=lambda x: x[0])
