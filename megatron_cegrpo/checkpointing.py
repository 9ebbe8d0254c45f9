"""On-disk checkpoint format of megatron_cegrpo and its crash-safe reading / writing.

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
``options`` (``{flag: value}`` of the run options that shape the training trajectory, see
``TrainConfig.resume_options``; absent in converted checkpoints and in those written
before it was recorded), ``created`` (UTC ISO time) and ``files``: ``{relative path: {"sha256": hex, "bytes": int}}``
for every file of the checkpoint except meta.json itself.

Saving (crash safety)
---------------------
``tmp = begin_save(save_dir, it)`` -> every pipeline stage writes its files with
:func:`write_stage_file` / :func:`write_stage_blob` (one writing rank per stage; each file
is fsynced) -> ``commit_save(save_dir, tmp, it, meta, keep_last)`` on *every* rank.  The
commit waits for all ranks (barrier), then rank 0 checks that every stage wrote its
``model.safetensors``, hashes every file, writes meta.json, fsyncs, renames the tmp dir to
``iter_XXXXXXX`` (an existing directory of the same iteration is swapped out atomically
with ``renameat2(RENAME_EXCHANGE)`` where Linux offers it), rewrites ``latest`` atomically,
prunes older checkpoints beyond ``keep_last`` and deletes stale ``.tmp-*`` directories.
A crash at any point before the rename leaves the previous checkpoint and ``latest``
untouched and valid; a crash between the rename and the ``latest`` rewrite leaves
``latest`` on the previous (still complete) checkpoint.  Directories are deleted by first
renaming them to a ``.tmp-`` name, so a crash while pruning never leaves a half-deleted
``iter_`` directory behind.

All ranks must see the same ``save_dir`` (a shared or local file system); one training job
writes to a ``save_dir`` at a time.  With ``torch.distributed`` initialised,
:func:`begin_save` and :func:`commit_save` are collectives over ``group`` (default: the
world): call them on every rank of it.  Without it they work locally (tools, tests).

Loading
-------
``ckpt_dir, it = resolve_load_dir(load_dir)`` (the save root, following ``latest``, or an
``iter_`` directory; :func:`find_resume_checkpoint` adds the trainer's ``--load`` rule) ->
``meta = read_meta(ckpt_dir)`` -> ``check_compatible(meta, ...)`` and, when continuing a
run, :func:`check_resume` (the trajectory options) ->
:func:`read_stage_file` / :func:`read_stage_blob` (each verifies that file's sha256
against meta.json first; :func:`verify_checkpoint` checks every file).  Every problem is
reported as :class:`CheckpointError` naming the file, what is wrong and how to fix it.
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch

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
_HASH_CHUNK = 8 << 20

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


def _file_name(name: str, ext: str) -> str:
    if name.endswith(ext):
        name = name[: -len(ext)]
    if not _NAME_RE.match(name) or ".tmp-" in name:
        raise ValueError(
            f"checkpoint file name {name!r} must be letters, digits, '_', '.', '-' "
            "(no path separators, not starting with '.')"
        )
    return name + ext


def _stage_path(ckpt_dir: str, pp_rank, name: str, ext: str) -> str:
    if pp_rank == ANCHOR:
        return os.path.join(ckpt_dir, ANCHOR_DIR, _file_name(name, ext))
    if int(pp_rank) < 0:
        raise ValueError(f"pp_rank must be >= 0, got {pp_rank}")
    return os.path.join(ckpt_dir, stage_dir_name(pp_rank), _file_name(name, ext))


# ----------------------------------------------------------------------------- fs helpers


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a fsynced temp file in the same directory + os.replace."""
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(d)


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_HASH_CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _list_files(root: str) -> List[str]:
    """Relative paths (with '/') of all regular files under ``root``, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in filenames:
            full = os.path.join(dirpath, fn)
            out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


_libc = None


def _rename_exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unavailable."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        fn = _libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    return rc == 0


def _remove_dir(path: str) -> None:
    """Delete a directory: first renamed to a ``.tmp-`` name (atomic), then rmtree."""
    parent, base = os.path.split(path)
    doomed = os.path.join(parent, f"{base}.tmp-delete-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, doomed)
    except OSError:
        return
    _fsync_dir(parent)
    shutil.rmtree(doomed, ignore_errors=True)


# ----------------------------------------------------------------------------- distributed


def _dist(group):
    """(is_distributed, my rank in group, src global rank of group rank 0)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False, 0, 0
    rank = torch.distributed.get_rank(group)
    src = 0 if group is None else torch.distributed.get_global_rank(group, 0)
    return True, rank, src


