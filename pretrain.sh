#!/usr/bin/env bash
# Train a NaLaFormer variant from scratch on ImageNet-1K with the reference recipe:
# 300 epochs, batch 128 per process (global 1024 on 8 GPUs -> LR 5e-4 * 1024 / 512 = 1e-3), AdamW wd 0.05,
# cosine to 1e-5 after 5 warmup epochs, RandAugment/Mixup/CutMix/random erasing/repeated augmentation,
# EMA, SyncBatchNorm, fp32 with TF32 matmuls/convolutions, and the variant's own drop path (main.py's
# default when --drop-path is not given).
#
#   MODEL=NALAFORMER_S DATA=/data/imagenet OUTPUT=output/s bash pretrain.sh
#   # two nodes: run the same on each with NNODES=2 MASTER_ADDR=<node 0> MASTER_PORT=29500
#   # extra flags go to main.py:  bash pretrain.sh --epochs 100
#   DRY_RUN=1 MODEL=NALAFORMER_S bash pretrain.sh     # print the command, run nothing
#
# Environment: MODEL (NALAFORMER_XT|T|S|B|L, default T), DATA, OUTPUT, NPROC (processes per node, 8),
# NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1 on one node; required with NNODES>1), MASTER_PORT (29500),
# BATCH (per process, 128), AMP (none|bf16|fp16; default none = fp32 with TF32 as the reference trained; bf16 is
# the fast option on GPUs with bf16 tensor cores), PYTHON (default .venv/bin/python when present), MAX_RESTARTS (torchrun restarts after a
# failure, 0), DRY_RUN (1: print the command only). DATA must be an existing folder (checked before launching).
# Relaunching the same command resumes from $OUTPUT/checkpoint.pth (also after SIGTERM/preemption).
# Several nodes (NNODES>1) meet in torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT (run id SLURM_JOB_ID,
# else nalaformer): the node ranks come from the rendezvous (NODE_RANK is not used), and after a failure
# (MAX_RESTARTS>0) the agents of all nodes restart their workers together. MASTER_ADDR must then be set: the
# default, 127.0.0.1, would make every node wait for itself; set MASTER_ADDR=127.0.0.1 yourself only to try
# several "nodes" on one machine.
# SIGUSR1 (SLURM's warning before the time limit, sent to every process of the job step) stops the training
# processes at their next step with a saved checkpoint; torchrun ignores it (see slurm/train.sbatch).
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-NALAFORMER_T}
DATA=${DATA:-/path/to/imagenet}
OUTPUT=${OUTPUT:-output/${MODEL}}
NPROC=${NPROC:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
BATCH=${BATCH:-128}
AMP=${AMP:-none}
source tools/launch.sh  # PYTHON, AMP_FLAGS and RDZV (torchrun's rendezvous flags for NNODES nodes)
cmd=("$PYTHON" -m torch.distributed.run
     --nnodes="$NNODES" --nproc_per_node="$NPROC" --max-restarts="${MAX_RESTARTS:-0}" "${RDZV[@]}"
     main.py --model "$MODEL" --batch-size "$BATCH" --epochs 300
     --lr 5e-4 --weight-decay 0.05 --warmup-epochs 5 --warmup-lr 1e-6 --min-lr 1e-5
     --data-set IMNET --data-path "$DATA" --input-size 224 --output_dir "$OUTPUT" --dist-eval
     "${AMP_FLAGS[@]}" "$@")
echo "+ ${cmd[*]}"
if [ "${DRY_RUN:-0}" = "1" ]; then exit 0; fi
# refuse a DATA that is not a folder here before torchrun starts NPROC processes that would each fail on it
if [ "$DATA" = /path/to/imagenet ]; then
    echo "pretrain.sh: DATA is not set; set DATA to the ImageNet folder (holding train/ and val/)" >&2; exit 2
elif [ ! -d "$DATA" ]; then
    echo "pretrain.sh: DATA=$DATA is not a folder; set DATA to the ImageNet folder (holding train/ and val/)" >&2; exit 2
fi
# SLURM's requeue warning (USR1) reaches every process of the step: the training processes save and stop,
# torchrun ignores it (an ignored signal stays ignored across exec; main.py installs its own handler)
trap '' USR1
exec "${cmd[@]}"
