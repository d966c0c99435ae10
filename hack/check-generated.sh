#!/usr/bin/env bash
# CI drift check: regenerate the gRPC code into a temp dir and diff it with the committed files.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
hack/gen-proto.sh "$tmp" >/dev/null
status=0
for f in agent_pb2.py agent_pb2.pyi agent_pb2_grpc.py; do
  if ! diff -u "agent/warmserve_agent/api/v1/$f" "$tmp/warmserve_agent/api/v1/$f"; then
    status=1
  fi
done
if [ "$status" -ne 0 ]; then
  echo "generated code is out of date with proto/: run hack/gen-proto.sh and commit" >&2
fi
exit "$status"