def _broadcast_result(value, group, src):
    """Broadcast rank 0's ``("ok", value)`` or ``("error", message)``; raise on error everywhere."""
    box = [value]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    status, payload = box[0]
    if status != "ok":
        raise CheckpointError(payload)
    return payload


# ----------------------------------------------------------------------------- meta


def _config_dict(hf_config) -> dict:
    if hf_config is None:
        raise ValueError("hf_config is required")
    if isinstance(hf_config, dict):
        d = dict(hf_config)
    else:
        d = json.loads(hf_config.to_json_string(use_diff=False))
    return json.loads(json.dumps(d))  # JSON-clean


def normalize_codec(codec) -> Optional[Dict[str, Any]]:
    """``{"name": str, "keep_ratio": float|None}`` (or None) from any codec description.

    Accepts None, a codec name, a dict with ``name`` (and ``keep_ratio``), a
    ``CodecConfig`` (``boundary_codec`` / ``boundary_keep_ratio``) or a ``BoundaryCodec``
    instance.  ``keep_ratio`` is dropped (None) for ``dense``, which keeps everything.
    """
    if codec is None:
        return None
    if isinstance(codec, str):
        name, ratio = codec, None
    elif isinstance(codec, dict):
        name, ratio = codec.get("name"), codec.get("keep_ratio")
    elif hasattr(codec, "boundary_codec"):
        name, ratio = codec.boundary_codec, getattr(codec, "boundary_keep_ratio", None)
    elif hasattr(codec, "name"):
        name, ratio = codec.name, getattr(codec, "keep_ratio", None)
    else:
        raise TypeError(f"cannot read a codec name from {codec!r}")
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
) -> Dict[str, Any]:
    """The caller's part of meta.json, to pass to :func:`commit_save`.

    ``hf_config``: a ``PretrainedConfig`` (or its dict); ``codec``: see
    :func:`normalize_codec` (None: the checkpoint fits any codec); ``params_dtype``: a
    torch dtype or string, informative; ``extra``: any JSON-serialisable dict;
    ``options``: ``{flag: value}`` of the run options that shape the training trajectory
    (``TrainConfig.resume_options()``), stored as ``meta["options"]`` and compared on
    resume by :func:`check_resume` (omitted when None: e.g. converted, weights-only
    checkpoints). ``format_version``, ``iteration``, ``files`` and ``created`` are added
    by the commit. Raises TypeError/ValueError for values JSON cannot hold.
    """
    if int(pp_size) < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
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
    d = meta.get("checkpoint_dir")
    return os.path.join(d, META_FILE) if d else META_FILE


# ----------------------------------------------------------------------------- save


def is_save_iteration(iteration: int, save: Optional[str], save_interval: int, train_iters: int) -> bool:
    """The save cadence, for the stages and the anchor rank alike: with ``--save``, every
    ``--save-interval`` iterations (0: never in between) and after the last one."""
    return bool(save) and ((save_interval and iteration % save_interval == 0) or iteration == train_iters)


