#!/usr/bin/env bash
# Build or preview the documentation site (mkdocs.yml over docs/, MkDocs + Material).
#
# usage: hack/docs/site.sh build [-d DIR]    strict build (a broken link, anchor or nav entry fails
#                                            it); DIR defaults to site/
#        hack/docs/site.sh serve [ARGS...]   live preview on http://127.0.0.1:8000 (mkdocs serve)
#        hack/docs/site.sh python            print the docs venv's python (installs it if needed)
#
# MkDocs runs from its own venv, pinned by docs/requirements.txt, in
# ${WARMSERVE_DOCS_CACHE:-$HOME/.cache/warmserve-docs}/<key>/venv, where <key> hashes the pins and
# the Python version: every worktree on a machine reuses it, a pin change never does. The build
# needs no network once that venv exists (no fonts or plug-ins fetch anything). Safe to run
# concurrently (a lock serialises installers). Progress goes to stderr.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
log() { printf '[docs %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { printf '[docs] ERROR: %s\n' "$*" >&2; exit 1; }

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  build|serve|python) ;;
  -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
  *) die "usage: hack/docs/site.sh build [-d DIR] | serve [ARGS...] | python (see --help)" ;;
esac

PY=${PYTHON:-python3}
REQS="$ROOT/docs/requirements.txt"
KEY=$( { "$PY" -c 'import sys; print(sys.version)'; cat "$REQS"; } | sha256sum | cut -c1-12)
DEST="${WARMSERVE_DOCS_CACHE:-$HOME/.cache/warmserve-docs}/$KEY"
VPY="$DEST/venv/bin/python"
if [ ! -e "$DEST/.complete" ]; then
  mkdir -p "$DEST"
  exec 9>"$DEST/.lock"
  log "taking the install lock $DEST/.lock"
  flock 9
  if [ ! -e "$DEST/.complete" ]; then
    t0=$(date +%s)
    log "installing docs/requirements.txt into $DEST/venv"
    rm -rf "$DEST/venv"
    "$PY" -m venv "$DEST/venv"
    "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps -r "$REQS" >&2
    "$VPY" -m pip check >&2 || die "docs/requirements.txt is not a complete, consistent set"
    touch "$DEST/.complete"
    log "installed in $(( $(date +%s) - t0 )) s"
  fi
  exec 9>&-
fi

# Material announces its successor on every run; the build log should show only the build.
export NO_MKDOCS_2_WARNING=1
cd "$ROOT"
case "$cmd" in
  python) echo "$VPY" ;;
  build) exec "$VPY" -m mkdocs build --strict "$@" ;;
  serve) exec "$VPY" -m mkdocs serve "$@" ;;
esac
