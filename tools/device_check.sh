#!/usr/bin/env bash
# tools/device_check.sh: the GPU checks of issue 29 item 6, one prepared script for a lent GPU host
# (docs/gpu.md). Sections, each bounded by its own timeout and logged to OUT_DIR/<section>.log:
#   env    the GPU, torch, CUDA; the project's packages into /tmp/site
#   tests  the GPU-applicable unit tests (tests/gpu and the unit suites of the kernels they use)
#   bench  benchmarks/bench_gpu.py at d = 576, 1536, 4096 (bf16 matmul rate, PRF, codecs vs a layer),
#          at 1024 and 8192 tokens per micro-batch
#   train  TRAIN_ITERS (5) iterations of single-rank SmolLM2-135M GRPO in bf16 on the GPU
#
#   bash tools/device_check.sh OUT_DIR [SECTIONS]      # SECTIONS: default "env train tests bench"
#
# The GPU host has torch and transformers but nothing else of the stack, and no network. The
# caller puts into .devbundle/ (git-ignored) what tools/device_bundle.sh prepares, naming each
# path in the device call's `carry`: site.tar.xz (megatron-core, DeepSpeed, math-verify and the
# other pure-Python packages as installed here, with their metadata), whl/ (pydantic's compiled
# core for the host's Python), data/ (CEGRPO_DATA_ROOT), smollm2-hf/ (SmolLM2's config and
# tokenizer), gguf.sha256 and ONE piece of SmolLM2's GGUF per call (gguf-parts/smollm2.gguf.part-NN:
# the whole file is over a call's 64 MiB). The pieces are kept in $DEVICE_STASH (/tmp/cegrpo_stash,
# outside the checkout) while the host stays up between back-to-back calls; once all have come and
# the sha256 matches, `train` uses the real model. Without it, `train` runs SmolLM2's architecture
# with random weights (same shapes and FLOPs; its rewards are 0, so it trains nothing) and says so.
set -u
OUT_DIR=${1:?usage: tools/device_check.sh OUT_DIR [SECTIONS]}
SECTIONS=${2:-env train tests bench}
TRAIN_ITERS=${TRAIN_ITERS:-5}
cd "$(dirname "$0")/.."
B=.devbundle
S=${DEVICE_STASH:-/tmp/cegrpo_stash}  # outside the checkout: kept between calls while the host stays up
mkdir -p "$OUT_DIR" "$S"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD CEGRPO_DATA_ROOT=$PWD/$B/data
export TORCH_EXTENSIONS_DIR=$S/torch_extensions MEGATRON_CEGRPO_CACHE=$S/cache
# DeepSpeed 0.19.8's op builder cannot parse an arch with a suffix ("9.0a", Hopper's, which the
# GPU image sets in TORCH_CUDA_ARCH_LIST: "invalid literal for int() with base 10: '0a'"): drop it
TORCH_CUDA_ARCH_LIST=$(echo "${TORCH_CUDA_ARCH_LIST:-9.0}" | sed -E 's/([0-9])a\b/\1/g')
export TORCH_CUDA_ARCH_LIST
PY=${PYTHON:-python3}

section() {  # section NAME SECONDS COMMAND...: run, log, report its exit status and seconds
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s) ==="
  timeout -k 10 "$limit" bash -c "$*" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - t0)) s ==="
  tail -n 25 "$OUT_DIR/$name.log"
  return 0
}

setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())"
  if [[ ! -f /tmp/site/.done ]]; then
    mkdir -p /tmp/site
    tar -xJf $B/site.tar.xz -C /tmp/site
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $B/whl/*.whl
    touch /tmp/site/.done
  fi
  for p in $B/gguf-parts/smollm2.gguf.part-*; do [[ -f $p ]] && cp "$p" $S/; done
  if [[ ! -f $S/smollm2.gguf ]] && [[ -f $B/gguf.sha256 ]]; then
    cat $S/smollm2.gguf.part-* > $S/smollm2.gguf.tmp 2>/dev/null
    if [[ "$(sha256sum < $S/smollm2.gguf.tmp | cut -d' ' -f1)" == "$(cat $B/gguf.sha256)" ]]; then
      mv $S/smollm2.gguf.tmp $S/smollm2.gguf
    else
      rm -f $S/smollm2.gguf.tmp
    fi
  fi
  ls -la $S
  local t0=$SECONDS
  $PY tools/build_ops.py && echo "DeepSpeed ops built in $((SECONDS - t0)) s"
  $PY -c "import megatron.core, deepspeed, math_verify, gguf, megatron_cegrpo; print('imports ok', megatron.core.__version__, deepspeed.__version__)"
}

tests() {
  # single-process suites only: a multi-rank test here would put every rank on the one GPU
  $PY -m pytest -q -n 8 --timeout 300 tests/gpu tests/compat tests/test_mixed_precision.py tests/test_optim_hooks.py \
    tests/compression/test_prf.py tests/compression/test_codecs.py tests/compression/test_lowrank.py \
    tests/anchor/test_signs.py tests/anchor/test_memory.py tests/anchor/test_forecast_damping.py tests/grpo
}

model_arg() {  # the real SmolLM2 GGUF when all its pieces came, else its architecture with random weights
  if [[ -f $S/smollm2.gguf ]]; then
    echo "$S/smollm2.gguf"
    return
  fi
  if [[ ! -f $S/smollm2-random/model.safetensors ]]; then
    $PY - "$B/smollm2-hf" "$S/smollm2-random" >&2 <<'EOF'
import shutil, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(dst)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f"{src}/{f}", dst)
EOF
  fi
  echo "$S/smollm2-random"
}

train() {
  local model
  rm -rf "$S/train_run"
  model=$(model_arg)
  echo "model: $model"
  $PY -m torch.distributed.run --standalone --nproc-per-node 1 megatron_cegrpo/train.py \
    --model "$model" --train-data mawps/singleop --prompt-template answer_is \
    --num-holdout "${NUM_HOLDOUT:-64}" --holdout-seed 1234 --eval-batch-size 64 --eval-max-new-tokens 64 \
    --pipeline-model-parallel-size 1 --micro-batch-size "${MICRO_BATCH:-8}" \
    --rollout-batch-size 4 --num-generations 8 --max-new-tokens 64 --temperature 0.7 \
    --train-iters "$TRAIN_ITERS" --lr 1e-5 --kl-coef 0 --boundary-codec dense --anchor-ranks 0 \
    --drift-probe-interval 0 --seed 1234 --bf16 \
    --deepspeed_config ds_configs/cpu_adamw.json --log-dir "$S/train_run" --no-tqdm
  cp "$S/train_run/metrics.jsonl" "$OUT_DIR/train_metrics.jsonl"
  cp "$S/train_run/summary.json" "$OUT_DIR/train_summary.json"
  $PY - "$OUT_DIR/train_metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "timing_s/step" not in r:
        continue
    keys = ("step", "timing_s/step", "timing_s/gen", "timing_s/update", "timing_s/sync",
            "perf/flops/actor", "critic/score/mean", "actor/grad_norm", "actor/pg_loss",
            "mismatch/abs_logprob_diff_mean", "eval/holdout/accuracy")
    print({k: r[k] for k in keys if k in r})
EOF
  grep -A3 '"val/holdout/acc"' "$OUT_DIR/train_summary.json"
}

export -f setup tests model_arg train
export OUT_DIR TRAIN_ITERS B S PY
for s in $SECTIONS; do
  case $s in
    env) section env 200 setup ;;
    tests) section tests 150 tests ;;
    bench) section bench 150 "$PY -m benchmarks.bench_gpu --out $OUT_DIR/bench_gpu.json && \
      $PY -m benchmarks.bench_gpu --seq-len 2048 --micro-batch 4 --out $OUT_DIR/bench_gpu_8k.json" ;;
    train) section train "${TRAIN_LIMIT:-420}" train ;;
    *) echo "unknown section $s (env, tests, bench, train)" ;;
  esac
done
