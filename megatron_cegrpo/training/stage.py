"""One pipeline stage's work (DESIGN.md section 2, steps 5-8): the compressed passes, the
update with its pre-step hooks, and the weight gather for the sampler.

Every trainer rank holds one :class:`StageWorker`; the driver's work is in ``driver.py``.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Callable, Dict, List, Tuple

import torch

from megatron_cegrpo.compression import ByteMeter
from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.grpo.batch import RolloutBatch, slice_batch
from megatron_cegrpo.grpo.loss import grpo_token_loss, update_metrics
from megatron_cegrpo.grpo.rollout_correction import RC_SUMS, rollout_corr_metrics
from megatron_cegrpo.models import hf_to_megatron, stage_layer_range
from megatron_cegrpo.models.stage import PolicyStage
from megatron_cegrpo.models.tp_shard import TPGatheredStage, is_tp_split
from megatron_cegrpo.optim.factory import build_lr_scheduler, build_optimizer
from megatron_cegrpo.optim.hooks import GradClipHook
from megatron_cegrpo.pipeline.boundary_error import BoundaryErrorTracker, declare_error_persistence
from megatron_cegrpo.pipeline.communicator import CompressedP2PCommunicator
from megatron_cegrpo.pipeline.schedule import PipelineRunner
from megatron_cegrpo.pipeline.tied_embedding import TiedEmbeddingSync
from megatron_cegrpo.pipeline.weight_sync import build_weight_sync
from megatron_cegrpo.training import data_parallel as dpx
from megatron_cegrpo.training import perf

__all__ = ["StageWorker", "boundary_bytes_ratio"]

_PreStep = Callable[[torch.optim.Optimizer, tuple, dict], None]


class StageWorker:
    """The stage's model, reference, codec, schedule, optimizer and hooks.

    The optimizer runs one pre-step hook: the registered corrections (a circuit's
    ``G = alpha G + beta |G| sign(M)``, in registration order), then global-norm clipping
    (``optim/hooks.py``), after the tied-embedding gradient sum.

    Tensor parallel (``ctx.tp_size`` > 1): the stage holds this TP rank's shard; the global norm
    is all-reduced over megatron's model-parallel group (TP x PP) and counts the TP-split gradients
    on every TP rank and the replicated ones (norms) on TP rank 0 only (:meth:`counted_here`); the
    sampler's weights are gathered from the shards (``TPGatheredStage``) by TP rank 0.

    Args:
        cfg: the TrainConfig.
        ctx: the DistContext.
        policy: this rank's stage and its frozen base copy (``models/stage.py``): the reference
            at ``--kl-coef`` > 0 (``ref_model``), else the drift probe's base model or None
            (``base_model``).
        codec: the run's boundary codec (``plan.RunPlan.codec``, built once at start-up).
    """

    def __init__(self, cfg, ctx, policy: PolicyStage, codec):
        self.cfg, self.ctx = cfg, ctx
        self.tf_config, self.model = policy.tf_config, policy.model
        # the frozen base stage: the reference of a KL term, or built for the drift probe alone
        # (drift_probe.py), whose passes the loss never sees; None: neither
        self.base_model = policy.ref_model
        self.ref_model = policy.ref_model if cfg.grpo.kl_coef > 0 else None
        self.temperature = float(cfg.rollout.temperature)
        # theta_0 for actor/weight_rel_change: the frozen base stage's weights when there is one
        self.theta0 = ([p.detach() for p in self.base_model.parameters()] if self.base_model is not None
                       else [p.detach().clone() for p in self.model.parameters()])
        self.codec = codec  # the run plan's (plan.py): built once, at start-up
        self.codec.check_width(self.tf_config.hidden_size)  # e.g. a lowrank budget too small for rank 1
        self.meter = ByteMeter()
        self.dp_group = ctx.dp_group  # this stage's data-parallel replicas (None at DP = 1; data_parallel.py)
        self.dp_bytes = 0  # comm/dp_grad_allreduce_bytes since the last stage_metrics
        self.update_flops = 0  # model FLOPs of the update passes since then (training/perf.py)
        lo, hi = stage_layer_range(self.tf_config, ctx.pp_rank, ctx.pp_size)
        self.num_layers = hi - lo
        self.error_tracker = BoundaryErrorTracker(group=ctx.dp_group)  # codec/error_persistence (pipeline/boundary_error.py)
        self.comm = (CompressedP2PCommunicator(ctx.pp_group, self.tf_config, self.codec, self.meter,
                                               seed=cfg.optim.seed, tp_group=ctx.tp_group)
                     if ctx.pp_size > 1 else None)
        # --shared-prefix: every pass of the runner (old log-probs, reference, update, the probes) packs each
        # group [prompt, r_1..r_G] (pipeline/schedule.py, grpo/shared_prefix.py)
        self.runner = PipelineRunner(self.comm, ctx.pg_collection, cfg.parallel.micro_batch_size, ctx.pp_size,
                                     shared_prefix_group=cfg.grpo.num_generations if cfg.parallel.shared_prefix else 0)
        # the tied embedding between the first and last stage (pipeline/tied_embedding.py): under
        # --tied-embedding-sync sparse the first stage's copy is a row cache the optimizer never steps
        self.tied = TiedEmbeddingSync(self.model, ctx, cfg.parallel.tied_embedding_sync)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.named_owned = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad and self.tied.owns(p)]
        self.optimizer = build_optimizer(self.params, cfg.optim)  # a cache without grad is never stepped
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim)
        self.corrections: List[_PreStep] = []
        self.dense_step = False  # set during a dense step (training/dense_step.py): no corrections, no error
        norm_group = ctx.pg_collection.mp if ctx.tp_size > 1 else ctx.pp_group if ctx.pp_size > 1 else None
        self.clip = GradClipHook(self.params, [p for p in self.params if not self.is_duplicate_tied_weight(p)
                                               and self.is_counted_on_tp_rank(p)],
                                 cfg.optim.clip_grad, group=norm_group, external_terms=self.tied.norm_terms)
        self.optimizer.register_step_pre_hook(self._pre_step)
        # the sampler starts from the driver's HF state dict: the bf16 sync's baseline per stage
        baseline = (partial(_stage_baseline, policy, ctx.pp_size) if policy.hf_state_dict is not None else None)
        # at TP > 1 the sampler takes whole stages: every TP rank gathers, TP rank 0 sends them
        self.whole = TPGatheredStage(self.model, ctx.tp_group) if ctx.tp_size > 1 else None
        self.gatherer = (build_weight_sync(self.whole or self.model, ctx.pp_group, cfg.rollout.dtype, baseline=baseline)
                         if ctx.tp_rank == 0 else None)

    # ------------------------------------------------------------------ structure
    def is_duplicate_tied_weight(self, p: torch.nn.Parameter) -> bool:
        """The last stage's copy of a tied embedding (counted once in the grad norm, at the
        first stage's place; under ``--tied-embedding-sync sparse`` its term comes from here)."""
        return (self.ctx.pp_size > 1 and not self.ctx.is_first_stage
                and getattr(self.model, "share_embeddings_and_output_weights", False)
                and getattr(self.model, "post_process", False)
                and p is self.model.shared_embedding_or_output_weight())

    def is_counted_on_tp_rank(self, p: torch.nn.Parameter) -> bool:
        """Whether sums over the stage's parameters (the gradient norm, the fidelity probe, the weight
        change) count ``p`` on this TP rank: a TP-split parameter on every TP rank (each holds its
        shard), a replicated one (norms) on TP rank 0 only. Always True at TP = 1."""
        return self.ctx.tp_size == 1 or self.ctx.tp_rank == 0 or is_tp_split(p)

    def counted_here(self, p: torch.nn.Parameter) -> bool:
        """Whether per-parameter statistics pooled over the stages (the anchor's sign agreement,
        the fidelity probe) count ``p`` on this stage and TP rank: every owned parameter once, a
        tied embedding on the stage that steps its gradient (the first under ``allreduce``, the
        last under ``sparse``), a replicated parameter on TP rank 0 (:meth:`is_counted_on_tp_rank`)."""
        return (self.tied.owns(p) and (self.tied.sparse or not self.is_duplicate_tied_weight(p))
                and self.is_counted_on_tp_rank(p))

    @property
    def layer_offset(self) -> int:
        """Global index of this stage's first layer."""
        return stage_layer_range(self.tf_config, self.ctx.pp_rank, self.ctx.pp_size)[0]

    def register_correction(self, hook: _PreStep) -> None:
        """Run ``hook(optimizer, args, kwargs)`` before clipping in every optimizer step."""
        self.corrections.append(hook)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        for hook in [] if self.dense_step else self.corrections:  # a dense gradient needs no correction
            hook(optimizer, args, kwargs)
        self.clip(optimizer, args, kwargs)

    # ------------------------------------------------------------------ passes
    def prefetch_codec(self, batch: RolloutBatch, t: int, timers=None) -> None:
        """Start the boundary codec's work for every pass of iteration t (the masks of its
        micro-batches) on a background thread, off the critical path (issue 10 item 6); with
        ``pcaq/prepass=1`` then the prepass (:meth:`boundary_prepass`, timed as ``timers``'
        ``boundary_prepass`` phase when given)."""
        self.runner.prefetch(batch, step=t)
        if self.comm is not None and self.comm.codec.wants_prepass:
            with timers.phase("boundary_prepass") if timers is not None else contextlib.nullcontext():
                self.boundary_prepass(batch, t)

    def boundary_prepass(self, batch: RolloutBatch, t: int) -> int:
        """``pcaq/prepass=1``: the first stage's no-gradient forward over the batch whose boundary
        states fit the step's basis (``PipelineRunner.boundary_prepass``); the micro-batches it ran."""
        self.tied.refresh_rows(batch["tokens"])
        return self.runner.boundary_prepass(self.model, batch, step=t)

    def logprob_loss_fn(self, want_entropy: bool, mb, logits):
        """The schedule's loss function of a log-prob pass (no gradient): a zero loss and
        ``{"logprobs": [b, s] fp32 at the sampling temperature}`` (+ ``"entropy"``), used by the
        stage's passes and the probes (``drift_probe.py``, ``fidelity.py``)."""
        logits = logits.float() / self.temperature
        out = {"logprobs": ca.logprobs_from_logits(logits, mb["labels"]).detach()}
        if want_entropy:
            out["entropy"] = ca.entropy_from_logits(logits).detach()
        return (torch.zeros((), device=logits.device), torch.zeros((), dtype=torch.int, device=logits.device),
                out)

    def _update_loss_fn(self, num_tokens: float, num_seqs: float, mb, logits):
        """The update's loss; with the old log-probs taken from this pass
        (``cfg.old_log_prob_from_update``: ``mb`` has no ``old_logprobs``) it also returns this
        pass's detached log-probs and entropy, the numbers the separate pass would have given."""
        own = "old_logprobs" not in mb
        loss, stats = grpo_token_loss(logits, mb, self.cfg.grpo, temperature=self.temperature,
                                      num_tokens=num_tokens, num_seqs=num_seqs, old_logprobs=mb.get("old_logprobs"),
                                      ref_logprobs=mb.get("ref_logprobs") if self.ref_model is not None else None,
                                      rollout_logprobs=mb.get("sampler_logprobs"))
        if own:
            with torch.no_grad():
                stats["logprobs"] = stats.pop("logprobs_detached")
                stats["entropy"] = ca.entropy_from_logits(logits.float() / self.temperature)
        else:
            stats.pop("logprobs_detached")
        return loss, stats["tokens"].to(torch.int), stats

    @torch.no_grad()
    def old_log_prob(self, batch: RolloutBatch, t: int) -> Dict[str, float]:
        """Step 5: forward-only compressed pass; the last stage sets ``batch["old_logprobs"]``
        and returns the entropy and the sampler/trainer mismatch (nats/token). Skipped where
        ``cfg.old_log_prob_from_update``: :meth:`update` then sets the same numbers."""
        self.model.eval()  # dropout is 0 anyway; eval keeps the passes identical
        self.tied.refresh_rows(batch["tokens"])
        outs = self.runner.run(self.model, batch, step=t, forward_only=True,
                               loss_fn=partial(self.logprob_loss_fn, True))
        return self._set_old_log_probs(batch, outs)

    def _set_old_log_probs(self, batch: RolloutBatch, outs: List[dict]) -> Dict[str, float]:
        """On the last stage: ``batch["old_logprobs"]`` (fp32 [N, S]) from a pass's per-micro-batch
        ``logprobs`` and ``entropy``, and ``actor/entropy``, ``mismatch/abs_logprob_diff_mean``,
        ``mismatch/logprob_diff_mean`` (sampler minus trainer, nats per response token, over the
        whole batch's replicas); {} on the other stages."""
        if not self.ctx.is_last_stage:
            return {}
        batch["old_logprobs"] = torch.cat([o["logprobs"] for o in outs])
        entropy = torch.cat([o["entropy"] for o in outs])
        diff = batch["sampler_logprobs"] - batch["old_logprobs"]
        ent, absdiff, mdiff = dpx.masked_means([entropy, diff.abs(), diff], batch["loss_mask"], self.dp_group)
        return {"actor/entropy": ent, "mismatch/abs_logprob_diff_mean": absdiff, "mismatch/logprob_diff_mean": mdiff}

    @torch.no_grad()
    def ref_log_prob(self, batch: RolloutBatch, t: int) -> None:
        """Step 6: the reference's compressed pass with the same masks (``batch["ref_logprobs"]``)."""
        outs = self.runner.run(self.ref_model, batch, step=t, forward_only=True,
                               loss_fn=partial(self.logprob_loss_fn, False))
        if self.ctx.is_last_stage:
            batch["ref_logprobs"] = torch.cat([o["logprobs"] for o in outs])

    def update(self, batch: RolloutBatch, t: int, probe=None) -> Dict[str, float]:
        """Step 7: 1F1B forward+backward per mini-batch, tied-embedding sum (``self.tied``), optimizer step
        (corrections, then clipping); the LR schedule advances once per iteration. Where
        ``cfg.old_log_prob_from_update`` (one optimizer step over the whole batch) the pass's own
        detached log-probs are the old ones (ratio exactly 1, as with the separate pass): the last
        stage sets ``batch["old_logprobs"]`` and returns the metrics :meth:`old_log_prob` would.
        ``probe``: a prepared ``GradFidelityProbe`` (``training/fidelity.py``) that computes the
        dense gradient before, and compares after, each codec backward; None: no probe."""
        cfg = self.cfg
        n, gbs = batch["tokens"].shape[0], cfg.global_batch_size // self.ctx.dp_size  # this replica's share
        sums = dict.fromkeys(("pg_loss_sum", "clip_sum", "ppo_kl_sum", "kl_sum", "tokens")  # + the rollout_corr/ sums
                             + (RC_SUMS if cfg.grpo.rollout_correction else ()), 0.0)
        norms, own = [], []
        self.model.train()
        for _ in range(cfg.grpo.ppo_epochs):
            for start in range(0, n, gbs):
                part = slice_batch(batch, start, start + gbs)
                outs = self.accumulate_gradients(part, start, t, probe)
                # the pass's model FLOPs at the shape it computed (packed with --shared-prefix)
                self.update_flops += perf.update_pass_flops(self.model, self.tf_config, self.num_layers,
                                                            *self.runner.pass_shape(part))
                for o in outs:
                    for k in sums:
                        if k in o:
                            sums[k] += float(o[k])
                own += [o for o in outs if "entropy" in o]  # the old log-probs from this pass
                norms.append(self._step(t))
                self.tied.after_step()
        self.scheduler.step()
        out = {"actor/grad_norm": float(sum(norms) / len(norms)), "actor/lr": self.optimizer.param_groups[0]["lr"],
               "actor/num_optimizer_steps": len(norms), "actor/skipped_steps": self.clip.num_skipped}
        if cfg.old_log_prob_from_update:
            out.update(self._set_old_log_probs(batch, own))
        if self.ctx.is_last_stage:
            if self.dp_group is not None:  # the whole batch's sums (every replica's last stage)
                sums = dict(zip(sums, dpx.allreduce_sum(list(sums.values()), self.dp_group)))
            out.update(update_metrics(sums, kl_term=self.ref_model is not None))
            out.update(rollout_corr_metrics(sums) if cfg.grpo.rollout_correction else {})
        return out

    def accumulate_gradients(self, mini: Dict[str, torch.Tensor], start: int, t: int, probe=None) -> List[dict]:
        """One optimizer step's gradients, not applied: rows ``start:`` of the batch (``mini``)
        through the codec pipeline (forward+backward, boundary error recorded), then the
        tied-embedding sum; with a ``probe``, its dense gradient before and its comparison after.

        Returns:
            the loss function's per-micro-batch dicts on the last stage (empty elsewhere).
        """
        # the whole mini-batch's tokens (every replica's share): the replicas' gradients then sum to it
        tokens = dpx.allreduce_sum([float(mini["loss_mask"].sum())], self.dp_group)[0]
        loss_fn = partial(self._update_loss_fn, tokens, float(self.cfg.global_batch_size))
        self.tied.refresh_rows(mini["tokens"])
        if probe is not None:
            probe.dense_gradient(mini, start, t, loss_fn)
        self.optimizer.zero_grad(set_to_none=True)
        with self._tracking_error():
            outs = self.runner.run(self.model, mini, step=t, forward_only=False, loss_fn=loss_fn)
        self.tied.reduce_grads(mini["tokens"])
        self.dp_bytes += dpx.allreduce_gradients(self.params, self.dp_group)  # before the pre-step hooks
        if probe is not None:
            probe.compare()
        return outs

    def _tracking_error(self):
        """The codec update passes record their forward boundary error (``codec/error_persistence``)."""
        return (self.comm.tracking_error(self.error_tracker) if self.comm is not None and not self.dense_step
                else contextlib.nullcontext())

    def _step(self, t: int) -> float:
        skipped = self.clip.num_skipped
        self.optimizer.step()
        if self.clip.num_skipped > skipped and self.ctx.is_driver:
            print(f"[cegrpo] warning: iteration {t}: the gradient norm is {self.clip.last_grad_norm} "
                  f"(NaN or inf); the optimizer step was skipped ({self.clip.num_skipped} so far)", flush=True)
        return self.clip.last_grad_norm

    def gather_weights(self):
        """Step 8 (collective over the pipeline): every stage's weights, on the driver (a tied
        embedding from the stage that owns it, ``TiedEmbeddingSync.patch_gathered``). Only
        data-parallel replica 0 (the driver's pipeline) sends; the others hold the same weights
        and return None. At TP > 1 every TP rank first gathers its stage's whole weights (a
        collective over the TP group, inside the stage) and TP rank 0 sends them: the driver gets
        the TP = 1 stages' tensors (names and shapes)."""
        if not self.ctx.is_replica_leader:
            return None
        if self.whole is not None:
            self.whole.refresh()
        if self.gatherer is None:  # TP rank > 0: its stage's weights travel from TP rank 0
            return None
        sds = self.gatherer.gather()
        self.tied.patch_gathered(sds)
        return sds

    # ------------------------------------------------------------------ metrics
    @staticmethod
    def declare_metrics(reducer) -> None:
        """How the driver reduces :meth:`stage_metrics` over the stages."""
        reducer.declare("comm/", "sum").declare("perf/", "sum").declare("_weight/", "stages").derive(_weight_change)
        reducer.derive(boundary_bytes_ratio)
        declare_error_persistence(reducer)

    def stage_metrics(self) -> Dict[str, float]:
        """This stage's bytes since the last call, its weight change and its boundary error
        sums (reset on read)."""
        out = {k: v for k, v in self.meter.snapshot_and_reset().items() if k != "comm/bytes_ratio"}
        out["_weight/diff_sq"], out["_weight/base_sq"] = _weight_change_sums(
            list(self.model.parameters()), self.theta0, self.tied, self.is_counted_on_tp_rank)
        out.update(self.error_tracker.end_iteration())
        out.update(self.tied.metrics())
        if self.dp_group is not None:
            out["comm/dp_grad_allreduce_bytes"], self.dp_bytes = self.dp_bytes, 0
        out["perf/update_flops"], self.update_flops = self.update_flops, 0
        return out


