"""The collective save protocol and error agreement across the ranks of a group.

Owns what every rank of a group must call together: the save cadence
(:func:`is_save_iteration`, so that all ranks, the anchor included, enter a save on the
same iterations), :func:`begin_save` (rank 0 creates the ``.tmp-`` directory and
broadcasts its path), :func:`commit_save` (a barrier, then rank 0 publishes the save with
:mod:`~megatron_cegrpo.checkpointing.commit` and broadcasts the outcome) and
:func:`agree_on_errors` (a problem one rank finds stops every rank at the same point).
Without ``torch.distributed`` initialised each of them works locally (tools, tests).

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
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Dict, Optional

import torch

from megatron_cegrpo.checkpointing.commit import publish_save
from megatron_cegrpo.checkpointing.format import CheckpointError, iter_dir_name
from megatron_cegrpo.errors import ConfigError


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
            result = ("ok", publish_save(save_dir, tmp_dir, iteration, meta, keep_last))
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


# ----------------------------------------------------------------------------- errors


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
