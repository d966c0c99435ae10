"""The typed errors of the node agent's gRPC API, as both ends see them.

A refused or failed call reaches the caller as :class:`AgentError` (the gRPC status code and the
agent's message).  A refusal because the caller's leadership term is stale is a
``FAILED_PRECONDITION`` whose message starts with :data:`FENCED_PREFIX`: the agent's fence
writes it, the operator tells a deposed leader's refusal from any other precondition by it.
"""

from __future__ import annotations

import grpc

FENCED_PREFIX = "fenced:"


class AgentError(Exception):
    """A call the agent refused or could not complete (``code`` is a ``grpc.StatusCode``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
