#!/bin/bash

# Runs a ~1.3B-parameter GPT with ByteScale Hybrid Data Parallelism (HDP) on one 8-GPU node
# (or, with the variables below, on several nodes with tensor and pipeline parallelism), in the
# style of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh.
#
# Needs: a Megatron-LM checkout at tag core_v0.16.1 patched with
#   bash scripts/apply_megatron_patches.sh /path/to/Megatron-LM
# and this plugin installed in the same Python environment (pip install -e <this repo>).
#
#   MEGATRON_LM_DIR=/path/to/Megatron-LM bash scripts/pretrain_gpt_bytescale.sh \
#       CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [extra flags...]
#
# Several nodes, TP and PP: run the same command on every node, e.g. 4 nodes x 8 GPUs with
# TP 4 (and sequence parallelism) x PP 2 = 4 HDP ranks (model replicas):
#
#   NUM_NODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0> TP_SIZE=4 PP_SIZE=2 \
#       MEGATRON_LM_DIR=/path/to/Megatron-LM bash scripts/pretrain_gpt_bytescale.sh ...
#
# WORLD_SIZE = NUM_NODES x GPUS_PER_NODE = TP x PP x HDP ranks. Every TP rank and pipeline stage
# of a replica runs the same planned micro-batches; a long document's ring joins the replicas
# it needs (each TP rank with its peers of the same TP rank, on its own heads), and under PP
# every pipeline runs its own micro-batch count in 1F1B order (PP-Balance plans them).
# --bytescale-capacity stays the tokens one replica holds per micro-batch; with sequence
# parallelism each TP rank keeps 1/TP of their activations. --num-layers must divide by PP.
#
# DATA_PATH is a Megatron indexed-dataset prefix (<prefix>.bin/.idx, e.g. my_text_document),
# or "mock" for synthetic long-tailed documents. Extra flags are appended last, so they
# override the ones below. DRY_RUN=1 prints the command instead of running it.
#
# What HDP changes compared with a static DP x CP run (docs/megatron_lm.md):
#   * --context-parallel-size stays 1: all 8 ranks form one HDP (= data-parallel) group;
#   * --seq-length is the longest document (context) the job accepts; every rank holds at most
#     --bytescale-capacity tokens per micro-batch, so a 32K document gets a ring of 4 ranks
#     (like CP = 4) while short documents are packed on one rank and never communicate;
#   * a global batch is --global-batch-size x --seq-length tokens of whole documents, and each
#     rank runs as many micro-batches as the balance scheduler gives it;
#   * --calculate-per-token-loss is required (set here, and turned on by --bytescale-hdp).

set -euo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
TP_SIZE=${TP_SIZE:-1}                  # tensor parallelism (Megatron's; sequence parallel with it)
PP_SIZE=${PP_SIZE:-1}                  # pipeline stages (Megatron's 1F1B; no virtual stages)
if (( WORLD_SIZE % (TP_SIZE * PP_SIZE) )); then
    echo "pretrain_gpt_bytescale.sh: NUM_NODES x GPUS_PER_NODE = $WORLD_SIZE is not divisible by" \
         "TP_SIZE x PP_SIZE = $((TP_SIZE * PP_SIZE))" >&2
    exit 2
fi

MEGATRON_LM_DIR=${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to the patched Megatron-LM checkout}

CHECKPOINT_PATH=${1:?CHECKPOINT_PATH} #<Specify path>
TENSORBOARD_LOGS_PATH=${2:?TENSORBOARD_LOGS_PATH} #<Specify path>
VOCAB_FILE=${3:?VOCAB_FILE} #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=${4:?MERGE_FILE} #<Specify path to file>/gpt2-merges.txt
DATA_PATH=${5:?DATA_PATH} #<Specify path and file prefix>_text_document, or mock
shift 5

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --num-attention-heads 16
    --group-query-attention
    --num-query-groups 8
    --ffn-hidden-size 5632
    --swiglu
    --normalization RMSNorm
    --position-embedding-type rope
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --seq-length 32768                 # longest document (context) in tokens
    --max-position-embeddings 32768
    --attention-dropout 0.0            # the ring attention has no dropout
    --hidden-dropout 0.0
    --transformer-impl transformer_engine
)

TRAINING_ARGS=(
    --micro-batch-size 1               # bookkeeping only under HDP (a micro-batch is one packed row)
    --global-batch-size 32             # x --seq-length = 1M tokens per step
    --train-iters 100000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.02
    --clip-grad 1.0
    --bf16
    --lr 3.0e-4
    --lr-decay-style cosine
    --min-lr 3.0e-5
    --lr-warmup-fraction .01
    --lr-decay-iters 100000
    --calculate-per-token-loss         # HDP: ranks train different numbers of tokens
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --pipeline-model-parallel-size $PP_SIZE
    --context-parallel-size 1          # HDP replaces static context parallelism
    --use-distributed-optimizer        # ZeRO-1 over the HDP group (world / TP / PP ranks)
)
if (( TP_SIZE > 1 )); then
    MODEL_PARALLEL_ARGS+=(--sequence-parallel)
fi

BYTESCALE_ARGS=(
    --bytescale-hdp
    --bytescale-capacity 8192          # tokens per rank per micro-batch (a static run's seq/CP)
    --bytescale-scheduler balance      # naive | balance | static | pow2
    --bytescale-plan-mode every_rank   # or rank0_broadcast
    --bytescale-attention-backend auto # flash_attn or te on GPUs when installed, else torch
)

if [[ "$DATA_PATH" == "mock" ]]; then
    DATA_ARGS=(--mock-data --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE)
else
    DATA_ARGS=(
        --data-path $DATA_PATH
        --vocab-file $VOCAB_FILE
        --merge-file $MERGE_FILE
        --split 949,50,1
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --save-interval 1000
    --eval-interval 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

COMMAND=(
    torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py
    ${GPT_MODEL_ARGS[@]}
    ${TRAINING_ARGS[@]}
    ${MODEL_PARALLEL_ARGS[@]}
    ${BYTESCALE_ARGS[@]}
    ${DATA_ARGS[@]}
    ${EVAL_AND_LOGGING_ARGS[@]}
    "$@"
)

if [[ -n "${DRY_RUN:-}" ]]; then
    echo "cd $MEGATRON_LM_DIR && ${COMMAND[*]}"
    exit 0
fi
cd "$MEGATRON_LM_DIR"
exec "${COMMAND[@]}"
