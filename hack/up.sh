#!/usr/bin/env bash
# From a fresh clone: set up .venv (hack/venv.sh) and run `warmserve up` — a local warmserve
# cluster on the real kube-apiserver + etcd of hack/k8s (built from the Go module proxy and
# cached on the first run, with progress), replaying a real trace through the gateway, with a
# live view and a report. Arguments go to `warmserve up` (see `.venv/bin/warmserve up --help`),
# e.g. `./hack/up.sh --compare reactive`. Stop the cluster with `.venv/bin/warmserve down`.
# Needs Python 3.11 and Go (only for the first build of the control plane).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== preparing .venv (hack/venv.sh: the first run downloads the dependencies)"
hack/venv.sh
exec .venv/bin/warmserve up "$@"
