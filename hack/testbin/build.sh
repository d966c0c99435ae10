#!/usr/bin/env bash
# Build (or reuse) a real server the tests run against, from the Go module proxy at the version
# pinned (with every module hash) in hack/testbin/<name>/go.{mod,sum}:
#
#   prometheus  Prometheus server (tags remove_all_sd: service discovery plug-ins left out; the
#               tests use static targets) - the dashboard test queries every panel through it
#   versitygw   Versity S3 Gateway (posix backend) - the S3-compatible server of the s3:// tests
#   otelcol     a minimal OpenTelemetry Collector (OTLP receiver + file exporter; main.go in
#               hack/testbin/otelcol) - the tracing tests' OTLP receiver
#
# usage: hack/testbin/build.sh NAME [NAME...]     hack/testbin/build.sh --print-versions
# Binaries land in ${WARMSERVE_TESTBIN_CACHE:-$HOME/.cache/warmserve-testbin}/<name>-<key>/, where
# <key> hashes the wrapper module, so a version bump never reuses an old binary; the repo gets a
# symlink .testbin/<name> to it (what the tests run). stdout: for each NAME one line, the directory
# holding the binary. Progress goes to stderr. Idempotent; safe to run concurrently (a lock per
# binary serialises builders). Fails loudly.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD_REV=1   # bump when the build flags below change

log() { printf '[testbin %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { printf '[testbin] ERROR: %s\n' "$*" >&2; exit 1; }

version_of() { awk -v m="$2" '$1==m {print $2; exit} $1=="require" && $2==m {print $3; exit}' "$HERE/$1/go.mod"; }

if [ "${1:-}" = "--print-versions" ]; then
  printf 'prometheus %s\nversitygw %s\notelcol %s\n' \
    "$(version_of prometheus github.com/prometheus/prometheus)" \
    "$(version_of versitygw github.com/versity/versitygw)" \
    "$(version_of otelcol go.opentelemetry.io/collector/otelcol)"
  exit 0
fi
[ $# -ge 1 ] || die "usage: build.sh NAME [NAME...] (prometheus, versitygw, otelcol)"
command -v go >/dev/null || die "go is not on PATH (Go >= 1.26 builds the test servers)"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
CACHE=${WARMSERVE_TESTBIN_CACHE:-$HOME/.cache/warmserve-testbin}

for name in "$@"; do
  case "$name" in
    prometheus)
      pkg=github.com/prometheus/prometheus/cmd/prometheus
      v=$(version_of prometheus github.com/prometheus/prometheus)
      # Module v0.3XX.Y is Prometheus 3.XX.Y; stamp it so `prometheus --version` tells.
      semver=$(echo "$v" | sed -E 's/^v0\.3([0-9]+)\.([0-9]+).*/3.\1.\2/')
      tags=remove_all_sd
      ldflags="-s -w -X github.com/prometheus/common/version.Version=$semver"
      ;;
    versitygw)
      pkg=github.com/versity/versitygw/cmd/versitygw
      tags=""
      ldflags="-s -w"
      ;;
    otelcol)
      # The wrapper module's own main package (main.go): only the components the tests use.
      pkg=.
      tags=""
      ldflags="-s -w -X main.version=$(version_of otelcol go.opentelemetry.io/collector/otelcol)"
      ;;
    *) die "unknown test server '$name' (prometheus, versitygw, otelcol)" ;;
  esac
  # The key hashes the pins, and a wrapper's own main.go where it has one (otelcol).
  main_go=()
  [ -f "$HERE/$name/main.go" ] && main_go=("$HERE/$name/main.go")
  key=$( { echo "$BUILD_REV"; cat "$HERE/$name/go.mod" "$HERE/$name/go.sum" "${main_go[@]}"; } \
    | sha256sum | cut -c1-12)
  dest="$CACHE/$name-$key"
  link() {
    mkdir -p "$ROOT/.testbin"
    ln -sfn "$dest/$name" "$ROOT/.testbin/.$name.tmp" && mv -T "$ROOT/.testbin/.$name.tmp" "$ROOT/.testbin/$name"
    echo "$dest"
  }
  if [ -x "$dest/$name" ]; then
    log "$name: cached in $dest"
    link
    continue
  fi
  mkdir -p "$dest"
  exec 9>"$dest/.lock"
  log "$name: taking the build lock $dest/.lock"
  flock 9
  if [ ! -x "$dest/$name" ]; then
    t0=$(date +%s)
    log "$name: building $pkg (first build downloads modules; minutes)"
    (cd "$HERE/$name" && go build -trimpath ${tags:+-tags "$tags"} -ldflags "$ldflags" \
        -o "$dest/.$name.tmp" "$pkg") || die "$name: go build $pkg failed (see above)"
    mv -f "$dest/.$name.tmp" "$dest/$name"
    log "$name: built in $(( $(date +%s) - t0 ))s"
  fi
  exec 9>&-
  link
done
