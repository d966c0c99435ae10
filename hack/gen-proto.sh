#!/usr/bin/env bash
# Generate the Python gRPC code for proto/ with grpcio-tools.
# usage: hack/gen-proto.sh [OUT_ROOT]     (default: the repository root, i.e. in place)
#
# proto/warmserve/agent/v1/agent.proto is mapped to the virtual path
# warmserve/api/agent/v1/agent.proto, so the generated files land in warmserve/api/agent/v1/ (the
# API package every component shares) and import each other as
# `warmserve.api.agent.v1.agent_pb2`.  The proto package, and so every name on the wire, stays
# warmserve.agent.v1.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
py="${PYTHON:-python}"
[ -x .venv/bin/python ] && py=.venv/bin/python
mkdir -p "$out/warmserve/api/agent/v1"
"$py" -m grpc_tools.protoc \
  -Iwarmserve/api/agent/v1=proto/warmserve/agent/v1 \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  warmserve/api/agent/v1/agent.proto
