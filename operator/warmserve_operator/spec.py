"""Moved: the CRD types are :mod:`warmserve.api.crd`, the policy's model of a deployment is
:mod:`.model_spec`.  Re-exported here until every importer has moved."""

from warmserve.api.crd import *  # noqa: F403
from warmserve.api.crd import _get  # noqa: F401

from .model_spec import DEFAULT_LOAD_BANDWIDTH, CatalogEntry, resolve_model  # noqa: F401
