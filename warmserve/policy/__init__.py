"""warmserve's policy core: pure, deterministic decisions shared by the operator and the simulator.

Modules (each cites the WarmServe paper section it implements):
- ``cluster``    — the typed snapshot every function takes and returns.
- ``load``       — per-window average / peak load from request-level traces or count series.
- ``predictor``  — the load predictors' registry and ``forecast`` (§5.1); beside it ``seasonal``
  (CSP, Eq. 2-4, and simple baselines), ``holt_winters``, ``warm_predictor`` (our default),
  ``peak_forecast`` (coverage-oriented peak) and ``forecast_quality`` (metrics).
- ``scoring``    — prewarm replica counts and scores (Eq. 5-8).
- ``placement``  — evict-aware nested placement (Algorithm 1) and instance start choice.
- ``autoscaler`` — instances needed with hysteresis, grace periods.
- ``proactive``  — grace-period reservation target and lendable memory (Eq. 1).

Nothing here performs I/O or imports Kubernetes, gRPC or HTTP libraries (an import-linter
contract in ``pyproject.toml`` enforces it).
"""
