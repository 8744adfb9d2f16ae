#!/usr/bin/env bash
# Fine-tune a trained NaLaFormer at 384x384 on ImageNet-1K, starting from a 224 checkpoint.
#
#   MODEL=NALAFORMER_S CKPT=output/s/best.pth DATA=/data/imagenet OUTPUT=output/s_384 bash finetune.sh
#   DRY_RUN=1 CKPT=... bash finetune.sh     # print the command, run nothing
#   # extra flags go to main.py:  bash finetune.sh --epochs 10
#
# The recipe below is OUR choice (the paper publishes no 384 fine-tuning recipe); it follows the usual
# DeiT/ConvNeXt practice for a short high-resolution fine-tune:
#   30 epochs, AdamW, base LR 5e-5 at global batch 512 (scaled by main.py to lr x global batch / 512),
#   no warmup, cosine to 1e-6, weight decay 0.05, layer-wise LR decay (per variant, below), the
#   variant's pretraining drop path, the pretraining augmentation (RandAugment, Mixup/CutMix, random
#   erasing, repeated augmentation), EMA on, batch 64 per process (8 x 64 = 512), and evaluation at
#   384 with crop ratio 1.0 (resize to 384, centre crop 384), as timm's 384 models do.
# Train mode: main.py --finetune alone trains in eval mode, as the reference did (BatchNorm statistics
#   frozen, drop path off). This recipe passes --train-mode (later DeiT's choice): its drop path acts only
#   in train mode, and the BatchNorm statistics adapt to 384. Append --no-train-mode for the reference's way.
# Layer decay: every block is one layer, so the stem's LR is decay^(blocks + 1) of the head's. The
# defaults keep that near 0.1-0.2 for every depth: XT 0.8 (8 blocks), T 0.85 (12), S 0.9 (20),
# B 0.93 (28), L 0.95 (38).
#
# Environment: MODEL (NALAFORMER_XT|T|S|B|L, default T), CKPT (required: the 224 checkpoint; its EMA
# weights when it has them, else its model weights), DATA, OUTPUT (default output/<MODEL>_384), SIZE (384), EPOCHS (30), LR (5e-5),
# LAYER_DECAY (per variant), BATCH (per process, 64), NPROC (8), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1 on one node; required with NNODES>1), MASTER_PORT (29500), MAX_RESTARTS (torchrun
# restarts after a failure, 0), AMP (fp16|bf16|none, fp16), PYTHON, DRY_RUN (1: print the command only).
# Several nodes, SIGUSR1 and restarts work as in pretrain.sh (c10d rendezvous at MASTER_ADDR:MASTER_PORT).
# The checkpoint records --input-size and --eval-crop-ratio, so tools/predict.py and tools/release.py
# use 384 and crop 1.0 for it. Relaunching the same command resumes from $OUTPUT/checkpoint.pth.
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-NALAFORMER_T}
CKPT=${CKPT:?set CKPT to the checkpoint to fine-tune from}
DATA=${DATA:-/path/to/imagenet}
OUTPUT=${OUTPUT:-output/${MODEL}_384}
SIZE=${SIZE:-384}
EPOCHS=${EPOCHS:-30}
LR=${LR:-5e-5}
BATCH=${BATCH:-64}
NPROC=${NPROC:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-0}
AMP=${AMP:-fp16}
case "${MODEL^^}" in
    NALAFORMER_XT) DROP_PATH=0.1;  DEFAULT_LD=0.8 ;;
    NALAFORMER_T)  DROP_PATH=0.1;  DEFAULT_LD=0.85 ;;
    NALAFORMER_S)  DROP_PATH=0.15; DEFAULT_LD=0.9 ;;
    NALAFORMER_B)  DROP_PATH=0.4;  DEFAULT_LD=0.93 ;;
    NALAFORMER_L)  DROP_PATH=0.55; DEFAULT_LD=0.95 ;;
    *) echo "finetune.sh: unknown MODEL=$MODEL (expected NALAFORMER_XT, _T, _S, _B or _L)" >&2; exit 2 ;;
esac
LAYER_DECAY=${LAYER_DECAY:-$DEFAULT_LD}
source tools/launch.sh  # PYTHON, AMP_FLAGS and RDZV (torchrun's rendezvous flags for NNODES nodes)
cmd=("$PYTHON" -m torch.distributed.run
     --nnodes="$NNODES" --nproc_per_node="$NPROC" --max-restarts="$MAX_RESTARTS" "${RDZV[@]}"
     main.py --model "$MODEL" --finetune "$CKPT" --input-size "$SIZE" --eval-crop-ratio 1.0
     --drop-path "$DROP_PATH" --train-mode --batch-size "$BATCH" --epochs "$EPOCHS"
     --lr "$LR" --layer-decay "$LAYER_DECAY" --weight-decay 0.05 --warmup-epochs 0 --min-lr 1e-6
     --data-set IMNET --data-path "$DATA" --output_dir "$OUTPUT" --dist-eval
     "${AMP_FLAGS[@]}" "$@")
echo "+ ${cmd[*]}"
if [ "${DRY_RUN:-0}" = "1" ]; then exit 0; fi
# refuse a DATA that is not a folder here before torchrun starts NPROC processes that would each fail on it
if [ "$DATA" = /path/to/imagenet ]; then
    echo "finetune.sh: DATA is not set; set DATA to the ImageNet folder (holding train/ and val/)" >&2; exit 2
elif [ ! -d "$DATA" ]; then
    echo "finetune.sh: DATA=$DATA is not a folder; set DATA to the ImageNet folder (holding train/ and val/)" >&2; exit 2
fi
trap '' USR1  # SLURM's requeue warning: the training processes save and stop, torchrun ignores it (pretrain.sh)
exec "${cmd[@]}"
