#!/usr/bin/env bash
# Regenerate the wrapper modules after changing a version in versions.env, then review and commit
# hack/k8s/{go.mod,go.sum} and hack/k8s/{helm,kwok}/{go.mod,go.sum}.
#
# k8s.io/kubernetes requires its ~33 staging modules (k8s.io/api, k8s.io/apiserver, ...) at v0.0.0
# and maps them to ./staging with replace directives, which Go ignores in dependencies. So the
# wrapper repeats one replace per staging module, pointing at its published v0.<minor>.<patch> tag.
# The list is generated from the go.mod of the exact Kubernetes version, never hard-coded.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/versions.env"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
STAGING="v0.${K8S_VERSION#1.}"
GOMOD=$(cd "$HERE" && go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
GOVER=$(awk '$1=="go"{print $2; exit}' "$GOMOD")
{
  printf '%s\n' \
    "// Wrapper module that builds the Kubernetes control plane, etcd and kubectl from the Go module" \
    "// proxy. k8s.io/kubernetes requires its staging modules at v0.0.0 and maps them with local" \
    "// replaces that do not apply to consumers, so every staging module is routed to its published" \
    "// tag here. Regenerate with hack/k8s/gen-gomod.sh when bumping K8S_VERSION in versions.env."
  printf 'module warmserve.local/k8sbin\n\ngo %s\n\ngodebug default=go%s\n\nrequire k8s.io/kubernetes v%s\n\nreplace (\n' \
    "$GOVER" "${GOVER%.*}" "$K8S_VERSION"
  grep -E '=>[[:space:]]+\./staging/src/' "$GOMOD" \
    | sed -E 's/^[[:space:]]*(replace[[:space:]]+)?([^[:space:]]+).*/\2/' | sort -u \
    | awk -v v="$STAGING" '{print "\t" $1 " => " $1 " " v}'
  printf ')\n'
} > "$HERE/go.mod"
(cd "$HERE" && go mod tidy)
printf '// Wrapper module pinning the helm CLI (built by hack/k8s/build.sh); see hack/k8s/versions.env.\nmodule warmserve.local/helmbin\n\ngo 1.26.0\n\nrequire helm.sh/helm/v3 %s\n' \
  "$HELM_VERSION" > "$HERE/helm/go.mod"
(cd "$HERE/helm" && go mod tidy)
printf '// Wrapper module pinning kwok (optional, built by hack/k8s/build.sh --with-controllers).\nmodule warmserve.local/kwokbin\n\ngo 1.26.0\n\nrequire sigs.k8s.io/kwok %s\n' \
  "$KWOK_VERSION" > "$HERE/kwok/go.mod"
(cd "$HERE/kwok" && go mod tidy)
grep -q "go.etcd.io/etcd/server/v3 v$ETCD_VERSION" "$HERE/go.mod" \
  || echo "gen-gomod.sh: NOTE: etcd server in go.mod is not v$ETCD_VERSION; update ETCD_VERSION in versions.env" >&2
echo "regenerated; review with: git diff hack/k8s"
