"""The control layer: one loop's decisions, shared by every executor (decide once, execute twice).

``warmserve.policy`` answers single questions (forecast a window, plan prewarm replicas, choose
where to start, how many instances).  This package owns what a *loop* around those answers
needs, once, so that the operator, the simulator and the gateway's start trigger run the same
rules and only differ in how they observe the cluster and how they act:

* :mod:`.observation` — raw facts an executor reports (GPUs, slots, instances, held requests);
* :mod:`.snapshot` — the one rule turning facts into the policy's ``ClusterState`` (free bytes
  per worker state, Eq. 1 per GPU, worker states, replica identities) and applying a start;
* :mod:`.demand` — the one definition of a model's load;
* :mod:`.history` — per-window load history (the predictor's input);
* :mod:`.decisions` — typed decisions (``Start``, ``Drain``, ``EndGrace``, ``Prewarm``,
  ``Evict``);
* :mod:`.config` — :class:`~.config.ControlConfig`, the loop's rules;
* :mod:`.tracking` — what the controller remembers between calls: managed models, window
  clock, load history, forecasts, grace clocks, lost instances;
* :mod:`.controller` — the :class:`~.controller.Controller`: re-plan triggers and ``decide``
  (autoscaler, fairness, reclaim, Algorithm 1), over :mod:`.tracking`.

Pure like the policy core (import-linter contract): no Kubernetes, gRPC, HTTP or file I/O, no
clock of its own (time is passed in), deterministic.  The rules chosen and why are in
``docs/policy.md`` ("The control loop").
"""
