#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install warmserve into it.
# usage: hack/venv.sh [EXTRAS]      e.g. hack/venv.sh dev
# Prints nothing but pip's progress; safe to run repeatedly (pip skips what is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/python -m pip install --quiet -e "$spec"
