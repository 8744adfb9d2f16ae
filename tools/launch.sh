# Sourced by pretrain.sh, finetune.sh and segmentation/train.sh once their settings have defaults: PYTHON (the
# repository's .venv when there is one, else python3, unless set), the array AMP_FLAGS from AMP (none, bf16 or
# fp16), and torchrun's rendezvous flags, in the array RDZV, from NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT. One node: the static rendezvous (MASTER_ADDR 127.0.0.1 unless set). Several nodes:
# the c10d rendezvous at MASTER_ADDR:MASTER_PORT (run id SLURM_JOB_ID, else nalaformer), which numbers the nodes
# and restarts the workers of all of them together; the workers of every attempt then start a fresh store (see
# distributed.agent_store_shared). MASTER_ADDR must then be set: the default would make each node wait for itself.
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
case "$AMP" in
    none) AMP_FLAGS=() ;;
    bf16|fp16) AMP_FLAGS=(--amp "$AMP") ;;
    *) echo "$(basename "$0"): unknown AMP=$AMP (expected none, bf16 or fp16)" >&2; exit 2 ;;
esac
if [ "$NNODES" = 1 ]; then
    RDZV=(--node_rank="$NODE_RANK" --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="$MASTER_PORT")
elif [ -z "${MASTER_ADDR:-}" ]; then
    echo "$(basename "$0"): NNODES=$NNODES needs MASTER_ADDR, the address of the first node, which every node" \
         "reaches (MASTER_ADDR=127.0.0.1 only to try several nodes on one machine)" >&2
    exit 2
else
    RDZV=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${SLURM_JOB_ID:-nalaformer}")
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
