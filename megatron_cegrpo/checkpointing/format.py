"""The on-disk checkpoint format: names, layout, meta.json, listing, resolving, verifying.

Owns what a checkpoint *is*: :data:`FORMAT_VERSION` and the file / directory names,
:class:`CheckpointError`, building and reading meta.json (:func:`make_meta`,
:func:`read_meta`, :func:`hf_config_from_meta`, :func:`normalize_codec` for its ``codec``
field), finding checkpoints (:func:`list_checkpoints`, :func:`has_checkpoint`,
:func:`resolve_load_dir`, which follows ``latest``) and checking files against meta.json
(:func:`verify_checkpoint`, :func:`stage_file_names`).  Reading and writing the stage
files is :mod:`~megatron_cegrpo.checkpointing.stage_files`; publishing a save is
:mod:`~megatron_cegrpo.checkpointing.commit`.  No ``torch.distributed`` here.

Layout (one checkpoint = one directory)
---------------------------------------
::

    <save_dir>/latest                          text "iter_0000012" (no newline needed), the
                                               committed checkpoint to resume from; always
                                               replaced atomically (tmp file + os.replace)
    <save_dir>/iter_0000012/meta.json          see "meta.json" below; written last, before
                                               the directory gets its final name
    <save_dir>/iter_0000012/stage_00/model.safetensors
                                               the stage's parameters: megatron names with
                                               stage-local layer indices, exactly the keys of
                                               ``build_stage(...).state_dict()`` minus
                                               ``*._extra_state`` (no ``module.`` prefix);
                                               dtype as held by the model (fp32 or bf16);
                                               the last stage of a tied model with pp > 1
                                               holds its own ``output_layer.weight`` copy
    <save_dir>/iter_0000012/stage_00/model_tp01.safetensors
                                               with tensor parallelism (meta ``tp_size`` > 1)
                                               each TP rank's shard of the stage instead of
                                               model.safetensors: ``model_tpRR`` for RR = 00 ..
                                               tp_size - 1 (:func:`model_file_name`; layout
                                               ``models/tp_shard.py``)
    <save_dir>/iter_0000012/stage_00/<name>.safetensors   extra tensor dicts (reference
                                               weights, ...) written by the trainer
    <save_dir>/iter_0000012/stage_00/<name>.pt plain-object blobs (optimizer state, RNG
                                               states, data position, ...), loadable with
                                               ``torch.load(weights_only=True)``
    <save_dir>/iter_0000012/tokenizer/...      optional: tokenizer files (the conversion
                                               tool writes them when its source had one)
    <save_dir>/iter_0000012.tmp-<id>/          a save in progress (or one that crashed);
                                               never loaded, removed by the next commit

meta.json
---------
``format_version`` (int, :data:`FORMAT_VERSION`), ``iteration`` (int), ``pp_size`` (int),
``num_layers_in_first`` / ``num_layers_in_last`` (int or null: the uneven split flags
``--decoder-first/last-pipeline-num-layers``), ``hf_config`` (the model's
``PretrainedConfig.to_dict()``), ``model_name`` (``--model`` as given, or the conversion
source; may be null), ``codec`` (``{"name": str, "keep_ratio": float|null}`` or null for a
codec-independent checkpoint such as a converted one), ``params_dtype`` (str or null),
``extra`` (any JSON the caller passed, e.g. the trainer's consumed-sample counter),
``tp_size`` (int, only when > 1: the model files are TP shards; absent means 1),
``options`` (``{flag: value}`` of the run options that shape the training trajectory, see
``TrainConfig.resume_options``; absent in converted checkpoints and in those written
before it was recorded), ``created`` (UTC ISO time) and ``files``: ``{relative path: {"sha256": hex, "bytes": int}}``
for every file of the checkpoint except meta.json itself.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_cegrpo.checkpointing import atomic
from megatron_cegrpo.errors import ConfigError

FORMAT_VERSION = 1
LATEST_FILE = "latest"
META_FILE = "meta.json"
MODEL_FILE = "model"  # stage file holding the stage's parameters: stage_XX/model.safetensors
TOKENIZER_DIR = "tokenizer"
CONVERT_TOOL = "tools/checkpoint/convert.py"
#: Pass as ``pp_rank`` to the stage-file functions to address the anchor rank's files,
#: ``<checkpoint>/anchor/<name>.pt`` (the anchor holds no pipeline stage).
ANCHOR = "anchor"
ANCHOR_DIR = "anchor"

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TMP_RE = re.compile(r"^iter_\d{7,}\.tmp-")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class CheckpointError(ConfigError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run.

    The message names the file or directory, the mismatch / corruption and the fix. A
    :class:`~megatron_cegrpo.errors.ConfigError` (and so a ``ValueError``): raised at
    start-up, the entry point prints it as one line and exits with status 2.
    """


