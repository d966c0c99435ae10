#!/usr/bin/env bash
# Delete the kind cluster created by e2e/kind-up.sh (CLUSTER defaults to "warmserve").
set -euo pipefail
CLUSTER=${CLUSTER:-warmserve}
command -v kind >/dev/null || { echo "kind-down.sh: 'kind' is required but not on PATH" >&2; exit 1; }
kind delete cluster --name "$CLUSTER"
