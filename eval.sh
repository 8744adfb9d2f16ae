#!/usr/bin/env bash
# Evaluate a checkpoint on the ImageNet-1K validation set, at the input size and crop ratio the checkpoint
# records (224: resize 256 bicubic, center crop 224; a 384 fine-tune: 384 at crop ratio 1.0).
#
#   MODEL=NALAFORMER_T CKPT=output/NALAFORMER_T/best.pth DATA=/data/imagenet bash eval.sh
#   NPROC=8 ... bash eval.sh          # exact --dist-eval over 8 processes (every image counted once)
#   SIZE=288 ... bash eval.sh         # another input size than the checkpoint's (main.py prints both)
#   DRY_RUN=1 ... bash eval.sh        # print the command, run nothing
#
# Environment: MODEL (default NALAFORMER_T), CKPT (required), DATA, SIZE (default: the checkpoint's),
# NPROC (1), NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), BATCH (128), PYTHON,
# DRY_RUN (1: print the command only). Evaluation writes no files. Extra flags go to main.py (e.g.
# --device cpu, --eval-crop-ratio 1.0).
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

SIZE_FLAGS=()
if [ -n "${SIZE:-}" ]; then SIZE_FLAGS=(--input-size "$SIZE"); fi

args=(main.py --model "$MODEL" --eval --resume "$CKPT" --batch-size "$BATCH" --data-set IMNET
      --data-path "$DATA" "${SIZE_FLAGS[@]}" --dist-eval "$@")
if [ "$NPROC" -gt 1 ] || [ "$NNODES" -gt 1 ]; then
    cmd=("$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC"
         --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" "${args[@]}")
else
    cmd=("$PYTHON" "${args[@]}")
fi
echo "+ ${cmd[*]}"
if [ "${DRY_RUN:-0}" = "1" ]; then exit 0; fi
exec "${cmd[@]}"
