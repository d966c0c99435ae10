#!/usr/bin/env bash
# Start a real, local Kubernetes control plane (etcd + kube-apiserver, envtest-style) on loopback.
#
# usage: hack/k8s/start.sh WORKDIR [--etcd-port N] [--api-port N] [--with-controllers]
#                                  [--watch-pid PID]
#   WORKDIR             created if missing; gets pki/, kubeconfig, *.log, *.pid
#   --etcd-port/--api-port  default: free ports picked at random (etcd also uses etcd-port+1 for peers)
#   --with-controllers  also run kube-controller-manager (namespace deletion, GC, default
#                       ServiceAccounts, Deployments -> Pods), kube-scheduler and kwok (fake
#                       kubelets for Nodes annotated kwok.x-k8s.io/node=fake: Pods "run")
#   --watch-pid PID     stop everything when process PID exits (the pytest fixture passes its own
#                       PID, so a killed test run leaves nothing behind)
# Binaries: $WARMSERVE_K8S_BIN if set, else hack/k8s/build.sh (cached after the first build).
# stdout: the admin kubeconfig path. Stop with hack/k8s/stop.sh WORKDIR.
#
# What does NOT happen without --with-controllers (no kube-controller-manager, no kubelet): namespace
# deletion stays Terminating, ownerReference GC, Deployments/DaemonSets never create Pods, no default
# ServiceAccount per namespace (so the ServiceAccount admission plugin is disabled). Pods never run
# here in any mode: there is no kubelet.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)

W=${1:?usage: start.sh WORKDIR [--etcd-port N] [--api-port N] [--with-controllers] [--watch-pid PID]}
shift
EP="" AP="" CONTROLLERS=0 WATCH=""
while [ $# -gt 0 ]; do
  case "$1" in
    --etcd-port) EP=$2; shift 2 ;;
    --api-port) AP=$2; shift 2 ;;
    --with-controllers) CONTROLLERS=1; shift ;;
    --watch-pid) WATCH=$2; shift 2 ;;
    *) echo "start.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done

die() { echo "start.sh: ERROR: $*" >&2; exit 1; }

if [ -n "${WARMSERVE_K8S_BIN:-}" ] && [ -x "$WARMSERVE_K8S_BIN/kube-apiserver" ]; then
  B=$WARMSERVE_K8S_BIN
else
  if [ "$CONTROLLERS" = 1 ]; then B=$("$HERE/build.sh" --with-controllers); else B=$("$HERE/build.sh"); fi
fi
for c in etcd kube-apiserver; do [ -x "$B/$c" ] || die "$B/$c missing (run hack/k8s/build.sh)"; done
if [ "$CONTROLLERS" = 1 ]; then
  for c in kube-controller-manager kube-scheduler; do
    [ -x "$B/$c" ] || die "$B/$c missing (run hack/k8s/build.sh --with-controllers)"
  done
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# etcd needs two consecutive ports (client, peer); retry until both are free.
port_free() { python3 -c 'import socket,sys; s=socket.socket(); s.bind(("127.0.0.1",int(sys.argv[1])))' "$1" 2>/dev/null; }
if [ -z "$EP" ]; then
  for _ in $(seq 20); do EP=$(free_port); [ "$EP" -lt 65535 ] && port_free $((EP+1)) && break; done
fi
[ -n "$AP" ] || AP=$(free_port)

mkdir -p "$W"
W=$(cd "$W" && pwd)
PKI=$W/pki
[ -f "$PKI/sa.key" ] || "$HERE/mkcerts.sh" "$PKI"

# etcd's data is throwaway: keep it in RAM when /dev/shm exists (etcd 3.6 also skips fsync).
# Not named warmserve-*: node agents remove unlocked warmserve-* directories in /dev/shm at start
# (dead agents' simulated GPU memory), which once deleted running etcds' data.
if [ -d /dev/shm ] && [ -w /dev/shm ]; then DATA=$(mktemp -d /dev/shm/k8s-etcd.XXXXXX)
else DATA=$W/etcd-data; mkdir -p "$DATA"; fi
echo "$DATA" > "$W/etcd.datadir"

"$B/etcd" --data-dir "$DATA" --name test --unsafe-no-fsync \
  --listen-client-urls "http://127.0.0.1:$EP" --advertise-client-urls "http://127.0.0.1:$EP" \
  --listen-peer-urls "http://127.0.0.1:$((EP+1))" --initial-advertise-peer-urls "http://127.0.0.1:$((EP+1))" \
  --initial-cluster "test=http://127.0.0.1:$((EP+1))" --listen-metrics-urls "" \
  > "$W/etcd.log" 2>&1 &
echo $! > "$W/etcd.pid"

