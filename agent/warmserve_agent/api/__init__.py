"""Generated gRPC code for the node agent API (``proto/warmserve/agent/v1``).

Regenerate with hack/gen-proto.sh."""
