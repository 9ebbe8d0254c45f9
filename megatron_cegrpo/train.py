"""Entry point: ``deepspeed --num_gpus 2 megatron_cegrpo/train.py <flags>`` (or torchrun, or
``python -m megatron_cegrpo.train`` for PP=1). ``--help`` lists the flags.

Start-up runs in this order, every check before any process group or model exists:
parse the flags, validate them against the launch (``TrainConfig.validate(world_size)``),
then :func:`preflight` (the model, the data files, ``--load``). A mistake found there is
a :class:`~megatron_cegrpo.errors.ConfigError` (checkpoint problems are its subclass
``CheckpointError``): every rank finds the same one, rank 0 prints it as one line on
stderr, the other ranks exit quietly, and the exit status is 2. The same holds for a
ConfigError raised while the trainer is being built (printed by the rank that hit it).
Anything else shows its traceback. ``docs/reliability.md`` lists the messages.
"""

import os
import sys
import time
from functools import partial

# torch-free modules only at module top: under a launcher this process may be the rank's
# supervisor, which runs the rank in a child and must stay small; modules that import torch
# or megatron-core are imported after ``bootstrap()`` (megatron-core warns at import).
from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.bootstrap import bootstrap
from megatron_cegrpo.errors import ConfigError, one_line
from megatron_cegrpo.supervisor import should_supervise, supervise

#: Exit status of a configuration error (argparse's convention for usage errors).
EXIT_CONFIG_ERROR = 2
#: Seconds a rank other than 0 waits before it exits after an error every rank found before
#: any process group exists: a launcher stops every rank as soon as one exits non-zero, so
#: rank 0 must exit first, after printing the line (the launcher then ends the waiting ranks).
QUIET_RANK_EXIT_DELAY_S = 20.0


def _launch_rank() -> int:
    """This process's global rank as the launcher set it (RANK; 0 for a plain process)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _launch_world_size() -> int:
    """The number of processes the launcher started (WORLD_SIZE; 1 for a plain process)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def preflight(cfg, world_size=None):
    """Start-up checks that need files or the model config, run on every rank before any
    process group exists (each rank finds the same result, so no rank waits on another),
    ending in the run plan (``plan.resolve_plan``) they hand on.

    * ``--model`` resolves; its config fits ``--pipeline-model-parallel-size`` and the uneven
      split, ``--tensor-model-parallel-size`` divides its heads, KV heads, FFN and vocabulary,
      and ``--max-prompt-length + --max-new-tokens`` fits its positions (and vllm's KV cache);
    * ``--save`` holds no other run's checkpoints (``checkpointing.check_save_dir``);
    * the run plan (``plan.resolve_plan``): ``--boundary-codec`` built once, its parameters in
      range, its bytes within the ``--boundary-keep-ratio`` it claims (PP >= 2), and it runs at this
      data-parallel and TP size; ``--load`` (``checkpointing.decide_resume``, the one resume
      decision): a checkpoint is there unless it is the ``--save`` directory; it fits the model,
      split and codec (``check_compatible``), its files have their recorded sizes, and, when it
      continues a run, it was written at this ``--tensor-model-parallel-size`` and the trajectory
      options equal this run's (``check_resume``);
    * ``--custom-reward-function`` loads and takes ``(response, ground_truth)``;
    * ``--train-data`` resolves and loads, ``--num-holdout`` leaves a training prompt, and
      at least one prompt fits ``--max-prompt-length`` (``data.check_train_data``); every
      ``--eval-datasets`` file exists.

    Args:
        world_size: the launch's ranks (default: WORLD_SIZE, as the launcher set it).
    Returns:
        the :class:`~megatron_cegrpo.plan.RunPlan`.
    Raises:
        ConfigError: (or its subclasses DatasetError, CheckpointError) naming the flag and the fix.
    """
    from megatron_cegrpo import checkpointing as ck
    from megatron_cegrpo.data import check_eval_data, check_train_data, encode_prompt
    from megatron_cegrpo.models import load_hf_config, load_tokenizer, resolve_model
    from megatron_cegrpo.models.builder import check_model_config
    from megatron_cegrpo.plan import resolve_plan

    source = resolve_model(cfg.model.model)  # ConfigError naming the accepted forms
    try:
        hf_config = load_hf_config(source)
        tokenizer = load_tokenizer(source)
    except (ValueError, OSError) as e:
        raise ConfigError(f"--model {cfg.model.model}: cannot read its config or tokenizer ({one_line(e)}); "
                          "fix: pass a complete HF directory (config.json, tokenizer files, *.safetensors) "
                          "or a .gguf file") from None
    p = cfg.parallel
    check_model_config(hf_config, p.pipeline_model_parallel_size, p.decoder_first_pipeline_num_layers,
                       p.decoder_last_pipeline_num_layers, tensor_model_parallel_size=p.tensor_model_parallel_size)
    positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    r = cfg.rollout
    if positions and r.max_prompt_length + r.max_new_tokens > positions:
        raise ConfigError(
            f"--max-prompt-length {r.max_prompt_length} + --max-new-tokens {r.max_new_tokens} = "
            f"{r.max_prompt_length + r.max_new_tokens} tokens exceeds the {positions} positions of --model "
            f"{cfg.model.model}; fix: lower one of them so that their sum is at most {positions}")

    _check_rollout_engine(cfg, hf_config)
    c = cfg.checkpoint
    if c.save:
        ck.check_save_dir(c.save, c.load)
    # the layout, the codec (built once, its parameters' ranges, capabilities and bytes checked) and
    # the resume decision (here also checking the listed checkpoint files' sizes): the run plan the
    # trainer gets, before the slower data checks below tokenize every prompt
    plan = resolve_plan(cfg, _launch_world_size() if world_size is None else world_size, hf_config,
                        verify_sizes=True)
    d = cfg.data

    encode = partial(encode_prompt, tokenizer, template=d.prompt_template)

    if d.custom_reward_function:
        from megatron_cegrpo.rewards.custom import load_custom_reward_function

        load_custom_reward_function(d.custom_reward_function)  # RewardError: file, name, signature
    check_train_data(d.train_data, format=d.train_data_format, num_holdout=d.num_holdout,
                     seed=cfg.holdout_split_seed, data_root=d.data_root, encode=encode,
                     max_prompt_length=r.max_prompt_length)
    if d.eval_datasets:
        from megatron_cegrpo.evaluation import parse_dataset_specs

        check_eval_data(list(parse_dataset_specs(d.eval_datasets)), d.data_root)

    return plan


