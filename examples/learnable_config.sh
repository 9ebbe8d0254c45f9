# The learnable CPU configuration that issue 11's study found (docs/study.md, "The configuration,
# and how it was chosen"): dense GRPO on it raises SmolLM2-135M-Instruct's held-out greedy
# accuracy by 3.9 (seed 1234) and 2.7 (seed 4321) standard errors in 48 iterations. Sourced by
# examples/study_cpu.sh (the study's arms) and examples/run_smollm2_mawps.sh (`make demo`, a
# short run of one arm), so that both run the same job; the environment overrides every value.
# shellcheck shell=bash
: "${TRAIN_DATA:=mawps/singleop}"    # ../shared/data/mawps/singleop.jsonl
: "${TEMPLATE:=answer_is}"           # "... The answer is <number>." (megatron_cegrpo/data/templates.py)
: "${NUM_HOLDOUT:=300}"              # rows held out of TRAIN_DATA for the greedy evaluation
: "${HOLDOUT_SEED:=1234}"            # the same 300 rows whatever the run's --seed
: "${MAX_NEW_TOKENS:=64}"
: "${EVAL_MAX_NEW_TOKENS:=$MAX_NEW_TOKENS}"
: "${EVAL_BATCH:=32}"
: "${ROLLOUT_BATCH:=4}"              # prompts per iteration
: "${GROUP:=8}"                      # responses per prompt (G)
: "${LR:=1e-5}"                      # every study arm's (dense's too), unless the arm names another
# the main job's (examples/run_smollm2_mawps.sh, an anchor rank folding sign(M) into every step): LR / 1.7.
# With the fold, the gradient's sign is sign(M) on every coordinate, so Adam moves each weight about lr a
# step; at LR the folded arms moved 1.3-2.0x as far as dense in 48 iterations (mean 1.7), at 6e-6 as far
# (docs/anchor.md, "What the fold does to Adam"; the study's arm pcaq/every=2:lrq_anchor_lr6e-6)
: "${FOLD_LR:=6e-6}"
: "${TEMPERATURE:=0.7}"
: "${KEEP_RATIO:=0.05}"              # the boundary's share of coordinates (k = ceil(0.05 d))
# no KL term (the seeds' runs): no reference model, so no actor/kl_loss; KL_COEF=0.001 adds the
# reference forward pass (about 15 % of a step)
: "${KL_COEF:=0}"
# precision (issue 29): where the host computes bf16 natively (AMX or AVX512-BF16 CPUs, GPUs),
# bf16 passes and boundaries over fp32 master weights and Adam moments (--bf16); elsewhere fp32
# passes, as the study's first arms ran (PyTorch emulates bf16 on an AVX2-only CPU, 45-75x slower:
# megatron_cegrpo/compat/precision.py). The sampler holds bf16 weights either way (the default
# --rollout-dtype bf16, synced by changed entries) and computes in bf16 only where it is native.
# PRECISION_FLAGS="" forces fp32 passes, PRECISION_FLAGS="--bf16" forces bf16 passes.
: "${PRECISION_FLAGS=$("${PYTHON:-python}" -m megatron_cegrpo.compat.precision 2>/dev/null)}"
