"""Trace-driven discrete-event simulator of a multi-LLM GPU cluster (docs/simulator.md).

The simulator drives the *same* policy code the operator runs (``warmserve.policy``: load
measurement, prediction, scoring, evict-aware placement, autoscaling, proactive lending) and
compares WarmServe with the systems a user would otherwise pick, each a configuration of one
simulator (:mod:`warmserve.sim.systems`).

Entry points: :func:`warmserve.sim.scenario.load_scenario` and :func:`warmserve.sim.core.run`
(or ``warmserve simulate SCENARIO.yaml``).  H3b's physics lives in ``hardware.py``/``engine.py``
and the MuxServe/Prism baselines in ``baselines/``.
"""
