"""Writing and reading the files of one pipeline stage (or of the anchor rank).

Owns the stage files of a checkpoint: tensor dicts as ``stage_XX/<name>.safetensors``
(:func:`write_stage_file` / :func:`read_stage_file`), plain-object blobs as
``stage_XX/<name>.pt`` (:func:`write_stage_blob` / :func:`read_stage_blob`, restricted to
what ``torch.load(weights_only=True)`` accepts) and the bridge to a built stage
(:func:`stage_model_state_dict` / :func:`load_stage_model`).  Writes go into the
temporary directory of a save begun with
:func:`~megatron_cegrpo.checkpointing.collectives.begin_save` and are fsynced; reads check
the file's size and sha256 against meta.json first.  Local to one rank: no
``torch.distributed``.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from megatron_cegrpo.checkpointing import atomic
from megatron_cegrpo.checkpointing.format import (
    ANCHOR,
    ANCHOR_DIR,
    CONVERT_TOOL,
    MODEL_FILE,
    CheckpointError,
    _check_tmp_dir,
    _stage_path,
    _verify_file,
    model_file_name,
    read_meta,
    stage_dir_name,
)


# ----------------------------------------------------------------------------- write


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
    atomic.fsync_file(path)
    return path


_BLOB_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.Size, torch.device)


def _check_blob(obj, where: str) -> None:
    """Raise TypeError naming ``where`` if ``obj`` holds anything ``torch.load(weights_only=True)`` refuses."""
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


# ----------------------------------------------------------------------------- read


def _stage_file_for_read(ckpt_dir, pp_rank, name, ext, verify, meta):
    """Path of a stage file listed in meta.json (verified when ``verify``); CheckpointError if not listed."""
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


def read_stage_model(ckpt_dir: str, pp_rank: int, *, verify: bool = True,
                     meta: Optional[dict] = None) -> Dict[str, torch.Tensor]:
    """Stage ``pp_rank``'s whole parameters, whatever the checkpoint's tensor-parallel size: its
    ``model.safetensors``, or its ``model_tpRR`` shards merged (``models.tp_shard.merge_tp_shards``).
    Raises CheckpointError as :func:`read_stage_file` does."""
    from megatron_cegrpo.models.tp_shard import merge_tp_shards

    meta = meta if meta is not None else read_meta(ckpt_dir)
    tp = int(meta.get("tp_size", 1))
    shards = [read_stage_file(ckpt_dir, pp_rank, model_file_name(r, tp), verify=verify, meta=meta) for r in range(tp)]
    return merge_tp_shards(shards) if tp > 1 else shards[0]


def load_stage_model(ckpt_dir: str, pp_rank: int, model, *, verify: bool = True,
                     meta: Optional[dict] = None, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Copy stage ``pp_rank``'s parameters into a built stage (strict keys and shapes, via
    :func:`megatron_cegrpo.models.load_stage_weights`; cast to the model's dtype). The
    checkpoint's TP shards are merged and re-split for this rank's ``tp_rank`` of ``tp_size``
    (``--tensor-model-parallel-size``), so any TP size loads any other."""
    from megatron_cegrpo.models.loader import load_stage_weights
    from megatron_cegrpo.models.tp_shard import shard_stage_state_dict

    sd = shard_stage_state_dict(read_stage_model(ckpt_dir, pp_rank, verify=verify, meta=meta), tp_rank, tp_size)
    try:
        load_stage_weights(model, sd)
    except (KeyError, ValueError) as e:
        raise CheckpointError(
            f"{_stage_path(ckpt_dir, pp_rank, MODEL_FILE, '.safetensors')} does not fit stage {pp_rank}: {e}; "
            "fix: call check_compatible() first, or convert the checkpoint with " + CONVERT_TOOL
        ) from None
