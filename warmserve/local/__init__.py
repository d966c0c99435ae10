"""The local stack behind ``warmserve up`` / ``warmserve down``.

A whole warmserve installation on one machine without containers: the real kube-apiserver +
etcd that ``hack/k8s`` builds, the Helm chart installed into it by the real ``helm``, and the
chart's pods (operator, one agent per simulated node, gateway replicas) run as local processes
with exactly the arguments, environment, mounted secrets and ServiceAccount tokens the chart
gives them (:mod:`.kubelet`).  A bundled real trace is then replayed through the gateway with
real HTTP requests (:mod:`.replay`), watched live (:mod:`.view`) and summed up in a report
(:mod:`.report`).  docs/up.md explains the design.

Modules, from the bottom up (an import-linter contract keeps the order):

* :mod:`.procs` — processes of the stack: start in their own session, PID records, stop, find
  leftovers;
* :mod:`.state` — the run directory and its ``stack.json`` (what ``warmserve down`` reads);
* :mod:`.model_mix` — the model mix, stand-in weights and ModelDeployments;
* :mod:`.workload` — the replay plan: requests and seeded load history from a trace;
* :mod:`.controlplane`, :mod:`.kubelet` — the embedded control plane and the chart's pods;
* :mod:`.replay`, :mod:`.observe` — the HTTP replay and the sampler of the cluster's state;
* :mod:`.view`, :mod:`.report` — the live terminal view and the final report;
* :mod:`.stack` — ``up`` and ``down``.

Nothing in the policy, control, runtime or simulator layers imports this package.
"""
