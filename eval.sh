#!/usr/bin/env bash
# Evaluate a checkpoint on the ImageNet-1K validation set (resize 256 bicubic, center crop 224).
#
#   MODEL=NALAFORMER_T CKPT=output/NALAFORMER_T/best.pth DATA=/data/imagenet bash eval.sh
#   NPROC=8 ... bash eval.sh          # exact --dist-eval over 8 processes (every image counted once)
#
# Environment: MODEL (default NALAFORMER_T), CKPT (required), DATA, NPROC (1), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), BATCH (128), PYTHON. Evaluation writes no files. Extra
# flags go to main.py (e.g. --device cpu, --input-size 288).
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-NALAFORMER_T}
CKPT=${CKPT:?set CKPT to the checkpoint to evaluate}
DATA=${DATA:-/path/to/imagenet}
NPROC=${NPROC:-1}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
BATCH=${BATCH:-128}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

args=(main.py --model "$MODEL" --eval --resume "$CKPT" --batch-size "$BATCH" --data-set IMNET
      --data-path "$DATA" --input-size 224 --dist-eval "$@")
if [ "$NPROC" -gt 1 ] || [ "$NNODES" -gt 1 ]; then
    cmd=("$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC"
         --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" "${args[@]}")
else
    cmd=("$PYTHON" "${args[@]}")
fi
echo "+ ${cmd[*]}"
exec "${cmd[@]}"
