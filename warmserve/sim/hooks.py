"""How a system plugs into the simulator's event loop (no baseline code in the core).

The event loop (:mod:`warmserve.sim.core`) runs requests, engines and GPU accounting for every
system.  What differs between systems is behind this small interface:

* WarmServe and the autoscaling baselines (reactive, SLLM-GPU) are *controlled*: the loop is an
  executor of :class:`warmserve.control.Controller` decisions (:mod:`warmserve.sim.executor`),
  the same controller the operator runs.
* Systems with a fixed layout (dedicated, MuxServe) create their instances at ``setup``.
* Prism also activates instances when a request waits (``on_waiting``,
  :mod:`warmserve.sim.baselines.prism_runtime`).

A hook sees the simulation through :class:`SimAccess` only, so baselines import this module and
never the core (no import circle; an import-linter contract keeps it so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from warmserve.sim.model import SimModel, StartRecord, StaticInstance

if TYPE_CHECKING:
    from warmserve.sim.cluster import SimCluster, SimInstance


class SimAccess(Protocol):
    """What a hook may use of a running simulation."""

    cl: SimCluster
    models: list[SimModel]
    specs: dict[str, Any]
    starts: list[StartRecord]
    start_failures: int
    failure_kinds: Any

    # used by the controller's executor (warmserve.sim.executor)
    by_name: dict[str, SimModel]
    sys: Any
    instances: list[SimInstance]
    by_model: list[list[SimInstance]]
    queue: list[Any]
    inflight: list[int]
    lent_placements: int

    def cut_off(self, inst: SimInstance, t: float) -> None: ...
    def failure_kind(self, tp: int) -> str: ...
    def live(self) -> list[SimInstance]: ...
    def instances_of(self, name: str) -> list[SimInstance]: ...
    def create_static(self, s: StaticInstance) -> SimInstance: ...
    def new_instance(
        self,
        m: SimModel,
        node: str,
        gpus: tuple[int, ...],
        t: float,
        ready: float,
        full: float,
        hit: bool,
    ) -> SimInstance: ...
    def terminate(self, inst: SimInstance, t: float) -> None: ...
    def schedule_ready(self, inst: SimInstance, t: float) -> None: ...
    def sample(self, t: float) -> None: ...
    def account(self, t: float) -> None: ...


class SystemHooks:
    """Default hooks: nothing static, nothing on a waiting request, not controlled."""

    controlled = False
    activates = False  # may start models its layout left out (Prism)

    def setup(self, sim: SimAccess) -> None:
        """Create what exists at t = 0."""

    def on_waiting(self, sim: SimAccess, model: SimModel, t: float) -> None:
        """A request of ``model`` could not be assigned and waits."""


class StaticLayout(SystemHooks):
    """A fixed set of always-on instances (dedicated, MuxServe)."""

    def __init__(self, instances: list[StaticInstance], info: dict[str, Any] | None = None) -> None:
        self.instances = instances
        self.info = info or {}  # how the layout was chosen (reported with the results)

    def setup(self, sim: SimAccess) -> None:
        for s in self.instances:
            sim.create_static(s)


class Controlled(SystemHooks):
    """Instances come and go by the controller's decisions (WarmServe, reactive, SLLM-GPU)."""

    controlled = True
