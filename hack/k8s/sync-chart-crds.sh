#!/usr/bin/env bash
# Copy the CRDs (single source: crds/*.yaml) into the Helm chart (helm/warmserve/crds/).
# Copies rather than a symlink: helm warns on symlinks and would also pick up anything else that
# appears under crds/ (e.g. examples). tests/helm fails when the copies drift; run this to fix.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p helm/warmserve/crds
rm -f helm/warmserve/crds/*.yaml
cp crds/*.yaml helm/warmserve/crds/
ls helm/warmserve/crds
