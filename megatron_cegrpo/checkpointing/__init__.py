"""On-disk checkpoint format of megatron_cegrpo and its crash-safe reading / writing.

One module per concern; this package re-exports the public names of all of them, so
``from megatron_cegrpo import checkpointing as ck; ck.begin_save(...)`` is the usual entry:

* :mod:`~megatron_cegrpo.checkpointing.atomic`: crash-safe file-system primitives (fsync,
  atomic text write, rename-exchange, directory removal, sha256); standard library only;
* :mod:`~megatron_cegrpo.checkpointing.format`: the on-disk layout and meta.json (names,
  :data:`FORMAT_VERSION`, :func:`make_meta`, :func:`read_meta`, listing, resolving
  ``latest``, verification) and :class:`CheckpointError`;
* :mod:`~megatron_cegrpo.checkpointing.stage_files`: writing / reading one stage's tensor
  files and blobs, and loading them into a built stage;
* :mod:`~megatron_cegrpo.checkpointing.commit`: publishing a finished save on one rank
  (meta.json, rename, ``latest``, pruning);
* :mod:`~megatron_cegrpo.checkpointing.compat`: compatibility and resume rules
  (:func:`check_compatible`, :func:`check_resume`, :func:`find_resume_checkpoint`,
  :func:`check_save_dir`) and :func:`decide_resume`, which applies them to the run's ``--load`` (the
  one resume decision: the start-up checks, the stages and the anchor ask it);
* :mod:`~megatron_cegrpo.checkpointing.collectives`: what every rank calls together (the
  save cadence :func:`is_save_iteration`, :func:`begin_save`, :func:`commit_save`,
  :func:`agree_on_errors`).

The layout and meta.json are described in :mod:`~megatron_cegrpo.checkpointing.format`,
the crash-safe save protocol in :mod:`~megatron_cegrpo.checkpointing.collectives`.

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

from megatron_cegrpo.checkpointing import atomic  # noqa: F401
from megatron_cegrpo.checkpointing.atomic import sha256_file
from megatron_cegrpo.checkpointing.collectives import (
    agree_on_errors,
    begin_save,
    commit_save,
    is_save_iteration,
)
from megatron_cegrpo.checkpointing.compat import (
    MODEL_SHAPE_FIELDS,
    check_compatible,
    check_resume,
    check_save_dir,
    decide_resume,
    find_resume_checkpoint,
    ResumePoint,
)
from megatron_cegrpo.checkpointing.format import (
    ANCHOR,
    ANCHOR_DIR,
    CONVERT_TOOL,
    FORMAT_VERSION,
    LATEST_FILE,
    META_FILE,
    MODEL_FILE,
    TOKENIZER_DIR,
    CheckpointError,
    has_checkpoint,
    hf_config_from_meta,
    iter_dir_name,
    list_checkpoints,
    make_meta,
    model_file_name,
    normalize_codec,
    read_meta,
    resolve_load_dir,
    stage_dir_name,
    stage_file_names,
    continues_run,
    tp_file_name,
    verify_checkpoint,
)
from megatron_cegrpo.checkpointing.stage_files import (
    load_stage_model,
    read_stage_blob,
    read_stage_model,
    read_stage_file,
    stage_model_state_dict,
    write_stage_blob,
    write_stage_file,
)

__all__ = [
    "ANCHOR", "ANCHOR_DIR", "CONVERT_TOOL", "FORMAT_VERSION", "LATEST_FILE", "META_FILE", "MODEL_FILE",
    "MODEL_SHAPE_FIELDS", "TOKENIZER_DIR", "CheckpointError", "ResumePoint",
    "agree_on_errors", "begin_save", "check_compatible", "check_resume", "check_save_dir", "commit_save", "decide_resume",
    "find_resume_checkpoint", "has_checkpoint", "hf_config_from_meta", "is_save_iteration", "iter_dir_name",
    "list_checkpoints", "load_stage_model", "make_meta", "model_file_name", "normalize_codec", "read_meta", "read_stage_blob",
    "read_stage_file", "read_stage_model", "resolve_load_dir", "sha256_file", "stage_dir_name", "stage_file_names",
    "stage_model_state_dict", "verify_checkpoint", "continues_run", "tp_file_name", "write_stage_blob", "write_stage_file",
]
