#!/usr/bin/env bash
# Seed-style launcher: every node runs this with its own NODE_RANK.
#   run.sh GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT [script args...]
# Under meshkit:  meshkit train --cmd 'templates/run.sh $GPUS_PER_NODE $NNODES $NODE_RANK $MASTER_ADDR $MASTER_PORT'
set -euo pipefail
if [ $# -lt 5 ]; then
  echo "usage: $0 GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT [script args...]" >&2
  exit 2
fi
GPUS_PER_NODE=$1 NNODES=$2 NODE_RANK=$3 MASTER_ADDR=$4 MASTER_PORT=$5
shift 5
SCRIPT=${SCRIPT:-"$(dirname "$0")/example_train.py"}
exec torchrun \
  --nproc-per-node "$GPUS_PER_NODE" \
  --nnodes "$NNODES" \
  --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" \
  --master-port "$MASTER_PORT" \
  "$SCRIPT" "$@"
