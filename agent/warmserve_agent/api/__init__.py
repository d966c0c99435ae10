"""Generated gRPC code for the node agent API (``proto/warmserve/agent/v1``); see hack/gen-proto.sh."""