@torch.no_grad()
def _weight_change_sums(params: List[torch.Tensor], theta0: List[torch.Tensor], tied: TiedEmbeddingSync,
                        counted) -> Tuple[float, float]:
    """(||theta - theta_0||^2, ||theta_0||^2) over a stage's parameters ``params`` (fp64) against
    ``theta0`` (same order); a tied embedding's terms from the stage that owns it
    (``TiedEmbeddingSync.weight_terms``); only the parameters ``counted(p)`` keeps: at TP > 1 this
    rank's shards and, on TP rank 0, the replicated parameters (summed over the TP ranks by
    ``StageMetricsReducer.merge_tp_ranks``)."""
    remote = tied.weight_terms(params, theta0, _weight_terms)
    diff = base = 0.0
    for p, p0 in zip(params, theta0):
        if not counted(p):
            continue
        d, b = remote[id(p)] if id(p) in remote else _weight_terms(p, p0)
        diff += d
        base += b
    return diff, base


def _stage_baseline(policy: PolicyStage, pp_size: int, pp_rank: int) -> Dict[str, torch.Tensor]:
    """Stage ``pp_rank``'s megatron tensors from the driver's HF state dict (the sampler's start)."""
    return hf_to_megatron(policy.hf_state_dict, policy.hf_config, policy.tf_config, pp_rank, pp_size)


