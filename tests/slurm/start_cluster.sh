#!/usr/bin/env bash
# Start a one-node SLURM cluster on 127.0.0.1 for the `slurm`-marked tests (Debian/Ubuntu, root).
# Installs slurm-wlm + munge with apt when missing, generates a munge key when none exists, writes
# slurm.conf into the state folder and links it from /etc/slurm/slurm.conf (jobs only find the
# default path: the jobstep plugin strips SLURM_CONF), starts munged, slurmctld and slurmd in the
# background and records their PIDs for stop_cluster.sh. Exit 0 when the node is idle, non-zero
# (with a message) when SLURM cannot be installed or started: the tests then skip.
# Usage: bash tests/slurm/start_cluster.sh   (state folder: $MEMOPD_SLURM_STATE, default /tmp/memopd-slurm)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
state="${MEMOPD_SLURM_STATE:-/tmp/memopd-slurm}"
conf_link=/etc/slurm/slurm.conf
marker="# memopd one-node test cluster"

die() { echo "start_cluster: $*" >&2; exit 1; }
case "$state" in /tmp/?*|/var/tmp/?*|/run/?*) ;; *) die "state folder must lie under /tmp, /var/tmp or /run: $state" ;; esac

[ "$(id -u)" = 0 ] || die "needs root (installs packages, runs slurmd as root)"
if [ -s "$state/pids" ]; then
  bash "$here/stop_cluster.sh" >/dev/null 2>&1 || true   # a previous run left daemons: start clean
fi

# Install when missing; apt failures (no network, not Debian) end here and the tests skip.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || die "slurm-wlm/munge missing and no apt-get"
  export DEBIAN_FRONTEND=noninteractive
  { timeout 300 apt-get install -y -q slurm-wlm munge \
      || { timeout 300 apt-get update -q && timeout 300 apt-get install -y -q slurm-wlm munge; }
  } >"${TMPDIR:-/tmp}/memopd-slurm-apt.log" 2>&1 \
    || die "apt-get install slurm-wlm munge failed (see ${TMPDIR:-/tmp}/memopd-slurm-apt.log)"
fi

# Never overwrite a slurm.conf that is not ours (a machine with a real SLURM).
if [ -e "$conf_link" ] || [ -L "$conf_link" ]; then
  grep -q "^$marker" "$conf_link" 2>/dev/null || die "$conf_link exists and is not this test cluster's: refusing to replace it"
fi

rm -rf "$state"
mkdir -p "$state"/{spool/ctld,spool/d,log,munge}
chown munge:munge "$state/munge"

# munge: a key generated on the fly when the package did not leave one.
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key || die "mungekey --create failed"
  chown munge:munge /etc/munge/munge.key
  chmod 600 /etc/munge/munge.key
fi
mkdir -p /run/munge && chown munge:munge /run/munge
# setpriv execs in place (runuser would fork), so $! is munged's own PID.
setpriv --reuid=munge --regid=munge --init-groups \
  munged --foreground --pid-file="$state/munge/munged.pid" --log-file="$state/munge/munged.log" \
  --seed-file="$state/munge/munged.seed" >"$state/log/munged.out" 2>&1 &
echo "munged $!" >>"$state/pids"
for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.2; done
munge -n </dev/null | unmunge >/dev/null 2>&1 || die "munged did not come up (see $state/munge/munged.log)"

# Node and controller are "localhost": 127.0.0.1 whatever the machine's hostname resolves to.
node=localhost
cpus="$(nproc)"
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))   # RealMemory <= physical
cat >"$state/slurm.conf" <<EOF
$marker (written by tests/slurm/start_cluster.sh; removed by stop_cluster.sh)
ClusterName=memopd-test
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Bind to 127.0.0.1 (the addresses named here), not to every interface.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$state/spool/ctld
SlurmdSpoolDir=$state/spool/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: track processes by PID, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without it a plain job takes the whole node's memory.
DefMemPerCPU=500
# No slurmdbd: sacct does not work, the test polls squeue, which must keep finished jobs
# (the plugin wants MinJobAge >= 3 x its first status-check interval).
MinJobAge=3600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
mkdir -p /etc/slurm
ln -sfn "$state/slurm.conf" "$conf_link"

slurmctld -D -i -f "$conf_link" >"$state/log/slurmctld.out" 2>&1 &
echo "slurmctld $!" >>"$state/pids"
slurmd -D -N "$node" -f "$conf_link" >"$state/log/slurmd.out" 2>&1 &
echo "slurmd $!" >>"$state/pids"

# Ready when the node reports idle (a fresh cluster is within seconds).
for _ in $(seq 60); do
  st="$(sinfo -h -n "$node" -o %T 2>/dev/null || true)"
  [ "$st" = idle ] && { echo "start_cluster: one-node SLURM up on $node ($cpus CPUs, ${mem_mb} MB); state in $state"; exit 0; }
  sleep 0.5
done
echo "start_cluster: node state '${st:-none}' after 30 s; logs:" >&2
tail -n 20 "$state/log/slurmctld.log" "$state/log/slurmd.log" >&2 2>/dev/null
bash "$here/stop_cluster.sh" >&2
exit 1
