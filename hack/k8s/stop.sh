#!/usr/bin/env bash
# Stop a control plane started by hack/k8s/start.sh WORKDIR: TERM each recorded PID (only if that
# PID still runs the expected binary), KILL after 10 s, then delete etcd's throwaway data dir.
# Idempotent. usage: hack/k8s/stop.sh WORKDIR
set -uo pipefail
W=${1:?usage: stop.sh WORKDIR}
[ -d "$W" ] || exit 0
for c in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
  f="$W/$c.pid"
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  cmdline=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null || true)
  if [ -n "$pid" ] && [[ "$cmdline" == *"/$c "* ]]; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$f"
done
if [ -f "$W/etcd.datadir" ]; then
  d=$(cat "$W/etcd.datadir")
  case "$d" in /dev/shm/k8s-etcd.*|/dev/shm/warmserve-etcd.*|"$W"/etcd-data) rm -rf "$d" ;; esac
  rm -f "$W/etcd.datadir"
fi
exit 0
