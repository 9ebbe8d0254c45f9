"""Publishing a finished save on one rank: the local half of ``commit_save``.

Owns the commit steps that make a save durable and visible, in crash-safe order: check
that every stage wrote its ``model.safetensors``, hash every file into meta.json, fsync,
rename the ``.tmp-`` directory to ``iter_XXXXXXX`` (swapping out an existing one
atomically), rewrite ``latest``, prune beyond ``keep_last`` and remove stale ``.tmp-*``
entries.  :func:`~megatron_cegrpo.checkpointing.collectives.commit_save` runs it on rank
0 of the group; no ``torch.distributed`` here.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil

from megatron_cegrpo.checkpointing import atomic
from megatron_cegrpo.checkpointing.format import (
    FORMAT_VERSION,
    LATEST_FILE,
    META_FILE,
    _REQUIRED_META,
    _TMP_RE,
    CheckpointError,
    _check_tmp_dir,
    _stage_path,
    iter_dir_name,
    list_checkpoints,
    model_file_name,
    stage_dir_name,
)


def _check_stages(tmp_dir: str, iteration: int, meta: dict) -> str:
    """Check ``meta`` and that ``tmp_dir`` (begun for ``iteration``) holds every stage's
    model file(s) (``model.safetensors``, or one ``model_tpRR`` per TP rank); return the final directory name ``iter_XXXXXXX``."""
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
    tp_size = int(meta.get("tp_size", 1))
    for r in range(pp_size):
        for model_file in (model_file_name(t, tp_size) for t in range(tp_size)):
            p = _stage_path(tmp_dir, r, model_file, ".safetensors")
            if not os.path.isfile(p):
                raise CheckpointError(f"{p} is missing: stage {r} did not write its parameters "
                                      f"(write_stage_file(tmp_dir, {r}, {model_file!r}, ...)); nothing was committed")
    return name


def _write_meta(tmp_dir: str, iteration: int, meta: dict) -> None:
    """Hash every file of ``tmp_dir`` into meta.json (``meta`` plus ``format_version``,
    ``iteration``, ``created``, ``files``), write it and fsync the whole tree."""
    files = {}
    for rel in atomic.list_files(tmp_dir):
        if rel == META_FILE:
            continue
        full = os.path.join(tmp_dir, rel)
        files[rel] = {"sha256": atomic.sha256_file(full), "bytes": os.path.getsize(full)}
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
        atomic.fsync_dir(dirpath)


def _move_into_place(save_dir: str, tmp_dir: str, name: str) -> str:
    """Rename ``tmp_dir`` to ``<save_dir>/<name>`` and point ``latest`` to it; return the path."""
    final = os.path.join(os.path.abspath(save_dir), name)
    if os.path.exists(final):
        # Same iteration saved again: swap atomically where possible, so `latest` (which may
        # name this iteration) never points to a missing directory.
        if atomic.rename_exchange(tmp_dir, final):
            atomic.fsync_dir(save_dir)
            shutil.rmtree(tmp_dir, ignore_errors=True)  # now holds the old checkpoint
        else:
            atomic.remove_dir(final)
            os.rename(tmp_dir, final)
    else:
        os.rename(tmp_dir, final)
    atomic.fsync_dir(save_dir)
    atomic.write_text_atomic(os.path.join(save_dir, LATEST_FILE), name)
    return final


def _prune(save_dir: str, iteration: int, keep_last) -> None:
    """Remove complete checkpoints beyond the ``keep_last`` newest (never ``iteration``;
    None keeps all), stale ``.tmp-*`` directories and leftover ``latest`` temp files."""
    if keep_last is not None:
        complete = list_checkpoints(save_dir)
        survivors = {it for it, _ in complete[-int(keep_last):]} | {int(iteration)}
        for it, path in complete:
            if it not in survivors:
                atomic.remove_dir(path)
    for entry in os.listdir(save_dir):
        full = os.path.join(save_dir, entry)
        if _TMP_RE.match(entry) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif entry.startswith(f".{LATEST_FILE}.tmp-"):
            try:
                os.unlink(full)
            except OSError:
                pass


def publish_save(save_dir, tmp_dir, iteration, meta, keep_last) -> str:
    """Publish ``tmp_dir`` as ``<save_dir>/iter_XXXXXXX`` (see the module docstring for the
    steps); return its path.  Raises CheckpointError (nothing published) when a stage's
    files are missing, ValueError for a wrong ``meta`` / ``tmp_dir``."""
    name = _check_stages(tmp_dir, iteration, meta)
    _write_meta(tmp_dir, iteration, meta)
    final = _move_into_place(save_dir, tmp_dir, name)
    _prune(save_dir, iteration, keep_last)
    return final
