"""Which model sources a namespace may use (admission of ``spec.model.source``; pure).

A tenant is a namespace.  The node agents fetch weights with credentials every tenant shares
(the Hugging Face token, the S3 keys, the PVCs mounted into the agent pods), so the agents cannot
tell whose fetch they run: **this admission check is the control**.  The platform admin lists,
per namespace, the URI prefixes its deployments may fetch from (``--model-source NS=PREFIX``,
repeatable; Helm ``operator.modelSources``); ``*`` lists prefixes every namespace may use.
Default (no ``--model-source`` at all): ``*=hf://`` — any Hugging Face repo, no ``s3://``,
``pvc://`` or ``file://``.

A prefix matches on a boundary: ``hf://team-a-org/`` and ``hf://team-a-org`` both match
``hf://team-a-org/llama`` and neither matches ``hf://team-a-org-evil/llama``; a bare scheme
(``hf://``, ``s3://``) matches every URI of that scheme.  A deployment whose source no prefix
allows gets ``Degraded``/``SourceNotAllowed`` naming the URI and a Warning Event, and the
operator never passes that URI to an agent (no InspectModel, Prewarm or Activate with it).

Weights already in a node's store came from somewhere: a store entry fetched from a source the
namespace may not use is not served to it either (:meth:`SourcePolicy.store_refusal`), so one
tenant cannot reuse another's private weights by naming the same model without a source.
Weights copied to the nodes by hand (no recorded source) are the admin's and open to all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ALL = "*"
DEFAULT_SOURCES: tuple[tuple[str, str], ...] = ((ALL, "hf://"),)
_SCHEMES = ("hf://", "s3://", "pvc://", "file://")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class TenancyError(ValueError):
    """A tenancy setting that cannot be used; the message names the flag."""


def _prefix_ok(prefix: str) -> str:
    if not prefix.startswith(_SCHEMES):
        raise TenancyError(
            f"--model-source: prefix {prefix!r} must start with one of {', '.join(_SCHEMES)}"
        )
    if any(c.isspace() for c in prefix) or "/../" in prefix + "/" or prefix.endswith("/.."):
        raise TenancyError(f"--model-source: prefix {prefix!r} is malformed")
    return prefix


def prefix_matches(prefix: str, uri: str) -> bool:
    """``uri`` starts with ``prefix`` at a path boundary (module docstring)."""
    if not uri.startswith(prefix):
        return False
    if prefix.endswith(("/", "://")) or len(uri) == len(prefix):
        return True
    return uri[len(prefix)] in "/@"


@dataclass(frozen=True)
class SourcePolicy:
    """Allowed source prefixes per namespace (``*``: every namespace)."""

    prefixes: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: {ALL: ("hf://",)})

    @classmethod
    def parse(cls, flags: Iterable[str]) -> SourcePolicy:
        """From ``NS=PREFIX`` flags; none at all gives the default (``*=hf://``).  ``NS=`` (an
        empty prefix) names a namespace with no source of its own (e.g. ``*=`` to allow
        nothing by default)."""
        items = list(flags)
        if not items:
            items = [f"{ns}={p}" for ns, p in DEFAULT_SOURCES]
        out: dict[str, list[str]] = {}
        for item in items:
            ns, sep, prefix = item.partition("=")
            ns = ns.strip()
            if not sep or not ns:
                raise TenancyError(f"--model-source must be NAMESPACE=PREFIX, got {item!r}")
            if ns != ALL and not _NAMESPACE.match(ns):
                raise TenancyError(f"--model-source: {ns!r} is not a namespace name (or '*')")
            got = out.setdefault(ns, [])
            if prefix.strip():
                got.append(_prefix_ok(prefix.strip()))
        return cls({ns: tuple(ps) for ns, ps in out.items()})

    def allowed_prefixes(self, namespace: str) -> tuple[str, ...]:
        return (*self.prefixes.get(namespace, ()), *self.prefixes.get(ALL, ()))

    def allows(self, namespace: str, uri: str) -> bool:
        return any(prefix_matches(p, uri) for p in self.allowed_prefixes(namespace))

    def refusal(self, namespace: str, uri: str) -> str:
        """Why ``namespace`` may not fetch ``uri`` ("" when it may, or when there is no URI)."""
        if not uri or self.allows(namespace, uri):
            return ""
        allowed = ", ".join(self.allowed_prefixes(namespace)) or "none"
        return (
            f"spec.model.source {uri!r} is not allowed in namespace {namespace!r}; the platform "
            f"admin allows sources starting with: {allowed} (operator --model-source, Helm "
            "operator.modelSources)"
        )

    def store_refusal(self, namespace: str, model: str, stored_sources: Iterable[str]) -> str:
        """Why the weights of ``model`` in the nodes' stores may not serve ``namespace``: one
        of them was fetched from a source it may not use ("" when all may)."""
        for src in sorted(set(stored_sources)):
            if src and not self.allows(namespace, src):
                # The other source is not named: it may be another tenant's private bucket.
                return (
                    f"model {model!r} in the node agents' weight stores was fetched from a "
                    f"source namespace {namespace!r} may not use; serve it from an allowed "
                    "spec.model.source under another spec.model.name"
                )
        return ""
