#!/usr/bin/env bash
# A throw-away Slurm cluster on this machine: N compute nodes on the network namespaces of
# scripts/netns_cluster.sh, for the Slurm tests (Slurm and MUNGE from Debian's packages).
#
#   scripts/slurm_cluster.sh up 2      # node1, node2 (netns hosts) running slurmd; slurmctld here
#   SLURM_CONF=/tmp/hvdtrain-slurm/slurm.conf sbatch ...   # what `up` prints
#   scripts/slurm_cluster.sh down      # stops the daemons, then the netns hosts
#
# slurmctld runs in the root namespace on the bridge address (198.18.0.254); one slurmd per node runs
# inside that node's network namespace, in a UTS namespace named nodeI, with:
# - proctrack/linuxproc and task/none (no cgroup plugins), yet slurmd 22.05 reads the cgroup mounts
#   when it starts: `ip netns exec` remounts /sys, so each node mounts the cgroup v1 hierarchies again
#   under a fresh tmpfs at /sys/fs/cgroup (name=systemd included; a cgroup2 mount is refused there as
#   "hybrid mode");
# - its own PMIx directory (mpi.conf's PMIxCliTmpDirBase on a tmpfs mounted in that node only): the
#   nodes share /tmp, and PMIx's per-job directories would collide.
# Nodes claim 8 CPUs each (SlurmdParameters=config_overrides): the tests oversubscribe 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${HVDTRAIN_SLURM_DIR:-/tmp/hvdtrain-slurm}
CONF=$DIR/slurm.conf
PMIX_DIR=/tmp/hvdtrain-slurm-pmix
CPUS=8

die() { echo "slurm_cluster: $*" >&2; exit 1; }
log() { echo "slurm_cluster: $*" >&2; }

ensure_slurm() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm munge (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm munge libpmix2 >/dev/null
  fi
}

start_munge() {
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
  chmod 400 /etc/munge/munge.key
  if ! munge -n >/dev/null 2>&1; then
    munged --force 2>/dev/null || munged
    for _ in $(seq 50); do munge -n >/dev/null 2>&1 && return 0; sleep 0.1; done
    die "munged does not answer"
  fi
}

write_conf() {
  local n=$1
  mkdir -p "$DIR/state" "$DIR/spool"
  {
    echo "ClusterName=hvdtrain"
    echo "SlurmctldHost=$(hostname)(198.18.0.254)"
    echo "MailProg=/bin/true"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    # a requeued job waits this long before it starts again (120 s by default): the preemption test requeues
    echo "AuthInfo=cred_expire=30"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/slurmctld.log"
    echo "SlurmdLogFile=$DIR/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "JobRequeue=1"
    echo "KillWait=30"
    echo "MpiDefault=none"
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=30"
    for i in $(seq 1 "$n"); do
      echo "NodeName=node$i NodeAddr=198.18.0.$i CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=hvdtrain Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$CONF"
  echo "PMIxCliTmpDirBase=$PMIX_DIR" > "$DIR/mpi.conf"
  echo "CgroupPlugin=cgroup/v1" > "$DIR/cgroup.conf"
}

start_node() {  # slurmd for node $1, in its network namespace, hostname nodeI, its own mounts
  local node=$1
  ip netns exec "$node" unshare --uts sh -c "
    hostname $node
    mount -t tmpfs cgroup_root /sys/fs/cgroup
    for c in cpu cpuacct cpuset memory devices freezer blkio pids; do
      mkdir -p /sys/fs/cgroup/\$c && mount -t cgroup -o \$c cgroup /sys/fs/cgroup/\$c
    done
    mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd
    mkdir -p $PMIX_DIR && mount -t tmpfs pmix $PMIX_DIR
    exec slurmd -f $CONF -N $node
  "
}

up() {
  local n=${1:?usage: scripts/slurm_cluster.sh up N}
  down_daemons
  ensure_slurm
  bash scripts/netns_cluster.sh up "$n"
  start_munge
  write_conf "$n"
  slurmctld -f "$CONF"
  for i in $(seq 1 "$n"); do start_node "node$i"; done
  for _ in $(seq 120); do
    if [ "$(SLURM_CONF=$CONF sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" -eq "$n" ]; then
      log "up: $n nodes idle; use SLURM_CONF=$CONF"
      echo "$CONF"
      return 0
    fi
    sleep 0.5
  done
  SLURM_CONF=$CONF sinfo -N -l >&2 || true
  tail -5 "$DIR"/slurmd-*.log "$DIR/slurmctld.log" >&2 || true
  die "the nodes did not come up"
}

down_daemons() {
  pkill -f "slurmd -f $CONF" 2>/dev/null || true
  pkill -f "slurmctld -f $CONF" 2>/dev/null || true
  for _ in $(seq 50); do pgrep -f "slurm(ctl)?d -f $CONF" >/dev/null || break; sleep 0.1; done
  pkill -9 -f "slurm(ctl)?d -f $CONF" 2>/dev/null || true
  pkill -9 -f slurmstepd 2>/dev/null || true
  rm -rf "$DIR"
}

case "${1:-}" in
  up) up "${2:-}" ;;
  down) down_daemons; bash scripts/netns_cluster.sh down ;;
  *) die "usage: scripts/slurm_cluster.sh up N | down" ;;
esac