def _weight_terms(p: torch.Tensor, p0: torch.Tensor) -> Tuple[float, float]:
    """(||p - p0||^2, ||p0||^2) in fp64."""
    return float((p.detach().double() - p0.double()).square().sum()), float(p0.double().square().sum())


def _weight_change(m: Dict) -> Dict[str, float]:
    """``actor/weight_rel_change`` = ||theta_t - theta_0|| / ||theta_0|| per stage and overall."""
    diffs, bases = m["_weight/diff_sq"], m["_weight/base_sq"]
    out = {f"actor/weight_rel_change/stage_{i}": math.sqrt(d / max(b, 1e-30)) for i, (d, b) in
           enumerate(zip(diffs, bases))}
    out["actor/weight_rel_change"] = math.sqrt(sum(diffs) / max(sum(bases), 1e-30))
    return out


def boundary_bytes_ratio(m: Dict) -> Dict[str, float]:
    """``comm/bytes_ratio`` = this iteration's boundary wire bytes (both directions) / their dense
    size; ``comm/avg_boundary_ratio`` = the same over the run so far (the meters' cumulative
    ``comm/total_wire_bytes`` / ``comm/total_dense_equiv_bytes``, checkpointed, so a resumed run
    continues the average), dense steps included (training/dense_step.py). 0.0 without traffic."""
    dense, total = m.get("comm/dense_equiv_bytes", 0), m.get("comm/total_dense_equiv_bytes", 0)
    return {"comm/bytes_ratio": (m.get("comm/fwd_bytes", 0) + m.get("comm/bwd_bytes", 0)) / dense if dense else 0.0,
            "comm/avg_boundary_ratio": m.get("comm/total_wire_bytes", 0) / total if total else 0.0}
