#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for trying scripts/slurm/train.sbatch without a
# cluster and for tests/e2e/test_slurm.py (which starts one when none is up, and stops it).
#
#   scripts/slurm/local_cluster.sh install|start|status|stop
#
#   install  apt-get update, then apt-get install of slurmctld, slurmd, slurm-client and munge, when
#            any of them is missing (8 packages, 3.5 MB).
#   start    install, then munged (unless one already answers), slurm.conf in SLURM_LOCAL_DIR
#            (default /tmp/dsv3-slurm), slurmctld and one slurmd per node: nodes n1 and n2, both on
#            127.0.0.1, in the partition `debug`; returns once both nodes are idle and prints
#            `export SLURM_CONF=...`, which the client commands (sbatch, squeue, scancel) need.
#   status   prints that line and exits 0 when this folder's cluster answers, else exits 1.
#   stop     SIGTERM to the daemons `start` started (by PID) and waits until they have exited, so
#            that their ports are free for the next start.
#
# Needs root (the daemons run as root, munged as munge) and, on a machine without Slurm, apt-get.
# No systemd: the daemons run in the foreground mode (-D) as background jobs of their own session.
# Written from ../shared/design/slurm-local.md (Debian bookworm's Slurm 22.05, built with
# MULTIPLE_SLURMD, so two slurmd share a host). Mistakes print one line and exit 2.
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/dsv3-slurm}"
export SLURM_CONF="$DIR/slurm.conf"
NODES=(n1 n2)
PACKAGES=(slurmctld slurmd slurm-client munge)
START_TIMEOUT=60
STOP_TIMEOUT=30

fail() {  # EXIT_CODE MESSAGE
  printf 'local_cluster.sh: %s\n' "$2" >&2
  exit "$1"
}

