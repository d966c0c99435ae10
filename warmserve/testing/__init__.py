"""Helpers that tests and benchmarks share: a real control plane (``k8s``), supervised child
processes (``procs``), warmserve as the Helm chart wires it, as local processes (``stack``), a
real OpenTelemetry Collector and the spans it received (``otel``), and the test server binaries
``hack/testbin`` builds (``testbin``).  The operator with in-process agent stand-ins is the
operator's own (``python -m warmserve_operator.testing``).

Nothing of the product imports this package (an import-linter contract keeps it so); it needs a
source checkout where it starts the control plane or reads the chart.
"""
