"""Save and restore a trainer rank: its stage's weights and every object with state.

A checkpoint of iteration t holds, per stage (``checkpointing/`` owns the format and the
atomic, collective commit):

- ``model`` and ``reference`` tensors (safetensors);
- ``trainer_state``: ``{"iteration": t, name: obj.state_dict() for each stateful object}``
  — the optimizer, the LR scheduler, every RNG, the byte meter, the codec, a circuit's
  state under its name, and on the driver the prompt sampler's position.

Tensor parallelism (``--tensor-model-parallel-size`` T > 1): every TP rank writes its own shard
files, ``model_tpRR``, ``reference_tpRR`` and ``trainer_state_tpRR`` (its optimizer state, RNGs and
meter belong to its shard; ``checkpointing.tp_file_name``), meta.json records ``tp_size`` and the
save and load collectives span every trainer rank (megatron's model-parallel group, TP x PP).
A checkpoint that continues a run resumes at the same T (``train.preflight``); its model shards
load at any T (``checkpointing.load_stage_model`` merges and re-splits).

Objects whose state must be set later (the driver's sampler and the RNGs are restored once
the driver has built its sampler, whose construction draws random numbers) are passed to
:meth:`Checkpointer.load` as ``deferred`` and restored by :meth:`Checkpointer.restore_deferred`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from megatron_cegrpo import checkpointing as ck
from megatron_cegrpo.models import load_stage_weights
from megatron_cegrpo.rng_state import get_rng_state, set_rng_state

__all__ = ["Checkpointer", "RNGState", "TRAINER_STATE"]

TRAINER_STATE = "trainer_state"


class RNGState:
    """Every RNG of the process (python, numpy, torch, megatron's tracker) as a stateful object."""

    def state_dict(self) -> Dict[str, Any]:
        return get_rng_state()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        set_rng_state(state)


class Checkpointer:
    """One trainer rank's checkpoints.

    Args:
        cfg: the TrainConfig (``cfg.checkpoint``, and the options recorded in meta.json).
        ctx: the DistContext (pipeline rank and group: the save and load collectives).
        hf_config: the model's HF config (recorded, and compared on load).
        log: ``log(msg)`` prints a line on the driver.
        resume: the run plan's resume decision (``plan.RunPlan.resume``: a
            ``checkpointing.ResumePoint``, or None for a fresh start), which :meth:`load` loads.
    """

    def __init__(self, cfg, ctx, hf_config, log, resume=None):
        self.cfg, self.ctx, self.hf_config, self._log = cfg, ctx, hf_config, log
        self.resume = resume  # the run plan's resume decision (checkpointing.ResumePoint, or None)
        self._pending: Dict[str, Any] = {}
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        # the ranks that write one checkpoint together: the pipeline, or at TP > 1 every TP rank of it
        self.group = ctx.pg_collection.mp if self.tp_size > 1 else ctx.pp_group

    def _name(self, name: str) -> str:
        """This TP rank's file of ``name`` (``name_tpRR`` at TP > 1)."""
        return ck.tp_file_name(name, self.tp_rank, self.tp_size)

    # ------------------------------------------------------------------ save
    def save(self, iteration: int, model, reference: Dict[str, torch.Tensor], stateful: Mapping[str, Any],
             before_commit=None) -> str:
        """Write checkpoint ``iteration`` (a collective over the pipeline group, every TP rank of it
        at TP > 1; atomic).

        Args:
            model: the stage (``model.safetensors``); its parameters must be finite.
            reference: the reference tensors by parameter name (``reference.safetensors``).
            stateful: ``{name: obj}`` with ``state_dict()``, stored in ``trainer_state``.
            before_commit: ``fn(tmp_dir)`` run on this rank after its files are written
                (the driver lets a circuit add its own files).
        Raises:
            CheckpointError: non-finite weights, an unwritable ``--save``, a failed commit.
        """
        cfg, ctx = self.cfg, self.ctx
        bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
        if bad:
            raise ck.CheckpointError(f"stage {ctx.pp_rank}: refusing to save non-finite weights ({bad[:3]}); "
                                     f"resume from the last checkpoint with a lower --lr")
        # the stages' collectives only: a dead or slow anchor cannot block a save
        tmp = ck.begin_save(cfg.checkpoint.save, iteration, group=self.group)
        ck.write_stage_file(tmp, ctx.pp_rank, ck.model_file_name(self.tp_rank, self.tp_size),
                            ck.stage_model_state_dict(model))
        ck.write_stage_file(tmp, ctx.pp_rank, self._name("reference"), reference)
        state = {"iteration": iteration}
        state.update({name: obj.state_dict() for name, obj in stateful.items()})
        ck.write_stage_blob(tmp, ctx.pp_rank, self._name(TRAINER_STATE), state)
        if before_commit is not None:
            before_commit(tmp)
        p = cfg.parallel
        meta = ck.make_meta(
            hf_config=self.hf_config, pp_size=ctx.pp_size, num_layers_in_first=p.decoder_first_pipeline_num_layers,
            num_layers_in_last=p.decoder_last_pipeline_num_layers, codec=cfg.codec, model_name=cfg.model.model,
            params_dtype=cfg.model.params_dtype, extra={"seed": cfg.optim.seed, "train_data": cfg.data.train_data},
            options=cfg.resume_options(), tp_size=self.tp_size)
        path = ck.commit_save(cfg.checkpoint.save, tmp, iteration, meta, cfg.checkpoint.keep_last, group=self.group)
        self._log(f"saved checkpoint {path}")
        return path

    # ------------------------------------------------------------------ load
    def load(self, model, ref_model, stateful: Mapping[str, Any],
             deferred: Tuple[str, ...] = ()) -> Tuple[int, Optional[List[torch.Tensor]]]:
        """Restore ``--load`` on every stage (a collective: an error one stage finds, e.g. a
        corrupt file of its own, is raised on every stage, ``checkpointing.agree_on_errors``).

        ``--load`` without a checkpoint starts fresh only when it is the ``--save`` directory
        (auto-resume); the trajectory options must equal the checkpoint's (weights-only
        checkpoints start a new run and are not compared): the run plan's decision
        (``checkpointing.decide_resume``, made at start-up). ``stateful`` objects are restored
        now, the names in ``deferred`` by :meth:`restore_deferred`; a name absent from the
        checkpoint (a circuit added since) is left as constructed.

        Returns:
            (iteration, theta_0): the iteration to continue from (0: a new run) and the
            reference weights for ``actor/weight_rel_change`` (None: unchanged).
        Raises:
            CheckpointError: missing, corrupt or incompatible checkpoint, naming the fix.
        """
        box = {}
        ck.agree_on_errors(lambda: box.update(r=self._load_here(model, ref_model, stateful, deferred)),
                           group=self.group)
        return box["r"]

    def _load_here(self, model, ref_model, stateful, deferred):
        cfg, ctx = self.cfg, self.ctx
        point = self.resume  # the run plan's decision (plan.py; checkpointing.decide_resume)
        if point is None:
            self._log(f"--load {cfg.checkpoint.load} holds no checkpoint yet (it is the --save directory): starting from "
                      f"--model {cfg.model.model}")
            return 0, None
        ckpt_dir, it, meta = point.ckpt_dir, point.iteration, point.meta
        weights_only = not point.continues
        for warning in point.warnings:
            self._log(f"warning: {warning}")
        tp = dict(tp_rank=self.tp_rank, tp_size=self.tp_size)
        ck.load_stage_model(ckpt_dir, ctx.pp_rank, model, meta=meta, **tp)
        if weights_only:  # a converted checkpoint: a new run starts from these weights
            if ref_model is not None:
                ck.load_stage_model(ckpt_dir, ctx.pp_rank, ref_model, meta=meta, **tp)
                theta0 = [p.detach() for p in ref_model.parameters()]
            else:
                theta0 = [p.detach().clone() for p in model.parameters()]
            self._log(f"initialised the policy and the reference from {ckpt_dir} (weights only)")
            return 0, theta0
        ref = ck.read_stage_file(ckpt_dir, ctx.pp_rank, self._name("reference"), meta=meta)
        if ref_model is not None:
            load_stage_weights(ref_model, ref)
            theta0 = [p.detach() for p in ref_model.parameters()]
        else:
            theta0 = [ref[n].clone() for n, _ in model.named_parameters()]
        state = ck.read_stage_blob(ckpt_dir, ctx.pp_rank, self._name(TRAINER_STATE), meta=meta)
        if state["iteration"] != it:
            raise ck.CheckpointError(f"{ckpt_dir}: trainer_state says iteration {state['iteration']}, "
                                     f"the directory {it}; the checkpoint is inconsistent")
        for name, obj in stateful.items():
            if name in state and name not in deferred:
                obj.load_state_dict(state[name])
        self._pending = {name: state[name] for name in deferred if name in state}
        self._log(f"resuming from {ckpt_dir} (iteration {it})")
        return it, theta0

    def restore_deferred(self, objects: Mapping[str, Any]) -> None:
        """Restore the deferred states kept by :meth:`load` into ``objects`` (in their order)."""
        for name, obj in objects.items():
            if name in self._pending:
                obj.load_state_dict(self._pending.pop(name))
