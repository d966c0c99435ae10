#!/usr/bin/env bash
# One command that validates and measures everything GPU-side (the agent's CUDA path), in one go of < 10 min.
#
#   hack/gpu-check.sh                   on a machine with an NVIDIA GPU (no network needed if
#                                       .gpu-wheels/ came along): installs what this Python lacks
#                                       from the wheel list, runs the CUDA backend's contract and
#                                       property tests on GPU 0 (tests/gpu, WARMSERVE_GPU_TESTS=real),
#                                       then bench/gpu_bench.py; writes
#                                       <results-dir>/gpu-<gpu-name>.json (+ .log) and prints a table
#   hack/gpu-check.sh --dry-run         on a CPU machine (CI): checks the wheel list (sizes, sha256,
#                                       tags, requirements; downloads into a cache if needed), that
#                                       every GPU test is collected in real mode, runs the driver-level
#                                       ones against the fake driver and the bench in --dry-run mode
#   hack/gpu-check.sh --fetch-wheels    download the wheels into .gpu-wheels/ (where PyPI is reachable)
#
# Options: --wheels DIR (default .gpu-wheels)  --results-dir DIR (default bench/results)
#          --budget-s N (whole run, default 570)  --llama auto|14b|8b|1b|tiny|none (default auto:
#          8b on >= 40 GB GPUs, else 1b; 14b needs ~28 GB and a larger --budget-s)
# Environment: PYTHON (default: the project's .venv/bin/python when it exists, else python3; on GPU
#              images, the one that has torch).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
MODE=real
WHEELS=.gpu-wheels
RESULTS=bench/results
BUDGET=570
LLAMA=auto
TEST_TIMEOUT=200  # seconds for tests/gpu; the bench gets the rest of the budget
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) MODE=dry ;;
    --fetch-wheels) MODE=fetch ;;
    --wheels) WHEELS=$2; shift ;;
    --results-dir) RESULTS=$2; shift ;;
    --budget-s) BUDGET=$2; shift ;;
    --llama) LLAMA=$2; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
say() { echo "== gpu-check: $*"; }
# The first line of a command's output, read whole (no early-closing reader under pipefail).
first_line() { local out; out=$("$@" 2>/dev/null || true); printf '%s' "${out%%$'\n'*}"; }

if [ "$MODE" = fetch ]; then
  exec "$PY" hack/gpu_wheels.py check --wheels "$WHEELS" --fetch
fi

if [ "$MODE" = dry ]; then
  say "dry run (no GPU needed)"
  if ! "$PY" -c 'import pytest' 2>/dev/null; then
    echo "gpu-check: $PY has no pytest; run hack/venv.sh dev first (or set PYTHON to a Python with the dev extras)" >&2
    exit 2
  fi
  cache=$WHEELS
  [ -d "$cache" ] || cache=${XDG_CACHE_HOME:-$HOME/.cache}/warmserve/gpu-wheels
  "$PY" hack/gpu_wheels.py check --wheels "$cache" --fetch
  if [ $((TEST_TIMEOUT + 120)) -gt "$BUDGET" ]; then
    echo "gpu-check: budget $BUDGET s leaves the bench under 120 s" >&2; exit 1
  fi
  say "GPU tests collected in real mode"
  declared=$(grep -h '^def test_' tests/gpu/test_*.py | wc -l)
  collected=$(WARMSERVE_GPU_TESTS=real "$PY" -m pytest tests/gpu --collect-only -q -p no:cacheprovider \
    | grep -c '::test_' || true)
  torch_only=$(grep -l 'gpu_torch' tests/gpu/test_*.py | xargs grep -h '^def test_' | wc -l)
  echo "declared $declared, collected $collected (of which $torch_only need torch on a GPU)"
  if [ "$collected" -ne "$declared" ] || [ "$declared" -eq 0 ]; then
    echo "gpu-check: a GPU test would not run on the GPU (declared $declared, collected $collected)" >&2
    exit 1
  fi
  if grep -n 'pytest.skip\|mark.skip\|importorskip' tests/gpu/*.py; then
    echo "gpu-check: GPU tests must fail, not skip, when something is missing" >&2; exit 1
  fi
  say "driver-level GPU tests against the fake driver"
  WARMSERVE_GPU_TESTS=fake "$PY" -m pytest tests/gpu -q -p no:cacheprovider
  say "bench/gpu_bench.py --dry-run"
  "$PY" bench/gpu_bench.py --dry-run --budget-s 120
  say "dry run OK: wheels verified, $collected GPU tests collected, the fake-driver ones passed"
  exit 0
fi

# ---- on the GPU machine -----------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /dev/nvidiactl ]; then
  echo "gpu-check: no NVIDIA GPU here (no nvidia-smi, no /dev/nvidiactl); use --dry-run" >&2
  exit 2
fi
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true)
name=${gpus%%$'\n'*}
[ -n "$name" ] || name=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null || echo gpu)
slug=$(echo "$name" | tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]\+/-/g; s/^-//; s/-$//')
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu-$slug.log"
exec > >(tee "$LOG") 2>&1
say "$name; $("$PY" -V 2>&1); $(first_line nvidia-smi --query-gpu=driver_version,memory.total,memory.used --format=csv,noheader)"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | sed 's/^/other GPU process: /' || true

SITE=${TMPDIR:-/tmp}/warmserve-gpu-site
rc=0
plan=$("$PY" hack/gpu_wheels.py plan --wheels "$WHEELS") || rc=$?
if [ "$rc" -eq 2 ]; then
  echo "gpu-check: wheels missing (see above)" >&2; exit 2
fi
if [ -n "$plan" ]; then
  say "installing into $SITE: $(echo "$plan" | xargs -n1 basename | tr '\n' ' ')"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $plan
fi
export PYTHONPATH="$SITE:$ROOT:$ROOT/agent${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" -c 'import warmserve_agent.server, cuda.bindings.driver' \
  || { echo "gpu-check: the agent does not import with this Python (see above)" >&2; exit 2; }

say "tests/gpu on the device (timeout ${TEST_TIMEOUT}s)"
test_rc=0
WARMSERVE_GPU_TESTS=real timeout "$TEST_TIMEOUT" "$PY" -m pytest tests/gpu -v -p no:cacheprovider \
  -o addopts="" --timeout=150 -W ignore::DeprecationWarning || test_rc=$?

bench_left=$(( $(left) - 15 ))
say "bench/gpu_bench.py (budget ${bench_left}s)"
bench_rc=0
timeout "$bench_left" "$PY" bench/gpu_bench.py --out "$RESULTS/gpu-$slug.json" \
  --budget-s $((bench_left - 30)) --llama "$LLAMA" || bench_rc=$?
say "done in $(( $(date +%s) - START ))s: tests rc=$test_rc bench rc=$bench_rc; results in $RESULTS/gpu-$slug.json, log $LOG"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