def _check_rollout_engine(cfg, hf_config) -> None:
    """``--rollout-engine vllm``: ``--rollout-kv-cache-mb`` holds one longest sequence (vLLM would
    refuse to start only after loading the model). Raises ConfigError naming the flag."""
    r = cfg.rollout
    if r.engine != "vllm":
        return
    from megatron_cegrpo.rollout.vllm_config import check_kv_cache, max_model_len

    positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    check_kv_cache(hf_config, r.dtype, r.kv_cache_mb,
                   max_model_len(r.max_prompt_length, r.max_new_tokens, cfg.data.eval_max_new_tokens, positions))


def _validated_config(argv, world_size: int):
    """Flags -> the TrainConfig, every flag and combination checked against a launch of
    ``world_size`` ranks (``TrainConfig.validate``). Raises ConfigError naming the flag."""
    cfg = build_config(parse_args(argv))
    cfg.validate(world_size=world_size)
    return cfg


def _configure(argv):
    """Flags -> ``(cfg, plan)``: the validated TrainConfig and its run plan, every start-up check
    done (see :func:`preflight`), and no killed build's lock on a DeepSpeed op this rank loads, on
    which its optimizer would wait forever (``optim.jit_ops.check_build_locks``)."""
    from megatron_cegrpo.optim.jit_ops import check_build_locks

    cfg = _validated_config(argv, _launch_world_size())
    _resume_on_restart(cfg)
    plan = preflight(cfg)
    check_build_locks()
    return cfg, plan


def check_flags(argv, world_size: int) -> int:
    """:func:`main`'s start-up checks up to the run plan for the flags in ``argv`` (parse,
    ``validate(world_size)``, :func:`preflight`; not the DeepSpeed op build locks, nor what only
    building the process groups or the trainer can find), without starting anything: what ``DRY_RUN=1
    examples/study_cpu.sh`` runs for each arm, so that a mistyped arm or flag fails before a queue of
    arms is started, not at its turn.

    Args:
        argv: the flags after ``train.py``; world_size: the ranks the launch would start
            (PP x DP x TP + anchor ranks).
    Returns:
        0 when a launch would pass start-up; :data:`EXIT_CONFIG_ERROR` after printing the
        ConfigError's one line on stderr (``[cegrpo] error: ...``).
    """
    bootstrap(cpu_compat=True)
    try:
        preflight(_validated_config(argv, world_size), world_size)
    except ConfigError as e:
        return _report(e, 0, every_rank_knows=False)
    return 0