# ----------------------------------------------------------------------------- names


def iter_dir_name(iteration: int) -> str:
    """``iter_0000012`` for iteration 12 (at least 7 digits)."""
    iteration = int(iteration)
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def stage_dir_name(pp_rank: int) -> str:
    """``stage_00`` for pipeline rank 0."""
    return f"stage_{int(pp_rank):02d}"


def model_file_name(tp_rank: int = 0, tp_size: int = 1) -> str:
    """The stage file holding TP rank ``tp_rank``'s parameters: :data:`MODEL_FILE` without tensor
    parallelism, ``model_tpRR`` (RR = ``tp_rank``, two digits) with ``tp_size`` > 1."""
    if not 0 <= int(tp_rank) < int(tp_size):
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    return MODEL_FILE if int(tp_size) == 1 else f"{MODEL_FILE}_tp{int(tp_rank):02d}"


def tp_file_name(name: str, tp_rank: int = 0, tp_size: int = 1) -> str:
    """A per-TP-rank stage file: ``name`` without tensor parallelism, ``name_tpRR`` (RR = ``tp_rank``,
    two digits) with ``tp_size`` > 1 (the trainer's ``reference`` and ``trainer_state`` of each TP
    rank, as :func:`model_file_name` names its model shard).

    Raises:
        ValueError: ``tp_rank`` outside ``0 .. tp_size - 1``.
    """
    if not 0 <= int(tp_rank) < int(tp_size):
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    return name if int(tp_size) == 1 else f"{name}_tp{int(tp_rank):02d}"


def continues_run(meta: dict, name: str = "trainer_state") -> bool:
    """Whether the checkpoint holds stage 0's trainer state blob (``name.pt``, or ``name_tp00.pt``
    at TP > 1): it continues a run, unlike a weights-only (converted) checkpoint."""
    names = stage_file_names(meta, 0)
    return f"{name}.pt" in names or f"{name}_tp00.pt" in names


def _file_name(name: str, ext: str) -> str:
    """``name`` + ``ext`` (``ext`` not doubled); ValueError unless ``name`` is a plain file name."""
    if name.endswith(ext):
        name = name[: -len(ext)]
    if not _NAME_RE.match(name) or ".tmp-" in name:
        raise ValueError(
            f"checkpoint file name {name!r} must be letters, digits, '_', '.', '-' "
            "(no path separators, not starting with '.')"
        )
    return name + ext


def _stage_path(ckpt_dir: str, pp_rank, name: str, ext: str) -> str:
    """``<ckpt_dir>/stage_XX/<name><ext>`` (or ``<ckpt_dir>/anchor/...`` for :data:`ANCHOR`)."""
    if pp_rank == ANCHOR:
        return os.path.join(ckpt_dir, ANCHOR_DIR, _file_name(name, ext))
    if int(pp_rank) < 0:
        raise ValueError(f"pp_rank must be >= 0, got {pp_rank}")
    return os.path.join(ckpt_dir, stage_dir_name(pp_rank), _file_name(name, ext))


def _check_tmp_dir(tmp_dir: str) -> None:
    """Raise unless ``tmp_dir`` is an existing directory made by ``begin_save``."""
    if not _TMP_RE.match(os.path.basename(os.path.normpath(tmp_dir))):
        raise ValueError(f"{tmp_dir} is not a directory returned by begin_save()")
    if not os.path.isdir(tmp_dir):
        raise CheckpointError(f"{tmp_dir}: the save directory has disappeared (was it committed "
                              "already, or removed as stale by another job writing to the same --save?)")


# ----------------------------------------------------------------------------- meta


def _config_dict(hf_config) -> dict:
    """A ``PretrainedConfig`` (or dict) as a JSON-clean dict, as stored in meta.json."""
    if hf_config is None:
        raise ValueError("hf_config is required")
    if isinstance(hf_config, dict):
        d = dict(hf_config)
    else:
        d = json.loads(hf_config.to_json_string(use_diff=False))
    return json.loads(json.dumps(d))  # JSON-clean


