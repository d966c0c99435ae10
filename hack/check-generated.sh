#!/usr/bin/env bash
# CI drift check: regenerate the gRPC code into a temp dir and diff it with the committed files,
# and the Grafana dashboard JSON from hack/gen-dashboard.py.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
hack/gen-proto.sh "$tmp" >/dev/null
status=0
for f in agent_pb2.py agent_pb2.pyi agent_pb2_grpc.py; do
  if ! diff -u "warmserve/api/agent/v1/$f" "$tmp/warmserve/api/agent/v1/$f"; then
    status=1
  fi
done
if [ "$status" -ne 0 ]; then
  echo "generated code is out of date with proto/: run hack/gen-proto.sh and commit" >&2
fi
# The chart's Grafana dashboard is generated from hack/gen-dashboard.py's panel table.
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
"$py" hack/gen-dashboard.py --check || status=1
exit "$status"
