#!/usr/bin/env bash
# Set up from a fresh clone and run warmserve's main job on its built-in defaults:
# evaluate the load predictors on a bundled real week-long trace, then plan prewarm replicas for
# the example cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== preparing .venv (hack/venv.sh: the first run downloads the dependencies; later runs take ~20 s)"
hack/venv.sh
. .venv/bin/activate
echo "== warmserve predict --compare (Azure multimodal LLM trace, 1 week, 5-minute windows; progress on stderr)"
warmserve predict azure_lmm_2025_multimodal_1week_per_minute.csv.gz --compare
echo
echo "== warmserve plan (example cluster: 2 nodes x 8 GPUs, 4 models)"
warmserve plan warmserve/data/examples/cluster.json