def normalize_codec(codec) -> Optional[Dict[str, Any]]:
    """``{"name": str, "keep_ratio": float|None}`` (or None) from a codec description: None, a
    codec name, a dict with ``name`` (and ``keep_ratio``, as the meta stores it) or the run's
    ``arguments.CodecConfig`` (``boundary_codec`` / ``boundary_keep_ratio``). ``keep_ratio`` is
    dropped (None) for ``dense``, which keeps everything.

    Raises:
        TypeError: any other object, or an empty name.
    """
    from megatron_cegrpo.arguments import CodecConfig

    if codec is None:
        return None
    if isinstance(codec, str):
        name, ratio = codec, None
    elif isinstance(codec, dict):
        name, ratio = codec.get("name"), codec.get("keep_ratio")
    elif isinstance(codec, CodecConfig):
        name, ratio = codec.boundary_codec, codec.boundary_keep_ratio
    else:
        raise TypeError(f"cannot read a codec name from {codec!r}: pass a name, a dict or the run's CodecConfig")
    if not isinstance(name, str) or not name:
        raise TypeError(f"codec name must be a non-empty string, got {name!r}")
    if name == "dense":
        ratio = None
    return {"name": name, "keep_ratio": None if ratio is None else float(ratio)}


def make_meta(
    *,
    hf_config,
    pp_size: int,
    num_layers_in_first: Optional[int] = None,
    num_layers_in_last: Optional[int] = None,
    codec=None,
    model_name: Optional[str] = None,
    params_dtype=None,
    extra: Optional[dict] = None,
    options: Optional[Dict[str, Any]] = None,
    tp_size: int = 1,
) -> Dict[str, Any]:
    """The caller's part of meta.json, to pass to :func:`commit_save`.

    ``hf_config``: a ``PretrainedConfig`` (or its dict); ``codec``: see
    :func:`normalize_codec` (None: the checkpoint fits any codec); ``params_dtype``: a
    torch dtype or string, informative; ``extra``: any JSON-serialisable dict;
    ``options``: ``{flag: value}`` of the run options that shape the training trajectory
    (``TrainConfig.resume_options()``), stored as ``meta["options"]`` and compared on
    resume by :func:`check_resume` (omitted when None: e.g. converted, weights-only
    checkpoints); ``tp_size``: the model files are that many TP shards (stored only when > 1). ``format_version``, ``iteration``, ``files`` and ``created`` are added
    by the commit. Raises TypeError/ValueError for values JSON cannot hold.
    """
    if int(pp_size) < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if int(tp_size) < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if extra is not None:
        json.dumps(extra)  # fail early, before any file is written
    if options is not None:
        json.dumps(options, allow_nan=False)
    if isinstance(params_dtype, torch.dtype):
        params_dtype = str(params_dtype).replace("torch.", "")
    meta = {
        "pp_size": int(pp_size),
        "num_layers_in_first": None if num_layers_in_first is None else int(num_layers_in_first),
        "num_layers_in_last": None if num_layers_in_last is None else int(num_layers_in_last),
        "hf_config": _config_dict(hf_config),
        "model_name": model_name,
        "codec": normalize_codec(codec),
        "params_dtype": params_dtype,
        "extra": dict(extra or {}),
    }
    if options is not None:
        meta["options"] = dict(options)
    if int(tp_size) > 1:
        meta["tp_size"] = int(tp_size)
    return meta


_REQUIRED_META = ("pp_size", "num_layers_in_first", "num_layers_in_last", "hf_config")


def hf_config_from_meta(meta: dict):
    """Rebuild the ``transformers`` config object stored in ``meta["hf_config"]``."""
    from transformers import AutoConfig

    d = dict(meta["hf_config"])
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise CheckpointError(
            f"{_meta_path(meta)}: hf_config has no model_type; the checkpoint was not written "
            "by megatron_cegrpo.checkpointing. Re-create it with " + CONVERT_TOOL
        )
    return AutoConfig.for_model(model_type, **d)


def _meta_path(meta: dict) -> str:
    """Where ``meta`` was read from (its meta.json path), for error messages."""
    d = meta.get("checkpoint_dir")
    return os.path.join(d, META_FILE) if d else META_FILE


