#!/usr/bin/env bash
# Train a DeepSeek-V3 model.
#
#   ./run_train.sh [--section.key value ...]
#
# Environment:
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml in this repository)
#   NGPU         processes per node (default: the visible GPUs, or 1 CPU process when there are none)
#   LOG_RANK     comma-separated ranks whose output is shown (default 0)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node jobs (c10d rendezvous)
# Every argument is passed to `python -m trainer.train`, so CLI overrides work as usual:
#   ./run_train.sh --training.steps 50 --training.compile
# The config, the layout (against NNODES x NGPU) and the run folder are checked before any
# process starts; a mistake prints one `config error: ...` line and exits with code 2, as does
# any user mistake a worker finds (one `[rankN] ...` line per failing rank).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_FILE="${CONFIG_FILE:-$REPO_DIR/train_configs/debug_model.toml}"
if [[ ! -f "$CONFIG_FILE" && -f "$REPO_DIR/$CONFIG_FILE" ]]; then
  CONFIG_FILE="$REPO_DIR/$CONFIG_FILE"
fi

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
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
LOG_RANK="${LOG_RANK:-0}"

export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
# Offline by default: a debug run must not block on a login prompt.
export WANDB_MODE="${WANDB_MODE:-offline}"

# Check the config, the layout against NNODES x NGPU and the run folder before starting anything
# (torch-free: a bad config costs a second and prints one `config error: ...` line, exit code 2).
python3 -m trainer.config.check --world-size "$((NNODES * NGPU))" --job.config_file "$CONFIG_FILE" "$@"
for arg in "$@"; do
  [[ "$arg" == "-h" || "$arg" == "--help" ]] && exit 0
done

if [[ "$NGPU" -eq 1 && "$NNODES" -eq 1 ]]; then
  exec python3 -m trainer.train --job.config_file "$CONFIG_FILE" "$@"
fi

# A worker that meets a user mistake writes its one-line message to TRAINER_ERROR_DIR/rank<R>.err
# and exits 2. The launcher's own messages (and its traceback when a worker fails) are held back:
# shown only when no worker explained its failure.
TRAINER_ERROR_DIR="$(mktemp -d)"
LAUNCHER_LOG="$TRAINER_ERROR_DIR/launcher.log"
export TRAINER_ERROR_DIR
trap 'rm -rf "$TRAINER_ERROR_DIR"' EXIT
set +e
# stdout goes straight through (fd 3); stderr passes the filter: the workers' "[rankN]:" lines go
# on to the terminal, the launcher's own lines to LAUNCHER_LOG.
{
  torchrun \
    --nnodes="$NNODES" --nproc_per_node="$NGPU" --node_rank="$NODE_RANK" \
    --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
    --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
    -m trainer.train --job.config_file "$CONFIG_FILE" "$@" 2>&1 1>&3 3>&- |
    while IFS= read -r line || [[ -n "$line" ]]; do
      if [[ "$line" == "[rank"* ]]; then printf '%s\n' "$line" >&2; else printf '%s\n' "$line" >>"$LAUNCHER_LOG"; fi
    done
  status=${PIPESTATUS[0]}
} 3>&1
set -e
shopt -s nullglob
errors=("$TRAINER_ERROR_DIR"/rank*.err)
if (( ${#errors[@]} )); then
  for file in $(printf '%s\n' "${errors[@]}" | sort -V); do
    rank="$(basename "$file" .err)"
    printf '[%s] %s\n' "$rank" "$(cat "$file")" >&2
  done
  exit 2
fi
if (( status != 0 )) && [[ -f "$LAUNCHER_LOG" ]]; then
  cat "$LAUNCHER_LOG" >&2
fi
exit "$status"
