"""Helpers that tests and benchmarks share: a real control plane (``k8s``), supervised child
processes (``procs``), warmserve as the Helm chart wires it, as local processes (``stack``),
the operator with in-process agent stand-ins (``fake_operator``), a real OpenTelemetry
Collector and the spans it received (``otel``), and the test server binaries ``hack/testbin``
builds (``testbin``).

Nothing of the product imports this package (an import-linter contract keeps it so); it needs a
source checkout where it starts the control plane or reads the chart.
"""