# ----------------------------------------------------------------------------- load


def list_checkpoints(save_dir: str) -> List[Tuple[int, str]]:
    """Committed checkpoints under ``save_dir`` as sorted ``[(iteration, path)]``.

    Only ``iter_XXXXXXX`` directories holding a meta.json count; ``.tmp-*`` never do.
    """
    out = []
    if not os.path.isdir(save_dir):
        return out
    for entry in os.listdir(save_dir):
        m = _ITER_RE.match(entry)
        full = os.path.join(save_dir, entry)
        if m and os.path.isfile(os.path.join(full, META_FILE)):
            out.append((int(m.group(1)), full))
    return sorted(out)


def has_checkpoint(load_dir: str) -> bool:
    """True if :func:`resolve_load_dir` has something to resolve (``latest``, a committed
    ``iter_`` directory, or ``load_dir`` is itself one).  Lets a trainer start fresh when
    ``--load`` is empty while every real problem still raises in resolve_load_dir."""
    if not os.path.isdir(load_dir):
        return False
    if os.path.isfile(os.path.join(load_dir, META_FILE)):
        return True
    return os.path.exists(os.path.join(load_dir, LATEST_FILE)) or bool(list_checkpoints(load_dir))


def _others_hint(save_dir: str, exclude: Optional[str] = None) -> str:
    """Names the other complete checkpoints in ``save_dir``, for the fix of an error message."""
    others = [p for _, p in list_checkpoints(save_dir) if os.path.abspath(p) != os.path.abspath(exclude or "")]
    if not others:
        return "no other complete checkpoint exists there"
    return "complete checkpoints there: " + ", ".join(os.path.basename(p) for p in others)


def resolve_load_dir(load_dir: str) -> Tuple[str, int]:
    """``(checkpoint directory, iteration)`` for ``load_dir``.

    ``load_dir`` is either a save root (``latest`` is followed; when it is absent, the
    newest committed ``iter_`` directory is used, which only happens after a crash
    between the first commit's rename and its ``latest`` write) or a committed
    ``iter_XXXXXXX`` directory itself.  Raises CheckpointError when the path does not
    exist, is a ``.tmp-*`` directory (an unfinished save), ``latest`` is malformed or
    names a missing / incomplete directory, or there is no checkpoint at all.
    """
    load_dir = os.path.abspath(os.path.expanduser(load_dir))
    base = os.path.basename(load_dir)
    if ".tmp-" in base:
        raise CheckpointError(
            f"{load_dir} is the temporary directory of an unfinished (interrupted) save and is never "
            f"loaded; fix: load the save directory {os.path.dirname(load_dir)} (follows 'latest') or "
            "one of its committed iter_XXXXXXX directories"
        )
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"{load_dir}: no such checkpoint directory; fix: pass an existing --load directory")
    if _ITER_RE.match(base) or os.path.isfile(os.path.join(load_dir, META_FILE)):
        if not os.path.isfile(os.path.join(load_dir, META_FILE)):
            raise CheckpointError(
                f"{load_dir} is incomplete: it has no {META_FILE} (written last by every save); "
                f"fix: load another checkpoint ({_others_hint(os.path.dirname(load_dir), load_dir)})"
            )
        meta = read_meta(load_dir)
        return load_dir, int(meta["iteration"])
    latest = os.path.join(load_dir, LATEST_FILE)
    if os.path.exists(latest):
        with open(latest) as f:
            name = f.read().strip()
        if not _ITER_RE.match(name):
            raise CheckpointError(
                f"{latest} holds {name[:40]!r}, expected a name like 'iter_0000012'; fix: write the name "
                f"of a complete checkpoint into it ({_others_hint(load_dir)})"
            )
        target = os.path.join(load_dir, name)
        if not os.path.isdir(target):
            raise CheckpointError(
                f"{latest} points to {name}, which does not exist in {load_dir}; fix: write the name of "
                f"a complete checkpoint into {latest} or pass that directory as --load "
                f"({_others_hint(load_dir)})"
            )
        if not os.path.isfile(os.path.join(target, META_FILE)):
            raise CheckpointError(
                f"{latest} points to {name}, which is incomplete (no {META_FILE}); fix: write the name of "
                f"a complete checkpoint into {latest} or pass that directory as --load "
                f"({_others_hint(load_dir, target)})"
            )
        return target, int(_ITER_RE.match(name).group(1))
    complete = list_checkpoints(load_dir)
    if not complete:
        raise CheckpointError(
            f"{load_dir} holds no checkpoint (no '{LATEST_FILE}' file and no committed iter_XXXXXXX "
            "directory; .tmp-* directories are unfinished saves); fix: pass the --save directory of a "
            f"run, an iter_XXXXXXX directory, or create one with {CONVERT_TOOL}"
        )
    return complete[-1][1], complete[-1][0]