def begin_save(save_dir: str, iteration: int, *, group=None) -> str:
    """Create the temporary directory of a new checkpoint and return its path.

    The directory is ``<save_dir>/iter_XXXXXXX.tmp-<id>`` (unique id).  With
    torch.distributed initialised this is a collective over ``group``: its rank 0 creates
    the directory and broadcasts the path (all ranks must share the file system); otherwise
    it is created locally.  ``save_dir`` is created if needed.  Raises CheckpointError on
    every rank if rank 0 cannot create it.
    """
    name = iter_dir_name(iteration)
    is_dist, rank, src = _dist(group)
    result = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            tmp = os.path.join(os.path.abspath(save_dir), f"{name}.tmp-{uuid.uuid4().hex[:12]}")
            os.mkdir(tmp)
            result = ("ok", tmp)
        except OSError as e:
            result = ("error", f"{save_dir}: cannot create a checkpoint directory ({e}); "
                               "fix: pass a writable --save directory")
    if is_dist:
        return _broadcast_result(result, group, src)
    if result[0] != "ok":
        raise CheckpointError(result[1])
    return result[1]


def _check_tmp_dir(tmp_dir: str) -> None:
    if not _TMP_RE.match(os.path.basename(os.path.normpath(tmp_dir))):
        raise ValueError(f"{tmp_dir} is not a directory returned by begin_save()")
    if not os.path.isdir(tmp_dir):
        raise CheckpointError(f"{tmp_dir}: the save directory has disappeared (was it committed "
                              "already, or removed as stale by another job writing to the same --save?)")


def write_stage_file(tmp_dir: str, pp_rank: int, name: str, tensors: Dict[str, torch.Tensor]) -> str:
    """Write ``tensors`` as ``<tmp_dir>/stage_XX/<name>.safetensors`` (fsynced); return the path.

    ``name`` is a plain file name (``"model"`` for the stage's parameters, see
    :func:`stage_model_state_dict`); ``.safetensors`` is appended unless present.  Tensors
    are written as given (dtype kept, moved to CPU, made contiguous; tensors that share
    memory are cloned, which safetensors requires).  Raises TypeError for non-tensor values.
    """
    from safetensors.torch import save_file

    _check_tmp_dir(tmp_dir)
    path = _stage_path(tmp_dir, pp_rank, name, ".safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out, seen = {}, set()
    for k, v in tensors.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise TypeError(f"write_stage_file({name!r}): {k!r} must map a str to a tensor, got {type(v).__name__}")
        t = v.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in seen and t.numel() > 0:
            t = t.clone()
        seen.add(key)
        out[k] = t
    save_file(out, path, metadata={"format": "pt"})
    _fsync_file(path)
    return path


_BLOB_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.Size, torch.device)