ok=0
for _ in $(seq 300); do
  if curl -sf "http://127.0.0.1:$EP/health" >/dev/null 2>&1; then ok=1; break; fi
  kill -0 "$(cat "$W/etcd.pid")" 2>/dev/null || break
  sleep 0.1
done
[ "$ok" = 1 ] || { tail -20 "$W/etcd.log" >&2; "$HERE/stop.sh" "$W"; die "etcd did not become healthy on port $EP"; }

# Flags follow controller-runtime's envtest (see hack/k8s/README.md): loopback advertise address
# (no default route needed), no endpoint reconciler (it rejects loopback endpoints), RBAC on, and
# a ServiceAccount signing key so TokenRequest works without kube-controller-manager.
"$B/kube-apiserver" --etcd-servers="http://127.0.0.1:$EP" \
  --bind-address=127.0.0.1 --secure-port="$AP" --advertise-address=127.0.0.1 \
  --endpoint-reconciler-type=none \
  --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
  --client-ca-file="$PKI/ca.crt" \
  --service-account-issuer="https://127.0.0.1:$AP" \
  --service-account-key-file="$PKI/sa.key" --service-account-signing-key-file="$PKI/sa.key" \
  --service-cluster-ip-range=10.0.0.0/24 \
  --authorization-mode=RBAC \
  --disable-admission-plugins=ServiceAccount \
  --allow-privileged=true --profiling=false --cert-dir="$W/certdir" \
  > "$W/kube-apiserver.log" 2>&1 &
echo $! > "$W/kube-apiserver.pid"

cat > "$W/kubeconfig" <<K
apiVersion: v1
kind: Config
clusters:
- name: warmserve-test
  cluster: {server: "https://127.0.0.1:$AP", certificate-authority: "$PKI/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$PKI/admin.crt", client-key: "$PKI/admin.key"}
contexts:
- name: warmserve-test
  context: {cluster: warmserve-test, user: admin, namespace: default}
current-context: warmserve-test
K
chmod 600 "$W/kubeconfig"
printf 'ETCD_PORT=%s\nAPI_PORT=%s\nSERVER=https://127.0.0.1:%s\nBIN=%s\n' "$EP" "$AP" "$AP" "$B" > "$W/env"

ok=0
for _ in $(seq 1200); do   # up to ~2 minutes on a loaded machine
  if curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
      "https://127.0.0.1:$AP/readyz" >/dev/null 2>&1; then ok=1; break; fi
  kill -0 "$(cat "$W/kube-apiserver.pid")" 2>/dev/null || break
  sleep 0.1
done
[ "$ok" = 1 ] || { tail -30 "$W/kube-apiserver.log" >&2; "$HERE/stop.sh" "$W"; die "kube-apiserver did not become ready on port $AP"; }

if [ "$CONTROLLERS" = 1 ]; then
  "$B/kube-controller-manager" --kubeconfig="$W/kubeconfig" --leader-elect=false \
    --bind-address=127.0.0.1 --secure-port=0 \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --use-service-account-credentials=false --controllers='*' \
    > "$W/kube-controller-manager.log" 2>&1 &
  echo $! > "$W/kube-controller-manager.pid"
  "$B/kube-scheduler" --kubeconfig="$W/kubeconfig" --leader-elect=false \
    --bind-address=127.0.0.1 --secure-port=0 > "$W/kube-scheduler.log" 2>&1 &
  echo $! > "$W/kube-scheduler.pid"
  # kwok fakes kubelets: it heartbeats Nodes annotated kwok.x-k8s.io/node=fake and moves Pods
  # bound to them to Running (containers never run). Create such Nodes to schedule onto.
  if [ -x "$B/kwok" ] && [ -s "$B/kwok-stages.yaml" ]; then
    "$B/kwok" --kubeconfig="$W/kubeconfig" --config="$B/kwok-stages.yaml" \
      --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
      --manage-nodes-with-label-selector= --manage-single-node= \
      --cidr=10.0.0.1/24 --node-ip=10.0.0.1 --node-lease-duration-seconds=40 \
      > "$W/kwok.log" 2>&1 &
    echo $! > "$W/kwok.pid"
  fi
fi

if [ -n "$WATCH" ]; then
  # Watchdog: a detached loop that stops the control plane once the watched process is gone.
  nohup bash -c 'while kill -0 "$1" 2>/dev/null && [ -f "$2/kube-apiserver.pid" ]; do sleep 2; done; "$3/stop.sh" "$2"' \
    _ "$WATCH" "$W" "$HERE" > "$W/watchdog.log" 2>&1 &
  echo $! > "$W/watchdog.pid"
fi
echo "$W/kubeconfig"
