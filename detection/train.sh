#!/usr/bin/env bash
# Train Mask R-CNN on a NaLaFormer backbone on COCO 2017 with a detection recipe (RECIPE: 1x, the Swin-style
# multi-scale 12 epochs; pvt-1x, PVT's single-scale 12 epochs; 3x, 36 epochs) at a global batch of 16 (8
# processes x 2), an evaluation (COCOeval box and mask AP) and a checkpoint after every epoch, SyncBatchNorm,
# fp32 with TF32. One process per GPU, as pretrain.sh.
#
#   MODEL=NALAFORMER_T DATA=/data/coco PRETRAINED=output/t/best.pth OUTPUT=output/det_t bash detection/train.sh
#   SCRIPT=detection/train.sh MODEL=NALAFORMER_T DATA=... PRETRAINED=... OUTPUT=... sbatch slurm/train.sbatch
#   # extra flags go to detection/train.py:  bash detection/train.sh --no-mask
#   DRY_RUN=1 bash detection/train.sh     # print the command, run nothing
#
# Environment: MODEL (default NALAFORMER_T), RECIPE (1x), DATA (the COCO folder: train2017/, val2017/,
# annotations/), PRETRAINED (a classification checkpoint or release of MODEL; empty: the backbone starts
# untrained), OUTPUT (output/det_<MODEL>_<RECIPE>), NPROC (processes per node, 8), NNODES (1), NODE_RANK (0),
# MASTER_ADDR, MASTER_PORT (29500), BATCH (per process, 2: keep NPROC x NNODES x BATCH = 16 for the recipe), AMP
# (none|bf16|fp16, none), PYTHON, MAX_RESTARTS (0), DRY_RUN (1: print the command only). Relaunching the same
# command resumes from $OUTPUT/checkpoint.pth (also after SIGTERM, preemption or SLURM's USR1 warning;
# slurm/train.sbatch requeues the job).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-NALAFORMER_T}
RECIPE=${RECIPE:-1x}
DATA=${DATA:-/path/to/coco}
OUTPUT=${OUTPUT:-output/det_${MODEL}_${RECIPE}}
NPROC=${NPROC:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
BATCH=${BATCH:-2}
AMP=${AMP:-none}
PRETRAINED_FLAGS=()
if [ -n "${PRETRAINED:-}" ]; then PRETRAINED_FLAGS=(--pretrained "$PRETRAINED"); fi

source tools/launch.sh  # PYTHON, AMP_FLAGS and RDZV (torchrun's rendezvous flags for NNODES nodes)
cmd=("$PYTHON" -m torch.distributed.run
     --nnodes="$NNODES" --nproc_per_node="$NPROC" --max-restarts="${MAX_RESTARTS:-0}" "${RDZV[@]}"
     detection/train.py --model "$MODEL" --recipe "$RECIPE" --data-path "$DATA" --output_dir "$OUTPUT"
     --batch-size "$BATCH" --dist-eval "${PRETRAINED_FLAGS[@]}" "${AMP_FLAGS[@]}" "$@")
echo "+ ${cmd[*]}"
if [ "${DRY_RUN:-0}" = "1" ]; then exit 0; fi
if [ ! -d "$DATA" ]; then
    echo "train.sh: DATA=$DATA is not a folder; set DATA to the COCO folder (holding train2017/, val2017/ and annotations/)" >&2
    exit 2
fi
# SLURM's requeue warning (USR1) reaches every process of the step: the training processes save and stop,
# torchrun ignores it (see pretrain.sh)
trap '' USR1
exec "${cmd[@]}"
