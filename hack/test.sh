#!/usr/bin/env bash
# Run every check CI runs: lint (ruff), layering (import-linter), generated-code drift, and the
# whole pytest suite including the tests against a real kube-apiserver + etcd (built once from
# the Go module proxy and cached under .k8s-cache/).
set -euo pipefail
cd "$(dirname "$0")/.."
hack/venv.sh dev
. .venv/bin/activate
echo "== ruff"
ruff check .
echo "== import-linter"
lint-imports
if [ -x hack/check-generated.sh ]; then
  echo "== generated code matches proto/"
  hack/check-generated.sh
fi
if [ -x hack/k8s/build.sh ]; then
  echo "== real control plane binaries"
  hack/k8s/build.sh
  export WARMSERVE_K8S_BIN="$PWD/.k8s-cache/bin"
fi
echo "== pytest"
python -m pytest "$@"
