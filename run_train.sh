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

if [[ "$NGPU" -eq 1 && "$NNODES" -eq 1 ]]; then
  exec python3 -m trainer.train --job.config_file "$CONFIG_FILE" "$@"
fi

exec torchrun \
  --nnodes="$NNODES" --nproc_per_node="$NGPU" --node_rank="$NODE_RANK" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
  --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
  -m trainer.train --job.config_file "$CONFIG_FILE" "$@"
