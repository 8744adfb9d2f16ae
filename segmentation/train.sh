#!/usr/bin/env bash
# Train UperNet on a NaLaFormer backbone on ADE20K with mmseg's recipe: 160k iterations at a global batch of 16
# (8 processes x 2), 512x512 crops, AdamW lr 6e-5 with weight decay 0.01, poly schedule after 1500 warmup
# iterations, auxiliary FCN head 0.4, an evaluation (whole image, short side 512) and a checkpoint every 16k
# iterations, SyncBatchNorm, fp32 with TF32. One process per GPU, as pretrain.sh.
#
#   MODEL=NALAFORMER_T DATA=/data/ADEChallengeData2016 PRETRAINED=output/t/best.pth OUTPUT=output/seg_t \
#       bash segmentation/train.sh
#   SCRIPT=segmentation/train.sh MODEL=NALAFORMER_T DATA=... PRETRAINED=... OUTPUT=... sbatch slurm/train.sbatch
#   # extra flags go to segmentation/train.py:  bash segmentation/train.sh --eval-mode slide
#   DRY_RUN=1 bash segmentation/train.sh     # print the command, run nothing
#
# Environment: MODEL (default NALAFORMER_T), DATA (the ADEChallengeData2016 folder), PRETRAINED (a classification
# checkpoint or release of MODEL; empty: the backbone starts untrained), OUTPUT (output/seg_<MODEL>), NPROC
# (processes per node, 8), NNODES (1), NODE_RANK (0), MASTER_ADDR, MASTER_PORT (29500), BATCH (per process, 2:
# keep NPROC x NNODES x BATCH = 16 for the recipe), AMP (none|bf16|fp16, none), PYTHON, MAX_RESTARTS (0),
# DRY_RUN (1: print the command only). Relaunching the same command resumes from $OUTPUT/checkpoint.pth (also
# after SIGTERM, preemption or SLURM's USR1 warning; slurm/train.sbatch requeues the job).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-NALAFORMER_T}
DATA=${DATA:-/path/to/ADEChallengeData2016}
OUTPUT=${OUTPUT:-output/seg_${MODEL}}
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
     segmentation/train.py --model "$MODEL" --data-path "$DATA" --output_dir "$OUTPUT" --batch-size "$BATCH"
     --iters 160000 --lr 6e-5 --weight-decay 0.01 --crop-size 512 --dist-eval
     "${PRETRAINED_FLAGS[@]}" "${AMP_FLAGS[@]}" "$@")
echo "+ ${cmd[*]}"
if [ "${DRY_RUN:-0}" = "1" ]; then exit 0; fi
if [ ! -d "$DATA" ]; then
    echo "train.sh: DATA=$DATA is not a folder; set DATA to ADEChallengeData2016 (holding images/ and annotations/)" >&2
    exit 2
fi
# SLURM's requeue warning (USR1) reaches every process of the step: the training processes save and stop,
# torchrun ignores it (see pretrain.sh)
trap '' USR1
exec "${cmd[@]}"