def read_meta(ckpt_dir: str) -> Dict[str, Any]:
    """meta.json of a committed checkpoint, plus ``checkpoint_dir`` (absolute, not on disk).

    Raises CheckpointError if it is missing, not valid JSON, or of another format_version.
    """
    ckpt_dir = os.path.abspath(ckpt_dir)
    path = os.path.join(ckpt_dir, META_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        if os.path.exists(os.path.join(ckpt_dir, LATEST_FILE)):
            raise CheckpointError(f"{path} is missing: {ckpt_dir} is a save directory, not one checkpoint; "
                                  "fix: resolve it with resolve_load_dir() first") from None
        raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a complete checkpoint; "
                              "fix: pass the save directory (follows 'latest') or a committed iter_ directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt (not valid JSON: {e}); fix: restore the checkpoint "
                              f"or load another one ({_others_hint(os.path.dirname(ckpt_dir), ckpt_dir)})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: format_version {got!r}, this code reads {FORMAT_VERSION}; "
                              f"fix: re-create the checkpoint with {CONVERT_TOOL}")
    for k in _REQUIRED_META + ("iteration", "files"):
        if k not in meta:
            raise CheckpointError(f"{path} lacks {k!r}; fix: re-create the checkpoint with {CONVERT_TOOL}")
    meta["checkpoint_dir"] = ckpt_dir
    return meta


def _verify_file(ckpt_dir: str, rel: str, rec: dict, sizes_only: bool = False) -> None:
    """Raise CheckpointError unless ``rel`` exists with the size (and sha256) of its meta.json record."""
    path = os.path.join(ckpt_dir, rel)
    fix = (f"fix: restore {rel} from a copy of this checkpoint or resume from another one "
           f"({_others_hint(os.path.dirname(ckpt_dir), ckpt_dir)})")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing (listed in {META_FILE}); {fix}")
    size = os.path.getsize(path)
    if size != rec["bytes"]:
        raise CheckpointError(f"{path} is truncated or corrupt: {size} bytes, {META_FILE} records "
                              f"{rec['bytes']}; {fix}")
    if sizes_only:
        return
    digest = atomic.sha256_file(path)
    if digest != rec["sha256"]:
        raise CheckpointError(f"{path} is corrupt: sha256 {digest[:16]}... differs from "
                              f"{rec['sha256'][:16]}... recorded in {META_FILE}; {fix}")


def verify_checkpoint(ckpt_dir: str, pp_rank: Optional[int] = None, *, sizes_only: bool = False) -> Dict[str, Any]:
    """Check size and sha256 of every file listed in meta.json; return the meta.

    ``pp_rank``: only that stage's files (each rank verifies its own when resuming).
    ``sizes_only``: check presence and byte counts, not hashes (a fast start-up check that
    catches missing and truncated files; the hashes are checked when each file is read).
    Raises CheckpointError naming the first missing / truncated / corrupt file.
    """
    meta = read_meta(ckpt_dir)
    prefix = None if pp_rank is None else stage_dir_name(pp_rank) + "/"
    for rel, rec in sorted(meta["files"].items()):
        if prefix is None or rel.startswith(prefix):
            _verify_file(meta["checkpoint_dir"], rel, rec, sizes_only=sizes_only)
    return meta


def stage_file_names(meta: dict, pp_rank) -> List[str]:
    """File names (with extension) a checkpoint holds for stage ``pp_rank`` (or
    :data:`ANCHOR`), e.g. ``["model.safetensors", "optimizer.pt"]``; lets a trainer tell
    model-only checkpoints."""
    prefix = (ANCHOR_DIR if pp_rank == ANCHOR else stage_dir_name(pp_rank)) + "/"
    return sorted(rel[len(prefix):] for rel in meta["files"] if rel.startswith(prefix))
