"""What the operator needs to know about models no node holds yet (``spec.model.source``).

Placement needs a model's weight bytes and layers.  For a model in some node's weight store the
agents report them (Describe).  For a model that is only at its source, :class:`SourceCatalog`
asks one reachable agent (``InspectModel``: config.json and safetensors headers, no download)
and caches the answer per (model, source).  A failure is kept with its message (the deployment's
``Degraded`` condition says why) and retried after ``retry_s``.

The fetch itself is the agent's: the operator only passes ``source`` with ``Prewarm`` and
``Activate`` (see :mod:`.reconciler`), and posts an Event when a fetch starts and ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from warmserve.api.crd import ModelDeploymentSpec

from .agents import AgentPort
from .model_spec import CatalogEntry
from .snapshot import AgentCallError, FetchView

log = logging.getLogger("warmserve.operator.sources")


@dataclass
class _Known:
    at: float
    entry: CatalogEntry | None
    error: str = ""


class SourceCatalog:
    def __init__(
        self, clock: Callable[[], float], *, retry_s: float = 30.0, timeout_s: float = 10.0
    ):
        self.clock = clock
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self._known: dict[tuple[str, str], _Known] = {}

    async def refresh(
        self,
        owners: Mapping[str, ModelDeploymentSpec],
        catalog: Mapping[str, CatalogEntry],
        agents: Iterable[AgentPort],
    ) -> None:
        """Inspect every sourced model that no store holds and the spec does not size."""
        clients = list(agents)
        now = self.clock()
        for model, md in owners.items():
            if not md.source or model in catalog or (md.weight_bytes and md.num_layers):
                continue
            key = (model, md.source)
            k = self._known.get(key)
            if k is not None and (k.entry is not None or now - k.at < self.retry_s):
                continue
            errors = []
            for client in clients:
                try:
                    entry = await asyncio.wait_for(
                        client.inspect_model(model, md.source), self.timeout_s
                    )
                except AgentCallError as exc:
                    errors.append(exc.message)
                    if exc.code in ("FAILED_PRECONDITION", "NOT_FOUND", "INVALID_ARGUMENT"):
                        break  # the same answer on every agent
                    continue
                except (TimeoutError, OSError) as exc:
                    errors.append(f"agent did not answer: {exc!r}")
                    continue
                self._known[key] = _Known(now, entry)
                log.info(
                    "event=source_inspected model=%s source=%s weight_bytes=%d layers=%d",
                    model,
                    md.source,
                    entry.weight_bytes,
                    entry.num_layers,
                )
                break
            else:
                if not clients:
                    errors.append("no agent is reachable to read it")
            if key not in self._known or self._known[key].entry is None:
                msg = errors[0] if errors else "unknown error"
                self._known[key] = _Known(now, None, msg)
                log.warning("event=source_inspect_failed model=%s error=%r", model, msg)
        live = {(m, md.source) for m, md in owners.items()}
        for key in list(self._known):
            if key not in live:
                del self._known[key]

    def entries(self) -> dict[str, CatalogEntry]:
        return {m: k.entry for (m, _), k in self._known.items() if k.entry is not None}

    def error(self, md: ModelDeploymentSpec) -> str:
        k = self._known.get((md.model, md.source))
        return k.error if k is not None and k.entry is None else ""


def fetch_event(f: FetchView, node: str, first: bool) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event for a fetch progress message, or None.

    Only a fetch's start (``first`` message of a Prewarm stream) and end are Events; the bytes
    and ETA in between are in the GPUNode status and ``warmserve status``.
    """
    if f.state == "done":
        return "Normal", "Fetched", f"node {node} fetched {f.model} from {f.source}"
    if f.state == "failed":
        return "Warning", "FetchFailed", f"node {node} could not fetch {f.model}: {f.message}"
    if first:
        size = f" ({f.bytes_total / 1024**3:.2f} GiB)" if f.bytes_total else ""
        return "Normal", "Fetching", f"node {node} is fetching {f.model} from {f.source}{size}"
    return None
