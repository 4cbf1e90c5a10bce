#!/usr/bin/env bash
# Train a DeepSeek-V3 model.
#
#   ./run_train.sh [--section.key value ...]
#
# Environment:
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml in this repository)
#   NGPU         processes per node (default: the visible GPUs, or 1 CPU process when there are none)
#   LOG_RANK     comma-separated local ranks whose output is shown (default 0)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node jobs (c10d rendezvous; MASTER_PORT
#                default 29500). One node picks a free port unless MASTER_PORT is set.
#   RDZV_TIMEOUT seconds the nodes may take to meet (default 600)
#   RESTARTS     times torchrun restarts every worker after one fails (default 0); a restarted
#                worker resumes from the newest complete checkpoint (needs --checkpoint.enable)
# Fault-tolerant replica groups ([fault_tolerance], docs/fault_tolerance.md): one run of this script
# is one group (--fault_tolerance.replica_id); the torchft lighthouse runs beside, started once with
#   torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000
# Every argument is passed to `python -m trainer.train`, so CLI overrides work as usual:
#   ./run_train.sh --training.steps 50 --training.compile
# The environment, the config, the layout (against NNODES x NGPU) and the dump folder are checked
# before any process starts; a mistake prints one `config error: ...` line and exits with code 2,
# as does any user mistake a worker finds (one `[rankN] ...` line per failing rank).
# SIGTERM, SIGINT (Ctrl-C) and SIGHUP stop the run: the workers save the step they are in, and
# the script exits 0 once they have; a second Ctrl-C aborts at once. When the script dies by a
# signal it cannot catch (SIGKILL), torchrun and the workers die with it, without saving.
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_FILE="${CONFIG_FILE:-$REPO_DIR/train_configs/debug_model.toml}"
if [[ ! -f "$CONFIG_FILE" && -f "$REPO_DIR/$CONFIG_FILE" ]]; then
  CONFIG_FILE="$REPO_DIR/$CONFIG_FILE"
fi

