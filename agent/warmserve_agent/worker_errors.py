"""Errors that cross the worker pipe: a typed, versioned record, re-raised as the same type.

A command that fails in a GPU worker process (:mod:`~warmserve_agent.worker`) answers
``(Reply.ERR, record)``, where the record is :class:`WorkerFault` written as a plain dict
(:meth:`WorkerFault.to_wire`): the error's :class:`ErrorKind`, its message, the name of the
exception class raised and the fields of that kind (the tensors whose bytes were wrong).  The
agent reads it back (:meth:`WorkerFault.from_wire`) and raises the exception of that kind
(:meth:`WorkerFault.exception`): an engine's :class:`~warmserve_agent.engine.WeightsMismatch` in
a worker is a ``WeightsMismatch`` in the agent, with its tensors, so nothing on the agent's side
tells errors apart by their message.  A record of another version, or one it cannot read, is a
:class:`WorkerError` naming what arrived (a worker started from another install of warmserve).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from warmserve_agent.engine import (
    EngineError,
    WeightsError,
    WeightsMismatch,
    WeightVerificationError,
)

PIPE_VERSION = 1  # of the error record; a change of its fields or kinds raises it


class WorkerError(RuntimeError):
    """A worker refused a command or died; the message says which and why."""


class Reply(StrEnum):
    """The first element of every answer on the worker pipe."""

    OK = "ok"  # (Reply.OK, result)
    ERR = "err"  # (Reply.ERR, WorkerFault.to_wire())


class ErrorKind(StrEnum):
    """What failed in the worker; each kind is re-raised as one exception type."""

    WEIGHTS_MISMATCH = "weights_mismatch"  # layers announced resident differ from the store
    WEIGHT_VERIFICATION = "weight_verification"  # the slot's bytes differ at engine start
    ENGINE = "engine"  # an engine could not start or serve
    WORKER = "worker"  # the worker refused the command (no engine, no memory backend, ...)
    UNEXPECTED = "unexpected"  # any other exception: a bug or a library's error


# Most specific first: WeightsMismatch and WeightVerificationError are EngineErrors.
_KIND_OF: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (WeightsMismatch, ErrorKind.WEIGHTS_MISMATCH),
    (WeightVerificationError, ErrorKind.WEIGHT_VERIFICATION),
    (EngineError, ErrorKind.ENGINE),
    (WorkerError, ErrorKind.WORKER),
)


@dataclass(frozen=True, slots=True)
class WorkerFault:
    """An exception raised in a worker, as it crosses the pipe (see module docstring)."""

    kind: ErrorKind
    message: str  # str() of the exception in the worker
    exc_type: str  # its class name, kept for the message and the logs
    tensors: tuple[str, ...] = ()  # the weight kinds: tensors whose bytes differ
    version: int = PIPE_VERSION

    @classmethod
    def of(cls, exc: BaseException) -> WorkerFault:
        kind = next((k for t, k in _KIND_OF if isinstance(exc, t)), ErrorKind.UNEXPECTED)
        tensors = exc.tensors if isinstance(exc, WeightsError) else ()
        return cls(kind, str(exc), type(exc).__name__, tensors)

    def to_wire(self) -> dict[str, Any]:
        """Plain values only: a worker and an agent of different versions still read it."""
        return {
            "version": self.version,
            "kind": self.kind.value,
            "message": self.message,
            "exc_type": self.exc_type,
            "tensors": list(self.tensors),
        }

    @classmethod
    def from_wire(cls, record: object) -> WorkerFault:
        """The record a worker sent; :class:`WorkerError` when it is not one this agent reads."""
        if not isinstance(record, dict):  # an earlier worker sent its error as text
            raise WorkerError(
                f"the worker answered an error this agent cannot read ({str(record)[:500]}): "
                "it runs another install of warmserve; restart it"
            )
        if record.get("version") != PIPE_VERSION:
            raise WorkerError(
                f"the worker answered an error record of version {record.get('version')!r}, "
                f"this agent reads version {PIPE_VERSION}: it runs another install of "
                "warmserve; restart it"
            )
        try:
            return cls(
                ErrorKind(record["kind"]),
                str(record["message"]),
                str(record["exc_type"]),
                tuple(str(t) for t in record.get("tensors", ())),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise WorkerError(f"the worker answered an unreadable error record: {exc}") from None

    def exception(self, context: str) -> Exception:
        """The exception to raise in the agent: the same type, ``context`` (which worker, which
        command) before the worker's message."""
        text = f"{context}: {self.exc_type}: {self.message}"
        if self.kind is ErrorKind.WEIGHTS_MISMATCH:
            return WeightsMismatch(text, tensors=self.tensors)
        if self.kind is ErrorKind.WEIGHT_VERIFICATION:
            return WeightVerificationError(text, tensors=self.tensors)
        if self.kind is ErrorKind.ENGINE:
            return EngineError(text)
        return WorkerError(text)
