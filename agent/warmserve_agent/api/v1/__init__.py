"""Moved to :mod:`warmserve.api.agent.v1`; re-exported here until every importer has moved."""

from warmserve.api.agent.v1 import agent_pb2, agent_pb2_grpc  # noqa: F401
