"""Moved to :mod:`warmserve.api.history`; re-exported here until every importer has moved."""

from warmserve.api.history import *  # noqa: F403
