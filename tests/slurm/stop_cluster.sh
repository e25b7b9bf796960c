#!/usr/bin/env bash
# Stop the one-node test cluster started by start_cluster.sh: its daemons by recorded PID (slurmd,
# slurmctld, munged, in that order), and the /etc/slurm/slurm.conf link it created. Idempotent.
set -uo pipefail
state="${MEMOPD_SLURM_STATE:-/tmp/memopd-slurm}"
conf_link=/etc/slurm/slurm.conf

if [ -f "$state/pids" ]; then
  # Cancel what still runs on this cluster so no slurmstepd outlives slurmd.
  if grep -q "^# memopd one-node test cluster" "$conf_link" 2>/dev/null; then
    squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null
  fi
  # Reverse start order; a PID is only signalled while it still runs the daemon we started.
  for name in slurmd slurmctld munged; do
    pid="$(awk -v n="$name" '$1 == n {print $2}' "$state/pids" | tail -n 1)"
    [ -n "$pid" ] || continue
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || continue
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null
      echo "stop_cluster: $name ($pid) needed SIGKILL" >&2
    fi
  done
  rm -f "$state/pids"
fi
if [ -L "$conf_link" ] && [ "$(readlink "$conf_link")" = "$state/slurm.conf" ]; then
  rm -f "$conf_link"
fi
echo "stop_cluster: stopped"