config_error() {
  printf 'config error: %s\n' "$1" >&2
  exit 2
}
# Environment values are checked before any arithmetic reads them (bash would take NGPU=two for a
# variable name and stop with "unbound variable").
check_integer() {  # NAME VALUE MIN MAX WHAT
  if [[ ! "$2" =~ ^[0-9]+$ ]] || (( 10#$2 < $3 || 10#$2 > $4 )); then
    config_error "$1=$2: $5"
  fi
}

if [[ -z "${NGPU:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
      NGPU=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
    fi
  else
    NGPU=0
  fi
  [[ "$NGPU" -ge 1 ]] || NGPU=1
fi
check_integer NGPU "$NGPU" 1 4096 "processes per node must be a positive integer, e.g. NGPU=2"
NNODES="${NNODES:-1}"
check_integer NNODES "$NNODES" 1 100000 "the number of nodes must be a positive integer, e.g. NNODES=2"
NODE_RANK="${NODE_RANK:-0}"
check_integer NODE_RANK "$NODE_RANK" 0 $((NNODES - 1)) "this node's rank must be one of 0..$((NNODES - 1)) (NNODES=$NNODES)"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
if [[ -n "${MASTER_PORT:-}" ]]; then
  check_integer MASTER_PORT "$MASTER_PORT" 1 65535 "the rendezvous port must be an integer in 1..65535, or unset MASTER_PORT for a free one"
fi
RDZV_TIMEOUT="${RDZV_TIMEOUT:-600}"
check_integer RDZV_TIMEOUT "$RDZV_TIMEOUT" 1 86400 "seconds the nodes may take to meet must be a positive integer"
RESTARTS="${RESTARTS:-0}"
check_integer RESTARTS "$RESTARTS" 0 1000 "the times torchrun restarts the workers after one fails must be an integer 0..1000, e.g. RESTARTS=3"
LOG_RANK="${LOG_RANK:-0}"
IFS=, read -r -a log_ranks <<<"$LOG_RANK"
for rank in "${log_ranks[@]}"; do
  if [[ ! "$rank" =~ ^[0-9]+$ ]] || (( 10#$rank >= NGPU )); then
    config_error "LOG_RANK=$LOG_RANK: the shown ranks must be local ranks, 0..$((NGPU - 1)) with NGPU=$NGPU, comma-separated, e.g. LOG_RANK=0"
  fi
done

export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
# A process that dies of a fatal signal (SIGSEGV, ...) prints its Python stack (the workers of a
# multi-process launch write theirs to the launch folder instead: trainer/launch_files.py).
export PYTHONFAULTHANDLER=1
# Offline by default: a debug run must not block on a login prompt.
export WANDB_MODE="${WANDB_MODE:-offline}"

# Check the config, the layout against NNODES x NGPU, the dump folder, RESTARTS against the
# checkpoint settings and the rendezvous port this node is to listen on before starting anything
# (torch-free: a mistake costs a second and prints one `config error: ...` line, exit code 2).
# Node 0 of a multi-node job hosts the rendezvous (is_host below); on a port another program
# holds, torchrun would instead join that program as a client and wait in silence for minutes.
# One process needs no launcher (and no port), unless torchrun is to restart it.
single=$(( NGPU == 1 && NNODES == 1 && RESTARTS == 0 ))
port_check=()
if (( NNODES == 1 && ! single )) && [[ -n "${MASTER_PORT:-}" ]]; then
  port_check=(--free-port "$MASTER_ADDR:$MASTER_PORT")
elif (( NNODES > 1 && NODE_RANK == 0 )); then
  port_check=(--rendezvous-host-port "${MASTER_PORT:-29500}")
fi
# A dry run rehearses dry_run.world_size ranks in one process: the check says so ("dry_run").
launch=$(python3 -m trainer.config.check --world-size "$((NNODES * NGPU))" --restarts "$RESTARTS" \
  "${port_check[@]}" --print-launch --job.config_file "$CONFIG_FILE" "$@")
for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
    printf '%s\n' "$launch"
    exit 0
  fi
done

if (( single )) || [[ "$launch" == dry_run ]]; then
  exec python3 -m trainer.train --job.config_file "$CONFIG_FILE" "$@"
fi

if (( NNODES == 1 )) && [[ -z "${MASTER_PORT:-}" ]]; then
  # One node: torchrun's standalone rendezvous on a free port, so two jobs on one machine never meet.
  rendezvous=(--standalone)
else
  MASTER_PORT="${MASTER_PORT:-29500}"
  # Node 0 hosts the rendezvous store, every other node joins it: left to torchrun, each node
  # whose MASTER_ADDR is local (all of them, when the nodes share a machine) would try to host,
  # and one that found the port taken would join whatever listens there.
  is_host=$( (( NODE_RANK == 0 )) && echo true || echo false )
  rendezvous=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"
              --rdzv_conf="join_timeout=$RDZV_TIMEOUT,is_host=$is_host")
fi

if (( RESTARTS > 0 )); then
  # torchrun shares its rendezvous store with the workers, and a restarted group meets in that
  # same store, still holding the keys of the group before it: a restarted rank can read a dead
  # peer's address and fail to connect (torch 2.13: https://github.com/pytorch/pytorch/issues/135712
  # was closed, but a restart on an unchanged rank 0 reuses the store). Unshared, rank 0 of each
  # group hosts a fresh store on a new port, as before torch 2.4.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi

# The launcher and its workers share TRAINER_LAUNCH_DIR: a worker of torchrun's attempt K (0, then
# one more per restart) writes into attempt<K>/ rank<R>.pid once its stop handlers are installed,
# rank<R>.err with its one-line message when it meets a user mistake (exit 2), rank<R>.exit with its
# exit code and rank<R>.fault with its stack if a fatal signal kills it (trainer/launch_files.py):
# only the last attempt's files describe how the run ended. The launcher's own messages (and its
# traceback when a worker fails) are held back in launcher.log: shown only when no worker explained
# its failure; a restarted worker reads there why the attempt before it failed.
TRAINER_LAUNCH_DIR="$(mktemp -d)"
LAUNCHER_LOG="$TRAINER_LAUNCH_DIR/launcher.log"
export TRAINER_LAUNCH_DIR
trap 'rm -rf "$TRAINER_LAUNCH_DIR"' EXIT
shopt -s nullglob
attempt_dir() {  # the newest attempt's folder, or nothing before a worker wrote one
  local dirs=("$TRAINER_LAUNCH_DIR"/attempt*)
  (( ${#dirs[@]} )) && printf '%s\n' "${dirs[@]}" | sort -V | tail -n 1
  return 0
}

# Stops. torchrun and its workers run in process groups of their own, so a stop sent to this
# script's group (Ctrl-C, kill -TERM -PGID) reaches only this script, which forwards it once to
# each worker and waits while they save the step they are in and exit. Not through torchrun: it
# would kill workers that take more than its shutdown timeout (30 s) to save.
stop_signal=""
woke=0
launcher_pid=""
forward() {  # SIGNAL: to every worker that has its stop handler, else to torchrun, which passes it on
  local file sent=0
  for file in "$(attempt_dir)"/rank*.pid; do
    kill -s "$1" "$(<"$file")" 2>/dev/null && sent=1
  done
  (( sent )) || kill -s "$1" "$launcher_pid" 2>/dev/null || true
}
on_signal() {  # SIGNAL
  woke=1
  if [[ -z "$stop_signal" ]]; then
    stop_signal="$1"
    printf 'run_train.sh: SIG%s: the workers finish and save the step they are in, then stop (a second Ctrl-C aborts at once, losing that save)\n' "$1" >&2
    forward "$([[ "$1" == HUP ]] && echo TERM || echo "$1")"
  elif [[ "$1" == INT && "$stop_signal" != ABORT ]]; then
    stop_signal=ABORT
    printf 'run_train.sh: second Ctrl-C: killing the workers; resume starts from the last complete checkpoint\n' >&2
    # torchrun first: it would restart killed workers (RESTARTS); its death kills them too.
    kill -s KILL "$launcher_pid" 2>/dev/null || true
    forward KILL
  fi
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap 'on_signal HUP' HUP

# stdout goes straight through; stderr passes the filter: the workers' "[rankN]:" lines go on to
# the terminal, the launcher's own lines to LAUNCHER_LOG.
mkfifo "$TRAINER_LAUNCH_DIR/stderr"
set -m
while IFS= read -r line || [[ -n "$line" ]]; do
  if [[ "$line" == "[rank"* ]]; then printf '%s\n' "$line" >&2; else printf '%s\n' "$line" >>"$LAUNCHER_LOG"; fi
done <"$TRAINER_LAUNCH_DIR/stderr" &
filter_pid=$!
# torchrun and each worker die by SIGKILL when their parent does (trainer/parent_death.py: a
# parent-death signal, and why): nothing of the run outlives this script, however it ends.
python3 -m trainer.parent_death $$ torchrun \
  --nnodes="$NNODES" --nproc_per_node="$NGPU" --node_rank="$NODE_RANK" "${rendezvous[@]}" \
  --max-restarts="$RESTARTS" --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 --log-dir="$TRAINER_LAUNCH_DIR/torchrun" \
  -m trainer.train --job.config_file "$CONFIG_FILE" "$@" </dev/null 2>"$TRAINER_LAUNCH_DIR/stderr" &
launcher_pid=$!
set +m +e
while :; do
  woke=0
  wait "$launcher_pid"
  status=$?
  # A trapped signal ends `wait` early (status > 128) while torchrun runs on: wait again.
  (( woke && status > 128 )) || break
done
wait "$filter_pid"
set -e

# A worker that died of a signal (torchrun's root cause: a negative exit code) is named in one line,
# with its Python stack where faulthandler wrote one (rank<R>.fault: torchrun shows LOG_RANK's stderr
# only), instead of torchrun's traceback and what the surviving ranks' collectives then said.
attempt="$(attempt_dir)"
died=""
if (( status != 0 )) && [[ "$stop_signal" != ABORT ]]; then
  died=$(awk '/Root Cause/ {root = 1} root && $1 == "rank" {rank = $3}
              root && $1 == "exitcode" && $3 ~ /^-/ {print rank, substr($3, 2), $NF; exit}' "$LAUNCHER_LOG" 2>/dev/null || true)
fi
if [[ -n "$died" ]]; then
  read -r rank signum signame <<<"$died"
  signame="${signame//[()]/}"
  if [[ -n "$attempt" && -s "$attempt/rank$rank.fault" ]]; then
    printf 'error: rank %s died of %s (signal %s); its Python stack:\n' "$rank" "$signame" "$signum" >&2
    cat "$attempt/rank$rank.fault" >&2
  else
    advice=""
    [[ "$signame" == SIGKILL ]] && advice=": the kernel's out-of-memory killer sends it (dmesg says), or another process did"
    printf 'error: rank %s was killed by %s (signal %s)%s\n' "$rank" "$signame" "$signum" "$advice" >&2
  fi
  exit "$status"
fi
errors=()
exits=()
started=()
if [[ -n "$attempt" ]]; then
  errors=("$attempt"/rank*.err)
  exits=("$attempt"/rank*.exit)
  started=("$attempt"/rank*.pid)
fi
if (( ${#errors[@]} )); then
  for file in $(printf '%s\n' "${errors[@]}" | sort -V); do
    rank="$(basename "$file" .err)"
    printf '[%s] %s\n' "$rank" "$(cat "$file")" >&2
  done
  exit 2
fi
if [[ "$stop_signal" != ABORT ]] && (( ${#exits[@]} == NGPU )) && ! grep -qvx 0 "${exits[@]}"; then
  # Every worker of this node finished or stopped on request and saved: torchrun's own exit code
  # (1 after it got the stop signal itself) says nothing more.
  exit 0
fi
[[ "$stop_signal" == ABORT ]] && exit 130
if [[ -n "$stop_signal" ]] && (( ${#started[@]} == 0 )); then
  printf 'run_train.sh: stopped by SIG%s while the workers were starting: nothing was trained, nothing to save\n' "$stop_signal" >&2
  exit 0
fi
# No worker got ready: torchrun makes its per-attempt log folders (--log-dir) only once the
# rendezvous has completed and it starts the workers, so without one the rendezvous failed; with one,
# the workers were started and stopped before getting ready, which on a multi-node job is torchrun
# ending this node's attempt because another node's failed (a worker of this node that failed by
# itself has torchrun's "failed (exitcode" line, and torchrun's report below).
if (( status != 0 && ${#started[@]} == 0 )) && [[ "${rendezvous[0]}" != --standalone ]]; then
  reason="$(grep -E 'Error|error' "$LAUNCHER_LOG" 2>/dev/null | tail -n 1 || true)"
  workers_made=("$TRAINER_LAUNCH_DIR"/torchrun/*/attempt_*)
  if (( ${#workers_made[@]} == 0 )); then
    printf 'error: the workers never started: the rendezvous at MASTER_ADDR:MASTER_PORT = %s:%s failed (%s; RDZV_TIMEOUT = %s s). Check that all NNODES = %s nodes are started with the same MASTER_ADDR and MASTER_PORT, that the node with that address can listen on the port (no other job holds it) and the others reach it.\n' \
      "$MASTER_ADDR" "$MASTER_PORT" "${reason:-no message}" "$RDZV_TIMEOUT" "$NNODES" >&2
    exit 2
  elif ! grep -q 'failed (exitcode' "$LAUNCHER_LOG" 2>/dev/null; then
    printf 'error: node %s: the rendezvous at %s:%s succeeded, but no worker of this node got ready before torchrun stopped them (%s): another node of the job failed or this node'"'"'s workers hung while starting. The other nodes'"'"' logs say which rank failed first.\n' \
      "$NODE_RANK" "$MASTER_ADDR" "$MASTER_PORT" "${reason:-no message}" >&2
    exit 2
  fi
fi
if (( status != 0 )) && [[ -f "$LAUNCHER_LOG" ]]; then
  cat "$LAUNCHER_LOG" >&2
fi
exit "$status"
