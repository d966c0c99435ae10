#!/usr/bin/env bash
# Bring up warmserve in a local kind cluster (for people with Docker; not run in CI, which has no
# container engine — CI tests the chart against a real kube-apiserver instead, see tests/helm).
#
#   e2e/kind-up.sh            create cluster "warmserve" (1 control plane + 2 "GPU" workers),
#                             build and load the image, helm install, apply the examples
#   CLUSTER=x e2e/kind-up.sh  another cluster name;  KEEP_CLUSTER=1 reuses an existing cluster
#   e2e/kind-down.sh          delete it
#   MODELS_DIR=/path          weight store mounted on every worker at /var/lib/warmserve/models
#                             (<dir>/<model>/config.json + *.safetensors). Default: e2e/.models,
#                             filled with the tiny random models the examples name (tiny-chat,
#                             tiny-code) using the repo's venv (hack/venv.sh) and the agent
#                             tests' model writer.
#
# kind nodes have no GPUs, so the agents run with simulated GPUs (--simulate-gpus) and request no
# nvidia.com/gpu; the workers are labelled nvidia.com/gpu.present=true so the DaemonSet's default
# node selector applies unchanged. Requires: docker (or podman), kind, kubectl, helm.
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-warmserve}
NAMESPACE=${NAMESPACE:-warmserve}
IMAGE=${IMAGE:-warmserve:dev}
SIM_GPUS=${SIM_GPUS:-8x80GiB}
MODELS_DIR=${MODELS_DIR:-e2e/.models}

for tool in kind kubectl helm docker; do
  command -v "$tool" >/dev/null || { echo "kind-up.sh: '$tool' is required but not on PATH" >&2; exit 1; }
done
step() { printf '\n== %s\n' "$*"; }

if [ "$MODELS_DIR" = e2e/.models ] && [ ! -f e2e/.models/tiny-chat/config.json ]; then
  step "writing tiny test models into e2e/.models"
  [ -x .venv/bin/python ] || { echo "kind-up.sh: no .venv; run hack/venv.sh dev first (or set MODELS_DIR)" >&2; exit 1; }
  .venv/bin/python - <<'PY'
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("agent_test_models", "tests/agent/conftest.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
slow = {"decode_tok_s": 20.0, "max_batch": 8, "kv_bytes_per_token": 256}
for seed, name in enumerate(("tiny-chat", "tiny-code"), start=1):
    mod.write_model(Path("e2e/.models"), name, layers=4, hidden=64, seed=seed, profile=slow)
PY
fi
MODELS_ABS=$(cd "$MODELS_DIR" && pwd)

clusters=$(kind get clusters 2>/dev/null || true)
if printf '%s\n' "$clusters" | grep -qx -- "$CLUSTER"; then
  [ "${KEEP_CLUSTER:-0}" = 1 ] || { echo "kind-up.sh: cluster '$CLUSTER' exists (KEEP_CLUSTER=1 to reuse, or e2e/kind-down.sh)" >&2; exit 1; }
  step "reusing kind cluster $CLUSTER"
else
  step "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" --wait 120s --config - <<KIND
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
    labels: {nvidia.com/gpu.present: "true"}
    extraMounts: [{hostPath: "$MODELS_ABS", containerPath: /var/lib/warmserve/models, readOnly: true}]
  - role: worker
    labels: {nvidia.com/gpu.present: "true"}
    extraMounts: [{hostPath: "$MODELS_ABS", containerPath: /var/lib/warmserve/models, readOnly: true}]
KIND
fi
CTX="kind-$CLUSTER"

step "building $IMAGE and loading it into the nodes"
docker build -f e2e/Dockerfile -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

step "helm upgrade --install warmserve (namespace $NAMESPACE)"
helm upgrade --install warmserve helm/warmserve --kube-context "$CTX" \
  --namespace "$NAMESPACE" --create-namespace \
  -f e2e/kind-values.yaml \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --set agent.simulateGpus="$SIM_GPUS" \
  --wait --timeout 5m
kubectl --context "$CTX" -n "$NAMESPACE" rollout status deploy -l app.kubernetes.io/component=operator --timeout=120s
kubectl --context "$CTX" -n "$NAMESPACE" rollout status ds -l app.kubernetes.io/component=agent --timeout=120s
kubectl --context "$CTX" -n "$NAMESPACE" rollout status deploy -l app.kubernetes.io/component=gateway --timeout=120s

step "applying the example ModelDeployments"
EXAMPLES=()
for d in examples crds/examples warmserve/data/examples; do
  [ -d "$d" ] || continue
  while IFS= read -r f; do EXAMPLES+=("$f"); done < <(grep -l '^kind: ModelDeployment' "$d"/*.yaml 2>/dev/null || true)
done
if [ ${#EXAMPLES[@]} -eq 0 ]; then
  echo "kind-up.sh: no ModelDeployment examples found" >&2; exit 1
fi
for f in "${EXAMPLES[@]}"; do kubectl --context "$CTX" -n "$NAMESPACE" apply -f "$f"; done

step "state"
kubectl --context "$CTX" get gpunodes,modeldeployments -A -o wide || true
kubectl --context "$CTX" -n "$NAMESPACE" get pods -o wide
echo
echo "warmserve is up in kind cluster '$CLUSTER' (context $CTX). Try:"
echo "  kubectl --context $CTX -n $NAMESPACE logs deploy/warmserve-operator -f"
echo "  kubectl config use-context $CTX && warmserve status"
echo "  kubectl --context $CTX -n $NAMESPACE port-forward svc/warmserve-gateway 8000:80 &"
echo "  curl -s localhost:8000/v1/models"
echo "Tear down with: CLUSTER=$CLUSTER e2e/kind-down.sh"
