"""Moved to :mod:`warmserve.api.agent.client`; re-exported here until every importer has moved."""

from warmserve.api.agent.client import *  # noqa: F403
