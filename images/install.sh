#!/usr/bin/env bash
# Install warmserve's wheel into a fresh virtual environment, with every dependency pinned by the
# image's constraints file. The Dockerfiles run exactly this; so does the CI check
# (tests/test_images.py), which installs the operator flavor for real and resolves the CUDA
# agent flavor for its target platform (--resolve-only: metadata only, no GBs of wheels).
#
# usage: images/install.sh FLAVOR VENV WHEEL_DIR [--resolve-only]
#   FLAVOR  operator    warmserve[s3]                      (operator, gateway, CLI; CPU agent)
#           agent-cuda  warmserve[s3] + vLLM + cuda-python (the agent on CUDA GPU nodes)
set -euo pipefail
flavor=${1:?usage: install.sh FLAVOR VENV WHEEL_DIR [--resolve-only]}
venv=${2:?VENV}
wheels=${3:?WHEEL_DIR}
mode=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
constraints="$here/constraints-$flavor.txt"
[ -f "$constraints" ] || { echo "install.sh: unknown flavor $flavor (no $constraints)" >&2; exit 2; }
whl=$(ls "$wheels"/warmserve-*.whl)
reqs=("$whl[s3]")
if [ "$flavor" = agent-cuda ]; then
  reqs+=(-r "$here/requirements-agent-cuda.txt")
fi
if [ "$mode" = --resolve-only ]; then
  # The image's platform: CPython of the CUDA base image, glibc of Ubuntu 24.04.
  py=$(sed -n 's/^# python: //p' "$constraints")
  plats=()
  for v in 39 38 37 36 35 34 33 32 31 30 29 28 27 26 25 24 23 22 21 20 19 18 17 12 5; do
    plats+=(--platform "manylinux_2_${v}_x86_64")
  done
  plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
  # The pinned pip (older ones check Requires-Python against the running interpreter).
  python3 -m venv "$venv/resolver"
  "$venv/resolver/bin/pip" install --quiet "pip==$(sed -n 's/^pip==//p' "$constraints")"
  "$venv/resolver/bin/pip" install --quiet --dry-run --ignore-installed --only-binary=:all: \
    --implementation cp --python-version "$py" "${plats[@]}" --target "$venv/resolve-target" \
    --constraint "$constraints" "${reqs[@]}"
  echo "resolved $flavor for CPython $py under $constraints"
  exit 0
fi
python3 -m venv "$venv"
# (pip's cache: the Dockerfiles' build stage is thrown away; CI reuses its cache.)
"$venv/bin/pip" install --quiet --upgrade "pip==$(sed -n 's/^pip==//p' "$constraints")"
"$venv/bin/pip" install --quiet --constraint "$constraints" "${reqs[@]}"
# Smoke: the entry points and every component import (and `operator` is still the stdlib one).
"$venv/bin/warmserve" --version
"$venv/bin/python" - <<'PY'
import importlib, operator
assert operator.__file__ and "site-packages" not in operator.__file__, operator.__file__
for m in ("warmserve.cli", "warmserve_operator.reconciler", "warmserve_agent.server",
          "warmserve_gateway",
          "warmserve_agent.sources.hf", "warmserve_agent.sources.s3", "boto3", "huggingface_hub"):
    importlib.import_module(m)
PY
