"""Compatibility and resume rules: may this run load, resume from or write to a checkpoint?

Owns the decisions made at start-up, each raising a
:class:`~megatron_cegrpo.checkpointing.format.CheckpointError` that names the mismatch and
the fix: :func:`check_compatible` (model shape, pipeline split, boundary codec),
:func:`check_resume` (the run options that shape the training trajectory, and
``--train-iters``), :func:`find_resume_checkpoint` (what ``--load`` resumes from, or a
fresh start), :func:`decide_resume` (the resume decision: all of these for one ``--load``, in
one place, for the start-up checks and for the stages' loading) and :func:`check_save_dir`
(``--save`` holds no other run's checkpoints).
Reads meta.json through :mod:`~megatron_cegrpo.checkpointing.format`; no file writes, no
``torch.distributed``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from megatron_cegrpo.checkpointing.format import (
    CONVERT_TOOL,
    LATEST_FILE,
    CheckpointError,
    _config_dict,
    _meta_path,
    continues_run,
    has_checkpoint,
    list_checkpoints,
    normalize_codec,
    read_meta,
    resolve_load_dir,
    verify_checkpoint,
)

#: Config fields that define the parameter shapes / the computation (checked on resume).
MODEL_SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def _convert_cmd(meta: dict, pp_size: int, first, last) -> str:
    """The ``convert.py`` command that re-splits the checkpoint of ``meta`` for this run."""
    src = meta.get("checkpoint_dir", "<checkpoint>")
    cmd = (f"python {CONVERT_TOOL} --loader megatron --saver megatron --load-dir {src} "
           f"--save-dir <new dir> --target-pp-size {pp_size}")
    if first is not None:
        cmd += f" --target-decoder-first-pipeline-num-layers {first}"
    if last is not None:
        cmd += f" --target-decoder-last-pipeline-num-layers {last}"
    return cmd


def check_compatible(
    meta: dict,
    *,
    hf_config,
    pp_size: int,
    num_layers_in_first: Optional[int] = None,
    num_layers_in_last: Optional[int] = None,
    codec=None,
) -> None:
    """Raise CheckpointError if the checkpoint does not fit this run.

    * model: the :data:`MODEL_SHAPE_FIELDS` of ``hf_config`` (object or dict) must equal the
      checkpoint's (lists every differing field);
    * pipeline: ``pp_size`` and the uneven split must equal the checkpoint's; the message
      gives the ``convert.py --target-pp-size N`` command that re-splits it;
    * codec (only when both ``codec`` and the checkpoint's codec are given; converted
      checkpoints have none): same name and keep_ratio.
    """
    where = _meta_path(meta)
    ck = meta["hf_config"]
    run = _config_dict(hf_config)
    diffs = [f"{k}: checkpoint {ck.get(k)!r}, this run {run.get(k)!r}"
             for k in MODEL_SHAPE_FIELDS if ck.get(k) != run.get(k)]
    if diffs:
        raise CheckpointError(
            f"{where}: the checkpoint holds another model ({meta.get('model_name')!r}): " + "; ".join(diffs)
            + ". Fix: run with the --model the checkpoint was trained from, or pass a checkpoint of this model"
        )
    ck_split = (int(meta["pp_size"]), meta.get("num_layers_in_first"), meta.get("num_layers_in_last"))
    run_split = (int(pp_size), num_layers_in_first, num_layers_in_last)
    if ck_split != run_split:
        raise CheckpointError(
            f"{where}: the checkpoint was saved with pipeline-model-parallel size {ck_split[0]} "
            f"(first/last stage layers {ck_split[1]}/{ck_split[2]}), this run uses {run_split[0]} "
            f"(first/last {run_split[1]}/{run_split[2]}); convert it with {CONVERT_TOOL} "
            f"--target-pp-size {pp_size}: " + _convert_cmd(meta, pp_size, num_layers_in_first, num_layers_in_last)
        )
    ck_codec, run_codec = meta.get("codec"), normalize_codec(codec)
    if ck_codec is not None and run_codec is not None:
        ck_codec = normalize_codec(ck_codec)
        if ck_codec != run_codec:
            def fmt(c):
                return c["name"] + ("" if c["keep_ratio"] is None else f" (keep ratio {c['keep_ratio']:g})")

            flags = f"--boundary-codec {ck_codec['name']}"
            if ck_codec["keep_ratio"] is not None:
                flags += f" --boundary-keep-ratio {ck_codec['keep_ratio']:g}"
            raise CheckpointError(
                f"{where}: the checkpoint was trained with boundary codec {fmt(ck_codec)}, this run uses "
                f"{fmt(run_codec)}; fix: resume with {flags}, or start a new run from its weights "
                f"(export them with {CONVERT_TOOL} --loader megatron --saver megatron, which drops the codec)"
            )


def find_resume_checkpoint(load_dir: str, save_dir: Optional[str] = None) -> Optional[Tuple[str, int]]:
    """What ``--load load_dir`` resumes from: ``(checkpoint directory, iteration)``, or None
    for a fresh start.

    None only when ``load_dir`` is the run's own ``save_dir`` (same absolute path) and holds
    no checkpoint yet: ``--save X --load X`` starts fresh and resumes automatically later.

    Raises:
        CheckpointError: ``load_dir`` differs from ``save_dir`` and holds no checkpoint (a
            typo would otherwise silently start a new run; names the path and the fix), and
            everything :func:`resolve_load_dir` / :func:`read_meta` raise.
    """
    same = save_dir is not None and os.path.abspath(os.path.expanduser(load_dir)) == \
        os.path.abspath(os.path.expanduser(save_dir))
    if not has_checkpoint(load_dir):
        if same:
            return None
        what = "does not exist" if not os.path.exists(load_dir) else (
            "is not a directory" if not os.path.isdir(load_dir) else
            f"holds no checkpoint (no '{LATEST_FILE}' file, no committed iter_XXXXXXX directory)")
        raise CheckpointError(
            f"--load {load_dir} {what}; fix: check the path (pass a run's --save directory or one of its "
            "iter_XXXXXXX directories), or pass the same directory as --save to start fresh and resume "
            "automatically next time"
        )
    ckpt_dir, it = resolve_load_dir(load_dir)
    read_meta(ckpt_dir)
    return ckpt_dir, it


def check_save_dir(save_dir: str, load_dir: Optional[str] = None) -> None:
    """A run may write into ``save_dir`` only if it holds no checkpoint yet, or if the run
    resumes from it (``load_dir`` is ``save_dir`` or one of its ``iter_`` directories).

    Otherwise the new run's checkpoints would mix with another run's: ``latest`` would
    jump between them and ``--keep-last`` (newest by iteration) would prune the new ones.

    Raises:
        CheckpointError: naming the directory, its newest checkpoint and the fix.
    """
    if not has_checkpoint(save_dir):
        return
    save = os.path.abspath(os.path.expanduser(save_dir))
    if load_dir is not None:
        load = os.path.abspath(os.path.expanduser(load_dir))
        if load == save or os.path.dirname(load) == save:
            return
    newest = list_checkpoints(save_dir)
    what = f"checkpoints up to {os.path.basename(newest[-1][1])}" if newest else "a checkpoint"
    raise CheckpointError(
        f"--save {save_dir} already holds {what} of another run; fix: add --load {save_dir} to resume "
        "that run, or pass an empty or new --save directory"
    )


def _fmt_option(value) -> str:
    """An option value as shown in error messages (floats exactly, None as "(not given)")."""
    if value is None:
        return "(not given)"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _option_fix(flag: str, value) -> str:
    """How to pass ``flag`` with ``value`` on the command line (a boolean is a switch, recorded as
    whether it is given: ``--shared-prefix``, ``--no-norm-adv-by-std``)."""
    if isinstance(value, bool) and flag.startswith("--"):
        return f"{'add' if value else 'drop'} {flag}"
    if value is None:
        return f"drop {flag}"
    if not flag.startswith("--"):
        return f"set {flag} to {_fmt_option(value)}"
    return f"{flag} {_fmt_option(value)}"


def check_resume(meta: dict, options: Dict[str, Any], *, train_iters: Optional[int] = None) -> List[str]:
    """Compare the run's trajectory options with the ones the checkpoint was trained with.

    ``options``: ``{flag: value}`` (``TrainConfig.resume_options()``); ``meta``: from
    :func:`read_meta`. Flags recorded on both sides must be equal (JSON values; floats
    exactly). A flag recorded on one side only (another code version) is reported, not
    compared. Checkpoints written before options were recorded have no
    ``meta["options"]``: their ``extra`` seed and training data are compared, every other
    option is reported as unknown. The caller prints the returned warnings.

    Returns:
        warnings (one line each) about what could not be compared; empty when everything was.
    Raises:
        CheckpointError: a changed option (each with the checkpoint's value and this run's,
            and the flags that resume the checkpoint), or ``train_iters`` below the
            checkpoint's iteration.
    """
    where = _meta_path(meta)
    warnings_out: List[str] = []
    it = meta.get("iteration")
    if train_iters is not None and it is not None and int(it) > int(train_iters):
        raise CheckpointError(
            f"{where}: the checkpoint is at iteration {it}, past --train-iters {train_iters}; fix: pass "
            f"--train-iters {it} or more (or load an earlier checkpoint)"
        )
    run = json.loads(json.dumps(options))  # the JSON form the checkpoint holds
    recorded = meta.get("options")
    if recorded is None:
        extra = meta.get("extra") or {}
        recorded = {}
        for key, flag in (("seed", "--seed"), ("train_data", "--train-data")):
            if key in extra and flag in run:
                recorded[flag] = extra[key]
        unknown = sorted(set(run) - set(recorded))
        if unknown:
            warnings_out.append(
                f"{where} was written before run options were recorded: {', '.join(unknown)} cannot be "
                "compared with the original run; make sure they match it (a change alters the training "
                "trajectory)")
        run = {k: v for k, v in run.items() if k in recorded}
    changed = [k for k in sorted(set(run) & set(recorded)) if run[k] != recorded[k]]
    if changed:
        diffs = ", ".join(f"{k} {_fmt_option(recorded[k])} -> {_fmt_option(run[k])}" for k in changed)
        fixes = "; ".join(_option_fix(k, recorded[k]) for k in changed)
        note = (" (--train-iters may change only with --lr-decay-style constant, where it does not shape the "
                "schedule)" if "--train-iters" in changed else "")
        raise CheckpointError(
            f"{where}: this run changes options the checkpoint was trained with (checkpoint -> this run): {diffs}; "
            f"fix: resume with the checkpoint's settings ({fixes}){note}, or start a new run from its weights "
            "with another --save "
            f"(a weights-only copy: {CONVERT_TOOL} --loader megatron --saver megatron)"
        )
    # recorded on one side only: an option of another code version (the options that decide
    # whether another one has an effect are always recorded, so they were compared above)
    one_sided = sorted(set(run) ^ set(recorded))
    if one_sided:
        warnings_out.append(f"{where}: {', '.join(one_sided)} recorded on one side only (another version of "
                            "megatron_cegrpo?); not compared")
    return warnings_out


@dataclass(frozen=True)
class ResumePoint:
    """What ``--load`` starts from (:func:`decide_resume`).

    Attributes:
        ckpt_dir: the checkpoint's ``iter_XXXXXXX`` directory.
        iteration: its iteration.
        meta: its meta.json (``read_meta``).
        continues: True when it holds trainer state, so the run continues (optimizer, RNGs,
            schedule); False for a weights-only checkpoint, from which a new run starts.
        warnings: what :func:`check_resume` could not compare (one line each; the caller prints them).
    """

    ckpt_dir: str
    iteration: int
    meta: dict
    continues: bool
    warnings: Tuple[str, ...] = ()


def decide_resume(cfg, hf_config, *, verify_sizes: bool = False) -> Optional[ResumePoint]:
    """The resume decision for the run's ``--load``, made in this one place (issue 34), at start-up
    (``train.preflight``, with ``verify_sizes``) and by each stage as it loads
    (``training/checkpointer.py``): which checkpoint (:func:`find_resume_checkpoint`; None: a fresh
    start in the run's own ``--save`` directory), whether this run may load it
    (:func:`check_compatible`: model shape, pipeline split, boundary codec), whether it continues a
    run or only gives weights (``format.continues_run``), and for a continued run the
    ``--tensor-model-parallel-size`` it was written at (:func:`check_resume_tensor_parallel`) and
    the trajectory options (:func:`check_resume`).

    Args:
        cfg: the ``TrainConfig`` (``--load``, ``--save``, the pipeline split, the codec, the TP
            size, ``resume_options()``, ``--train-iters``).
        hf_config: the model's HF config.
        verify_sizes: check every listed file's presence and size too (``verify_checkpoint``
            with ``sizes_only``: the start-up check before any process group exists); else read
            meta.json only (each stage verifies its own files' hashes as it reads them).
    Raises:
        CheckpointError (a ConfigError): missing, corrupt or incompatible checkpoint, a run that
            continues at another TP size, a changed trajectory option; one line naming the fix.
    """
    p, c = cfg.parallel, cfg.checkpoint
    found = find_resume_checkpoint(c.load, c.save)
    if found is None:
        return None
    ckpt_dir, it = found
    meta = verify_checkpoint(ckpt_dir, sizes_only=True) if verify_sizes else read_meta(ckpt_dir)
    check_compatible(meta, hf_config=hf_config, pp_size=p.pipeline_model_parallel_size,
                     num_layers_in_first=p.decoder_first_pipeline_num_layers,
                     num_layers_in_last=p.decoder_last_pipeline_num_layers, codec=cfg.codec)
    if not continues_run(meta):
        return ResumePoint(ckpt_dir, it, meta, continues=False)
    check_resume_tensor_parallel(meta, p.tensor_model_parallel_size, ckpt_dir)
    return ResumePoint(ckpt_dir, it, meta, continues=True,
                       warnings=tuple(check_resume(meta, cfg.resume_options(), train_iters=cfg.optim.train_iters)))


def check_resume_tensor_parallel(meta: dict, tp_size: int, ckpt_dir: str) -> None:
    """A checkpoint that continues a run (optimizer state, reference and RNGs per TP shard) must be
    resumed at the ``--tensor-model-parallel-size`` it was written at; weights-only checkpoints load
    at any TP size (their shards are merged and re-split). Raises CheckpointError naming the flag."""
    saved = int(meta.get("tp_size", 1))
    if saved != tp_size:
        raise CheckpointError(
            f"--load {ckpt_dir} was written at --tensor-model-parallel-size {saved} and holds its optimizer state "
            f"per TP shard; it cannot continue at --tensor-model-parallel-size {tp_size}; fix: pass "
            f"--tensor-model-parallel-size {saved}, or convert it to weights only (tools/checkpoint/convert.py "
            f"--target-tp-size {tp_size}) to start a new run from it")