def _check_blob(obj, where: str) -> None:
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"{where}: tensor subclass {type(obj).__name__} cannot be saved; pass a plain tensor")
        return
    if isinstance(obj, _BLOB_SCALARS):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_blob(k, f"{where} key {k!r}")
            _check_blob(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            _check_blob(v, f"{where}[{i}]")
        return
    hint = " (convert numpy arrays with torch.from_numpy / .tolist())" if type(obj).__module__.startswith("numpy") else ""
    raise TypeError(
        f"{where}: {type(obj).__module__}.{type(obj).__name__} cannot be stored in a checkpoint blob; "
        "allowed: dict, list, tuple, set, str, bytes, int, float, bool, complex, None, torch.Tensor, "
        f"torch.dtype, torch.Size, torch.device{hint}"
    )


def write_stage_blob(tmp_dir: str, pp_rank: int, name: str, obj) -> str:
    """``torch.save(obj)`` as ``<tmp_dir>/stage_XX/<name>.pt`` (fsynced); return the path.

    ``obj`` may only contain dict / list / tuple / set / str / bytes / int / float / bool /
    complex / None / plain tensors / torch.dtype / torch.Size / torch.device (what
    ``torch.load(weights_only=True)`` accepts); anything else (numpy arrays, custom
    classes) raises TypeError naming where it sits, before anything is written.  Tensors
    on an accelerator are stored with their device; :func:`read_stage_blob` maps them to
    ``map_location`` (CPU by default).
    """
    _check_tmp_dir(tmp_dir)
    _check_blob(obj, f"write_stage_blob({name!r})")
    path = _stage_path(tmp_dir, pp_rank, name, ".pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return path


def _commit_on_rank0(save_dir, tmp_dir, iteration, meta, keep_last) -> str:
    missing_keys = [k for k in _REQUIRED_META if k not in meta]
    if missing_keys:
        raise ValueError(f"commit_save: meta lacks {missing_keys}; build it with make_meta()")
    _check_tmp_dir(tmp_dir)
    name = iter_dir_name(iteration)
    if not os.path.basename(os.path.normpath(tmp_dir)).startswith(name + ".tmp-"):
        raise ValueError(f"commit_save: {tmp_dir} was begun for another iteration than {iteration}")
    pp_size = int(meta["pp_size"])
    stage_dirs = sorted(d for d in os.listdir(tmp_dir) if d.startswith("stage_"))
    expected = [stage_dir_name(r) for r in range(pp_size)]
    if stage_dirs != expected:
        raise CheckpointError(
            f"{tmp_dir}: has stage directories {stage_dirs}, expected {expected} for pp_size={pp_size}; "
            "every pipeline stage must write its files before commit_save (nothing was committed)"
        )
    for r in range(pp_size):
        p = _stage_path(tmp_dir, r, MODEL_FILE, ".safetensors")
        if not os.path.isfile(p):
            raise CheckpointError(f"{p} is missing: stage {r} did not write its parameters "
                                  f"(write_stage_file(tmp_dir, {r}, {MODEL_FILE!r}, ...)); nothing was committed")
    files = {}
    for rel in _list_files(tmp_dir):
        if rel == META_FILE:
            continue
        full = os.path.join(tmp_dir, rel)
        files[rel] = {"sha256": sha256_file(full), "bytes": os.path.getsize(full)}
    full_meta = dict(meta)
    full_meta.update(
        format_version=FORMAT_VERSION,
        iteration=int(iteration),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        files=files,
    )
    full_meta.pop("checkpoint_dir", None)
    meta_path = os.path.join(tmp_dir, META_FILE)
    with open(meta_path, "w") as f:
        json.dump(full_meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for dirpath, _, _ in os.walk(tmp_dir):
        _fsync_dir(dirpath)

    final = os.path.join(os.path.abspath(save_dir), name)
    if os.path.exists(final):
        # Same iteration saved again: swap atomically where possible, so `latest` (which may
        # name this iteration) never points to a missing directory.
        if _rename_exchange(tmp_dir, final):
            _fsync_dir(save_dir)
            shutil.rmtree(tmp_dir, ignore_errors=True)  # now holds the old checkpoint
        else:
            _remove_dir(final)
            os.rename(tmp_dir, final)
    else:
        os.rename(tmp_dir, final)
    _fsync_dir(save_dir)
    _write_text_atomic(os.path.join(save_dir, LATEST_FILE), name)

    if keep_last is not None:
        complete = list_checkpoints(save_dir)
        survivors = {it for it, _ in complete[-int(keep_last):]} | {int(iteration)}
        for it, path in complete:
            if it not in survivors:
                _remove_dir(path)
    for entry in os.listdir(save_dir):
        full = os.path.join(save_dir, entry)
        if _TMP_RE.match(entry) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif entry.startswith(f".{LATEST_FILE}.tmp-"):
            try:
                os.unlink(full)
            except OSError:
                pass
    return final


def commit_save(
    save_dir: str,
    tmp_dir: str,
    iteration: int,
    meta: Dict[str, Any],
    keep_last: Optional[int] = None,
    *,
    group=None,
) -> str:
    """Publish the checkpoint begun with :func:`begin_save`; return ``<save_dir>/iter_XXXXXXX``.

    Call on every rank of ``group`` (a barrier, then rank 0 does the work and broadcasts
    the outcome, so every rank returns the path or raises the same CheckpointError).  Rank
    0: checks ``stage_00 .. stage_{pp_size-1}`` each hold ``model.safetensors``, hashes every
    file, writes meta.json (``meta`` from :func:`make_meta` plus ``format_version``,
    ``iteration``, ``created``, ``files``), fsyncs, renames the tmp dir to its final name,
    rewrites ``latest``, removes complete checkpoints beyond the ``keep_last`` newest (by
    iteration; the one just written is always kept; None keeps all) and stale ``.tmp-*``
    directories.  If the checks fail nothing is published and the tmp dir stays until the
    next commit removes it.
    """
    if keep_last is not None and int(keep_last) < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    is_dist, rank, src = _dist(group)
    if is_dist:
        torch.distributed.barrier(group=group)
    result = None
    if rank == 0:
        try:
            result = ("ok", _commit_on_rank0(save_dir, tmp_dir, iteration, meta, keep_last))
        except CheckpointError as e:
            result = ("error", str(e))
            if not is_dist:
                raise
        except Exception as e:  # noqa: BLE001 - reported on every rank
            if not is_dist:
                raise
            result = ("error", f"commit of {tmp_dir} failed on rank 0: {type(e).__name__}: {e}")
    if is_dist:
        return _broadcast_result(result, group, src)
    return result[1]


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
    digest = sha256_file(path)
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


def _stage_file_for_read(ckpt_dir, pp_rank, name, ext, verify, meta):
    path = _stage_path(ckpt_dir, pp_rank, name, ext)
    rel = os.path.relpath(path, ckpt_dir).replace(os.sep, "/")
    meta = meta if meta is not None else read_meta(ckpt_dir)
    rec = meta["files"].get(rel)
    if rec is None:
        prefix = ANCHOR_DIR if pp_rank == ANCHOR else stage_dir_name(pp_rank)
        have = sorted(f for f in meta["files"] if f.startswith(prefix + "/"))
        raise CheckpointError(
            f"{path}: not part of this checkpoint (stage {pp_rank} has {have}); the checkpoint was "
            "written without it (e.g. a converted, model-only checkpoint) or for another pp size"
        )
    if verify:
        _verify_file(os.path.abspath(ckpt_dir), rel, rec)
    return path


def stage_file_names(meta: dict, pp_rank) -> List[str]:
    """File names (with extension) a checkpoint holds for stage ``pp_rank`` (or
    :data:`ANCHOR`), e.g. ``["model.safetensors", "optimizer.pt"]``; lets a trainer tell
    model-only checkpoints."""
    prefix = (ANCHOR_DIR if pp_rank == ANCHOR else stage_dir_name(pp_rank)) + "/"
    return sorted(rel[len(prefix):] for rel in meta["files"] if rel.startswith(prefix))


def read_stage_file(ckpt_dir: str, pp_rank: int, name: str = MODEL_FILE, *, verify: bool = True,
                    meta: Optional[dict] = None) -> Dict[str, torch.Tensor]:
    """The tensors of ``stage_XX/<name>.safetensors`` (on CPU, dtype as saved).

    ``verify`` (default) checks the file's size and sha256 against meta.json first.
    Raises CheckpointError if the file is not in the checkpoint, corrupt or unreadable.
    """
    from safetensors.torch import load_file

    path = _stage_file_for_read(ckpt_dir, pp_rank, name, ".safetensors", verify, meta)
    try:
        return load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors raises several types
        raise CheckpointError(f"{path} cannot be read as safetensors ({type(e).__name__}: {e}); "
                              "the file is corrupt; fix: restore it or load another checkpoint") from None


def read_stage_blob(ckpt_dir: str, pp_rank: int, name: str, *, map_location="cpu", verify: bool = True,
                    meta: Optional[dict] = None):
    """The object in ``stage_XX/<name>.pt``, loaded with ``torch.load(weights_only=True)``
    (no arbitrary pickle code runs).  ``verify`` as in :func:`read_stage_file`."""
    path = _stage_file_for_read(ckpt_dir, pp_rank, name, ".pt", verify, meta)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path} cannot be loaded with torch.load(weights_only=True) "
                              f"({type(e).__name__}: {str(e)[:300]}); fix: restore it or load another checkpoint") from None


# ----------------------------------------------------------------------------- compatibility


def _convert_cmd(meta: dict, pp_size: int, first, last) -> str:
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


def agree_on_errors(fn, *, group=None):
    """Run ``fn()`` on every rank of ``group`` and agree on the outcome, so that a problem
    one rank finds (say, a corrupt file of its stage) stops every rank at the same point
    instead of leaving the others blocked in their next collective.

    Returns ``fn()``'s result when every rank succeeded. When ``fn`` raised a
    :class:`~megatron_cegrpo.errors.ConfigError` (CheckpointError included) on some rank,
    every rank raises the lowest such rank's error, with ``agreed = True`` set on it (the
    entry point then prints it once, from rank 0). Any other exception is re-raised
    unchanged on its rank, and the ranks without one raise RuntimeError naming it. Without
    torch.distributed it is ``fn()``. A collective over ``group``: call it on every rank.
    """
    is_dist, _, _ = _dist(group)
    if not is_dist:
        return fn()
    result, error, status = None, None, ("ok", "")
    try:
        result = fn()
    except ConfigError as e:
        error, status = e, ("config", str(e))
    except Exception as e:  # noqa: BLE001 - reported to the other ranks, re-raised here
        error, status = e, ("other", f"{type(e).__name__}: {e}")
    statuses = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(statuses, status, group=group)
    if error is not None and status[0] == "other":
        raise error
    for kind, message in statuses:
        if kind == "config":
            agreed = error if isinstance(error, ConfigError) and str(error) == message else CheckpointError(message)
            agreed.agreed = True
            if agreed is error:
                raise error
            raise agreed from None
    for rank, (kind, message) in enumerate(statuses):
        if kind == "other":
            raise RuntimeError(f"rank {rank} of the group failed: {message}")
    return result


def _fmt_option(value) -> str:
    if value is None:
        return "(not given)"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _option_fix(flag: str, value) -> str:
    """How to pass ``flag`` with ``value`` on the command line."""
    if flag.startswith("--no-") and isinstance(value, bool):
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


# ----------------------------------------------------------------------------- model helpers


def stage_model_state_dict(model) -> Dict[str, torch.Tensor]:
    """The tensors to store as a stage's ``model.safetensors``: the stage's state dict
    without ``module.`` wrapper prefixes and non-parameter ``*._extra_state`` entries,
    detached (same keys as :func:`megatron_cegrpo.models.hf_to_megatron` produces)."""
    from megatron_cegrpo.models.name_map import is_ignored_key

    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "decoder"):
        inner = inner.module
    return {k: v.detach() for k, v in inner.state_dict().items()
            if not is_ignored_key(k) and isinstance(v, torch.Tensor)}


def load_stage_model(ckpt_dir: str, pp_rank: int, model, *, verify: bool = True,
                     meta: Optional[dict] = None) -> None:
    """Copy ``stage_XX/model.safetensors`` into a built stage (strict keys and shapes, via
    :func:`megatron_cegrpo.models.load_stage_weights`; cast to the model's dtype)."""
    from megatron_cegrpo.models.loader import load_stage_weights

    sd = read_stage_file(ckpt_dir, pp_rank, MODEL_FILE, verify=verify, meta=meta)
    try:
        load_stage_weights(model, sd)
    except (KeyError, ValueError) as e:
        raise CheckpointError(
            f"{_stage_path(ckpt_dir, pp_rank, MODEL_FILE, '.safetensors')} does not fit stage {pp_rank}: {e}; "
            "fix: call check_compatible() first, or convert the checkpoint with " + CONVERT_TOOL
        ) from None
