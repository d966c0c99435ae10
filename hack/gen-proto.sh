#!/usr/bin/env bash
# Generate the Python gRPC code for proto/ with grpcio-tools.
# usage: hack/gen-proto.sh [OUT_ROOT]     (default: agent/, i.e. in place)
#
# proto/warmserve/agent/v1/agent.proto is mapped to the virtual path
# warmserve_agent/api/v1/agent.proto, so the generated files land in
# agent/warmserve_agent/api/v1/ and import each other as `warmserve_agent.api.v1.agent_pb2`
# (the proto package stays warmserve.agent.v1; mapping it under `warmserve/` would collide with
# the core `warmserve` Python package).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-agent}"
py="${PYTHON:-python}"
[ -x .venv/bin/python ] && py=.venv/bin/python
mkdir -p "$out/warmserve_agent/api/v1"
"$py" -m grpc_tools.protoc \
  -Iwarmserve_agent/api/v1=proto/warmserve/agent/v1 \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  warmserve_agent/api/v1/agent.proto
