"""The event loop's state, declared once for its parts (for the compiled simulator).

:class:`warmserve.sim.core.Simulation` is assembled from parts
(:class:`~warmserve.sim.request_queues.RequestQueues`, :class:`~warmserve.sim.batching.Batching`,
:class:`~warmserve.sim.lifecycle.Lifecycle`) that read and write state the event loop owns and
call each other's methods.  This base declares that state and those methods with their types, so
that the type checker, and mypyc when the simulator is compiled (:mod:`warmserve.sim.compiled`),
know them in every part: compiled, the parts are mypyc *traits* and their attribute reads and
method calls are native.

Nothing here runs: the attributes are annotations only (``Simulation.__init__`` sets them) and
every method below is defined again by a part that comes first in ``Simulation``'s method
resolution order, so the bodies are never reached (pure Python and compiled alike).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from mypy_extensions import trait

from warmserve.sim.cluster import Req, SimInstance

if TYPE_CHECKING:
    from warmserve.control.controller import Controller
    from warmserve.sim.cluster import SimCluster
    from warmserve.sim.executor import ControlExecutor
    from warmserve.sim.hooks import SystemHooks
    from warmserve.sim.model import SimModel
    from warmserve.sim.stats import ModelStats
    from warmserve.sim.systems import SystemConfig


@trait
class SimState:
    """What the parts of the event loop share (module docstring)."""

    sys: SystemConfig
    hooks: SystemHooks
    models: list[SimModel]
    names: list[str]
    by_name: dict[str, SimModel]
    timers: list[object]
    cl: SimCluster
    controller: Controller | None
    executor: ControlExecutor | None
    record: bool
    recorded: list[Req]
    issued: int
    done: int
    stats: list[ModelStats]
    queue_timeout: float
    heap: list[tuple[float, int, int, object, int]]
    seq: int
    iid: int
    instances: list[SimInstance]
    by_model: list[list[SimInstance]]
    queue: list[deque[Req]]
    inflight: list[int]
    held: int
    t_now: float
    lent_evictions: int

    # defined by the event loop (warmserve.sim.core)
    def push(self, t: float, kind: int, obj: object = None, ver: int = 0) -> None:
        raise NotImplementedError

    def account(self, t: float) -> None:
        raise NotImplementedError

    def sample(self, t: float) -> None:
        raise NotImplementedError

    # defined by the request queues (warmserve.sim.request_queues)
    def _set_inflight(self, midx: int, t: float, delta: int) -> None:
        raise NotImplementedError

    def _drop(self, r: Req, reason: str, issued: bool = False) -> None:
        raise NotImplementedError

    def _dispatch(self, midx: int, t: float) -> None:
        raise NotImplementedError

    # defined by the engines' physics (warmserve.sim.batching)
    def _requests_of(self, inst: SimInstance) -> list[Req]:
        raise NotImplementedError

    def _retime_peers(self, inst: SimInstance, t: float) -> None:
        raise NotImplementedError

    def _start_prefill(self, inst: SimInstance, t: float) -> None:
        raise NotImplementedError

    def _reschedule(self, inst: SimInstance, t: float) -> None:
        raise NotImplementedError

    # defined by the instance lifecycle (warmserve.sim.lifecycle)
    def _check_lent(self, inst: SimInstance, t: float) -> None:
        raise NotImplementedError