install_packages() {
  local missing=() package
  for package in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'ok installed' || missing+=("$package")
  done
  (( ${#missing[@]} )) || return 0
  (( EUID == 0 )) || fail 2 "Slurm is not installed (missing: ${missing[*]}) and installing it needs root"
  command -v apt-get >/dev/null || fail 2 "Slurm is not installed (missing: ${missing[*]}) and there is no apt-get to install it: install ${PACKAGES[*]} with this system's package manager"
  local log="$DIR/apt.log"
  mkdir -p "$DIR"
  # Once per install: a fresh machine's package lists are empty, an image's may name files the
  # mirror no longer has.
  apt-get update >"$log" 2>&1 || { tail -n 20 "$log" >&2; fail 1 "apt-get update failed (log above)"; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >>"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; fail 1 "apt-get install ${missing[*]} failed (log above)"; }
}

answers() {  # whether this folder's slurmctld is up
  [[ -f "$SLURM_CONF" ]] && scontrol ping 2>/dev/null | grep -q 'is UP'
}

# Started daemons are recorded as `NAME PID` lines: stop signals exactly these processes, and only
# while /proc still names the PID after the daemon (a PID can be reused after a reboot).
record() {  # NAME PID
  printf '%s %s\n' "$1" "$2" >>"$DIR/started"
}

alive() {  # NAME PID: running (a zombie has exited and freed its ports)
  local stat
  stat="$(cat "/proc/$2/stat" 2>/dev/null)" || return 1
  [[ "$stat" == "$2 ($1) "[^Z]* ]]
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0  # a munged of this machine answers already: share it, leave it running at stop
  fi
  # The package creates the key but not munged's socket folder (no systemd to make it).
  install -d -o munge -g munge -m 755 /run/munge
  # As the munge user, so munged needs no --force to accept its files' owners.
  runuser -u munge -- munged
  local pid_file=/run/munge/munged.pid waited
  for ((waited = 0; waited < 50; waited++)); do
    if [[ -s "$pid_file" ]] && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
      record munged "$(<"$pid_file")"
      return 0
    fi
    sleep 0.1
  done
  fail 1 "munged did not start (munge -n | unmunge fails)"
}

write_conf() {
  local host cpus node port=6818
  host="$(hostname -s)"
  cpus="$(nproc)"
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/jobcomp.txt"
  mkdir -p "$DIR/state"
  cat >"$SLURM_CONF" <<CONF
# Written by scripts/slurm/local_cluster.sh: two emulated nodes on this one host.
ClusterName=dsv3local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
# No cgroups here: processes are tracked by parent PID and no limits are enforced.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Each emulated node claims all of this host's CPUs; without config_overrides a node claiming
# more CPUs than its share of the hardware is drained.
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
# No slurmdbd (sacct does not work): finished jobs are one line each in jobcomp.txt, and
# scontrol show job answers for 10 minutes after a job ends.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
MinJobAge=600
# Slurm's default, stated because train.sbatch relies on it: after scancel's SIGTERM the workers
# have this long to save before SIGKILL.
KillWait=30
CONF
  for node in "${NODES[@]}"; do
    mkdir -p "$DIR/spool/$node"
    printf 'NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 Port=%d CPUs=%d State=UNKNOWN\n' \
      "$node" "$host" "$port" "$cpus" >>"$SLURM_CONF"
    port=$((port + 1))
  done
  printf 'PartitionName=debug Nodes=%s Default=YES MaxTime=INFINITE State=UP\n' \
    "$(IFS=,; echo "${NODES[*]}")" >>"$SLURM_CONF"
}

start() {
  if answers; then
    printf 'local_cluster.sh: already running (%s)\nexport SLURM_CONF=%s\n' "$DIR" "$SLURM_CONF"
    return 0
  fi
  (( EUID == 0 )) || fail 2 "starting the Slurm daemons needs root"
  install_packages
  [[ ! -s "$DIR/started" ]] || stop  # daemons of a start whose cluster no longer answers
  mkdir -p "$DIR"
  start_munge
  write_conf
  # -D: foreground, so the PID is the daemon's; setsid: out of the caller's session and process
  # group, so that a Ctrl-C meant for the caller does not reach them. -c: clean state (job ids
  # restart at 1).
  setsid slurmctld -D -c -i </dev/null >"$DIR/slurmctld.out" 2>&1 &
  record slurmctld $!
  local node
  for node in "${NODES[@]}"; do
    setsid slurmd -D -N "$node" </dev/null >"$DIR/slurmd-$node.out" 2>&1 &
    record slurmd $!
  done
  local deadline=$((SECONDS + START_TIMEOUT)) name pid
  until answers && [[ "$(sinfo -h -t idle -o %D 2>/dev/null)" == "${#NODES[@]}" ]]; do
    while read -r name pid; do
      alive "$name" "$pid" && continue
      tail -n 20 "$DIR/$name"*.out "$DIR/$name"*.log >&2 2>/dev/null || true
      stop
      fail 1 "$name (PID $pid) exited during start-up (its log above; another Slurm on ports 6817-6819?)"
    done <"$DIR/started"
    if (( SECONDS >= deadline )); then
      sinfo >&2 || true
      stop
      fail 1 "the nodes were not idle within $START_TIMEOUT s (logs in $DIR)"
    fi
    sleep 0.2
  done
  printf 'local_cluster.sh: %d nodes idle (%s)\nexport SLURM_CONF=%s\n' "${#NODES[@]}" "$DIR" "$SLURM_CONF"
}

status() {
  answers || return 1
  printf 'export SLURM_CONF=%s\n' "$SLURM_CONF"
}

terminate() {  # NAME...: SIGTERM to the recorded daemons of these names, then wait for their exit
  local name pid left deadline=$((SECONDS + STOP_TIMEOUT))
  while read -r name pid; do
    [[ " $* " == *" $name "* ]] && alive "$name" "$pid" && kill -TERM "$pid" 2>/dev/null || true
  done <"$DIR/started"
  while :; do
    left=()
    while read -r name pid; do
      [[ " $* " == *" $name "* ]] && alive "$name" "$pid" && left+=("$name $pid")
    done <"$DIR/started"
    (( ${#left[@]} )) || return 0
    (( SECONDS < deadline )) || fail 1 "still running $STOP_TIMEOUT s after SIGTERM: ${left[*]}"
    sleep 0.2
  done
}

stop() {
  [[ -s "$DIR/started" ]] || return 0
  # The Slurm daemons first: they talk to each other through munged to the end.
  terminate slurmd slurmctld
  terminate munged
  rm -f "$DIR/started"
}

case "${1:-}" in
  install) install_packages ;;
  start) start ;;
  status) status ;;
  stop) stop ;;
  *) fail 2 "usage: local_cluster.sh install|start|status|stop (got '${1:-}')" ;;
esac