def _resume_on_restart(cfg) -> None:
    """A start that torchrun's elastic agent made after a rank died (``--max-restarts``): load the
    newest complete checkpoint under ``--save`` (``restart.restart_load_dir``), said in one line by
    rank 0; a first start, or a launch without restarts, is left as it is."""
    from megatron_cegrpo.restart import elastic_restarts, restart_load_dir

    r = elastic_restarts()
    if r is None or not r.restarted:
        return
    c = cfg.checkpoint
    c.load = restart_load_dir(c.save, c.load)
    if _launch_rank() == 0:
        if not c.save:
            what = "no --save, so nothing to resume: starting over from " + (f"--load {c.load}" if c.load else
                                                                             "iteration 0")
        elif c.load != c.save:
            what = f"no checkpoint under --save {c.save} yet: starting over from --load {c.load}"
        else:
            from megatron_cegrpo.checkpointing import has_checkpoint

            what = (f"resuming from the newest complete checkpoint in {c.save}" if has_checkpoint(c.save) else
                    f"no checkpoint under --save {c.save} yet: starting over from iteration 0")
        print(f"[cegrpo] restart {r.count} of {r.max} (torchrun --max-restarts): {what}", flush=True)


def _report(err: BaseException, rank: int, every_rank_knows: bool, wait=None) -> int:
    """Print a configuration error as one line on stderr and return the exit status.

    ``every_rank_knows``: every rank raised the same error: rank 0 prints it, the others
    print nothing and call ``wait()`` before they return, so that they never exit before
    rank 0 has printed (a launcher ends every rank once one exits non-zero). Otherwise the
    rank that hit it prints it, naming itself when it is not rank 0.
    """
    if rank == 0 or not every_rank_knows:
        who = "" if rank == 0 else f" (rank {rank})"
        print(f"[cegrpo] error{who}: {one_line(err)}", file=sys.stderr, flush=True)
    if every_rank_knows and wait is not None:
        wait()
    return EXIT_CONFIG_ERROR


def _linger() -> None:
    """Before any process group exists, a rank other than 0 can only give rank 0 time."""
    if _launch_rank() != 0:
        time.sleep(QUIET_RANK_EXIT_DELAY_S)


def main(argv=None) -> int:
    """Train with the flags in ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        0 when training finished; 2 (:data:`EXIT_CONFIG_ERROR`) after a configuration or
        checkpoint error at start-up, printed as one line on stderr (``[cegrpo] error: ...``)
        by rank 0 when every rank found it, else by the rank that did.
    Raises:
        anything unexpected, and any error once training has started, with its traceback.
    """
    if argv is None and should_supervise():  # under a launcher: run this rank's work in a supervised child
        return supervise()  # (the supervisor imports no torch; the child bootstraps itself)
    bootstrap(cpu_compat=True)  # first thing a rank does: known warnings off, CPU compatibility layer
    rank = _launch_rank()
    try:
        cfg, plan = _configure(argv)
    except ConfigError as e:
        return _report(e, rank, every_rank_knows=True, wait=_linger)

    from megatron_cegrpo.initialize import initialize_distributed, shutdown_distributed

    try:
        ctx = initialize_distributed(cfg.parallel.pipeline_model_parallel_size, cfg.optim.seed,
                                     cfg.parallel.num_threads, anchor_ranks=cfg.anchor.anchor_ranks,
                                     timeout_minutes=cfg.parallel.distributed_timeout_minutes,
                                     tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size)
    except ConfigError as e:
        shutdown_distributed()
        return _report(e, rank, every_rank_knows=True, wait=_linger)
    from megatron_cegrpo import heartbeat

    timeout_s = heartbeat.heartbeat_timeout_s(cfg.parallel.heartbeat_timeout_minutes)
    if timeout_s is not None and ctx.world_size > 1:  # a hung peer or a dropped link ends in a restart
        heartbeat.start_heartbeat(ctx, timeout_s)
    finished = False
    try:
        if ctx.is_anchor:
            from megatron_cegrpo.anchor.runner import run_anchor

            run_anchor(cfg, ctx, plan)
        else:
            from megatron_cegrpo.training import GRPOTrainer

            try:
                trainer = GRPOTrainer(cfg, ctx, plan)
            except ConfigError as e:  # agreed by every stage (checkpoint loading), or this rank's own
                import torch.distributed as dist

                return _report(e, ctx.rank, every_rank_knows=getattr(e, "agreed", False),
                               wait=lambda: dist.barrier(group=ctx.pp_group))
            try:
                trainer.train()
            except ConfigError as e:  # a reward function's bad value, found by the driver
                return _report(e, ctx.rank, every_rank_knows=False)
        finished = True
    finally:
        heartbeat.stop_heartbeat(done=finished)
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
