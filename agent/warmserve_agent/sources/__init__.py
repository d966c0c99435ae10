"""Model sources: where an agent fetches a model its weight store lacks (``spec.model.source``).

One protocol (:class:`~warmserve_agent.sources.base.ModelSource`) and a registry by URI scheme:

========  =========================================  ========================================
scheme    module                                      fills the store by
========  =========================================  ========================================
``hf``    :mod:`~warmserve_agent.sources.hf`          download (huggingface_hub), checksums
``s3``    :mod:`~warmserve_agent.sources.s3`          download (boto3), size/MD5/SHA-256
``pvc``   :mod:`~warmserve_agent.sources.local`       link to the mounted claim
``file``  :mod:`~warmserve_agent.sources.local`       link to an allowed node directory
========  =========================================  ========================================

The URI grammar is :mod:`warmserve.modelref` (shared with the CRD's CEL rules); the fetcher
(:mod:`~warmserve_agent.sources.fetcher`) does everything else the same way for every scheme.
A new scheme: a class with the protocol's four methods, ``REGISTRY.register("x", factory)``,
and a branch in :func:`warmserve.modelref.parse_source` plus the CRD's CEL rule.
"""

from __future__ import annotations

from warmserve.modelref import SourceURIError, parse_source
from warmserve_agent.sources.base import (
    Listing,
    ModelFacts,
    ModelSource,
    Registry,
    RemoteFile,
    SourceError,
    SourceSettings,
    inspect,
)
from warmserve_agent.sources.hf import HfSource
from warmserve_agent.sources.local import file_source, pvc_source
from warmserve_agent.sources.s3 import S3Source

__all__ = [
    "REGISTRY",
    "Listing",
    "ModelFacts",
    "ModelSource",
    "RemoteFile",
    "SourceError",
    "SourceSettings",
    "inspect",
    "open_source",
]

REGISTRY = Registry()
REGISTRY.register("hf", HfSource)  # type: ignore[arg-type]
REGISTRY.register("s3", S3Source)  # type: ignore[arg-type]
REGISTRY.register("pvc", pvc_source)  # type: ignore[arg-type]
REGISTRY.register("file", file_source)  # type: ignore[arg-type]


def open_source(uri: str, settings: SourceSettings, registry: Registry = REGISTRY) -> ModelSource:
    """The source for ``uri`` (SourceError for a malformed URI or an unknown scheme)."""
    try:
        ref = parse_source(uri)
    except SourceURIError as exc:
        raise SourceError(str(exc)) from None
    factory = registry.factories.get(ref.scheme)
    if factory is None:
        raise SourceError(f"no model source is registered for {ref.scheme}:// on this agent")
    return factory(ref, settings, uri)
