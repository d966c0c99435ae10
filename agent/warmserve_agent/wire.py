"""Moved to :mod:`warmserve.api.agent.wire`; re-exported here until every importer has moved."""

from warmserve.api.agent.errors import FENCED_PREFIX  # noqa: F401
from warmserve.api.agent.wire import *  # noqa: F403
