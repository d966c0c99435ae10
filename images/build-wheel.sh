#!/usr/bin/env bash
# Build warmserve's wheel (pure Python: operator, agent, gateway, CLI) into OUT_DIR.
# The Dockerfiles run exactly this; so does the CI check (tests/test_images.py).
# usage: images/build-wheel.sh OUT_DIR
set -euo pipefail
out=${1:?usage: images/build-wheel.sh OUT_DIR}
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
mkdir -p "$out"
"$py" -m pip wheel --quiet --no-deps --wheel-dir "$out" .
whl=$(ls "$out"/warmserve-*.whl)
# The wheel must carry every package and its data (the layout maps operator/ and agent/).
"$py" - "$whl" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["warmserve/cli/__init__.py", "warmserve_operator/reconciler.py",
        "warmserve_agent/server.py", "warmserve_agent/sources/fetcher.py",
        "warmserve/api/agent/v1/agent_pb2.py", "warmserve_gateway/__init__.py"]
missing = [n for n in need if n not in names]
data = [n for n in names if n.startswith("warmserve/data/traces/") and n.endswith(".csv.gz")]
if missing or not data or any(n.startswith("operator/") for n in names):
    sys.exit(f"bad wheel {sys.argv[1]}: missing {missing}, traces {len(data)}")
PY
echo "$whl"
