"""The GRPO iteration loop on a compressed megatron-core pipeline (DESIGN.md section 2).

One iteration t, each phase in a named timer (``timing_s/<phase>``):
  gen, reward   the driver draws prompts, the dense sampler generates G responses each, the
                verifier scores them; group-normalised advantages        (driver.py); with
                --filter-groups more rounds until B groups have mixed scores (bounded)
  broadcast     the packed batch goes to every stage; each stage starts deriving the
                iteration's boundary masks on a background thread (pipeline/prefetch.py)
  anchor        a correction circuit sees the batch (circuit.py; none without an anchor)
  old_log_prob  forward-only pipeline pass, compressed (masks keyed by t)  (stage.py); skipped
                when the iteration makes one optimizer step over its whole batch: the
                update pass's own detached log-probs are then the old ones
                (``TrainConfig.old_log_prob_from_update``)
  ref           the frozen reference, same masks (only when --kl-coef > 0)
  probe         every --drift-probe-interval: the same passes and the base model's with compression
                off (drift_probe.py; its own byte meter, probe/bytes)
  fidelity      every --grad-fidelity-interval: dense old-logprob/reference passes, and inside
                the update one dense forward+backward per optimizer step (fidelity.py)
  update        megatron-core 1F1B forward+backward per mini-batch, optimizer step
                (pre-step: the circuits' corrections, then global-norm clipping)
  sync          stage weights -> the driver's sampler
every --dense-step-interval-th iteration, and each the drift controller schedules, the passes from
old_log_prob to update run with dense boundaries and no correction (a dense step, dense_step.py;
``comm/dense_step`` 1); then metrics (reduced over the stages by declared rules, reduce.py), the
drift controller's decision on a probe iteration (drift.py: whether t + 1 is dense) and, on the
save cadence, a checkpoint (checkpointer.py).
"""

from __future__ import annotations

import sys
import time
from typing import Dict, List, Optional

import torch.distributed as dist
from tqdm import tqdm

from megatron_cegrpo import heartbeat
from megatron_cegrpo.arguments import TrainConfig
from megatron_cegrpo.checkpointing import is_save_iteration
from megatron_cegrpo.compat.precision import precision_warning
from megatron_cegrpo.compat.placement import place_batch
from megatron_cegrpo.initialize import DistContext
from megatron_cegrpo.metrics import PhaseTimers, format_progress
from megatron_cegrpo.models.stage import build_policy_stage
from megatron_cegrpo.grpo.batch import replica_rows
from megatron_cegrpo.pipeline.broadcast import broadcast_metered, scatter_metered
from megatron_cegrpo.plan import RunPlan, plan_for
from megatron_cegrpo.training.checkpointer import Checkpointer, RNGState
from megatron_cegrpo.training.circuit import Circuit, circuits_of
from megatron_cegrpo.training.dense_step import DenseSteps
from megatron_cegrpo.training.driver import Driver, log
from megatron_cegrpo.training.drift import DriftMonitor
from megatron_cegrpo.training.fidelity import GradFidelityProbe
from megatron_cegrpo.training.perf import perf_metrics
from megatron_cegrpo.training.reduce import StageMetricsReducer
from megatron_cegrpo.training.stage import StageWorker
from megatron_cegrpo.training.weight_trace import start_weight_trace

__all__ = ["GRPOTrainer"]


class GRPOTrainer:
    """One trainer rank: a :class:`StageWorker`, the :class:`Driver` on rank 0, the run's circuits.

    Args:
        cfg: the validated TrainConfig.
        ctx: the DistContext from ``initialize_distributed``.
        plan: the run plan (``plan.RunPlan``: the stage's codec, the resume decision); None: resolved here.
    Raises:
        ConfigError / CheckpointError: a checkpoint that cannot be resumed (agreed by every stage).
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext, plan: Optional[RunPlan] = None):
        self.cfg, self.ctx = cfg, ctx
        t0 = time.perf_counter()
        p = cfg.parallel
        policy = build_policy_stage(cfg.model.model, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size,
                                    params_dtype=cfg.model.precision,
                                    num_layers_in_first=p.decoder_first_pipeline_num_layers,
                                    num_layers_in_last=p.decoder_last_pipeline_num_layers,
                                    pg_collection=ctx.pg_collection, with_reference=cfg.keeps_base_model,
                                    keep_hf_state_dict=ctx.is_driver, tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
        warning = precision_warning(cfg)  # bf16 on a host that emulates it
        if warning:
            self._log(warning)
        plan = plan_for(cfg, ctx, policy.hf_config, plan)  # start-up's, or resolved the same way
        self.stage = StageWorker(cfg, ctx, policy, plan.codec)
        self.reducer = StageMetricsReducer()
        self.stage.declare_metrics(self.reducer)
        self.drift = DriftMonitor(cfg, ctx, self.stage, self.reducer)  # the probe and --drift-controller (drift.py)
        self.dense_steps = DenseSteps(cfg.codec.dense_step_interval, self.stage, self.drift.controller)
        self.circuits: List[Circuit] = circuits_of(cfg, ctx, self.stage)
        self.fidelity = GradFidelityProbe(self.stage) if cfg.logging.grad_fidelity_interval else None
        for c in ([self.fidelity] if self.fidelity is not None else []) + self.circuits:
            c.declare_metrics(self.reducer)
        self.timers = PhaseTimers()
        self.checkpointer = Checkpointer(cfg, ctx, policy.hf_config, self._log, resume=plan.resume)
        self.iteration = 0
        self._batch_bytes = 0  # comm/batch_bytes of the last broadcast
        self._synced_at: Optional[int] = None  # iteration of the last whole-embedding sync (saves)
        self.driver: Optional[Driver] = None  # rank 0's, built once the checkpoint is loaded
        if cfg.checkpoint.load:
            self.iteration, theta0 = self.checkpointer.load(self.stage.model, self.stage.base_model, self._stateful(),
                                                            deferred=("sampler", "ledger", "rng"))
            if theta0 is not None:
                self.stage.theta0 = theta0
        for c in self.circuits:
            c.connect()
        if ctx.is_driver:
            self.driver = Driver(cfg, policy, ctx.pp_size)
        del policy
        if cfg.checkpoint.load:
            self._resume_driver()
        self.weight_trace = start_weight_trace(cfg, ctx, self.stage.named_owned, self.iteration)  # or a no-op
        codec, d = self.stage.codec, self.stage.tf_config.hidden_size
        self._log(f"model {cfg.model.model}: {self.stage.tf_config.num_layers} layers, d={d}, PP={ctx.pp_size}, "
                  + (f"TP={ctx.tp_size}, " if ctx.tp_size > 1 else "")
                  + (f"DP={ctx.dp_size}, " if ctx.dp_size > 1 else "") +
                  f"codec={cfg.codec.boundary_codec}{codec.summary(d)}; set up in {time.perf_counter() - t0:.1f} s")

    def _log(self, msg: str) -> None:
        if self.ctx.is_driver:
            log(msg)

    def _stateful(self) -> Dict:
        """The objects in a checkpoint's ``trainer_state``, by their key there."""
        s = self.stage
        out = {"optimizer": s.optimizer, "scheduler": s.scheduler, "rng": RNGState(), "meter": s.meter,
               "codec": s.codec, "codec_error": s.error_tracker}
        if self.driver is not None:
            out["sampler"], out["ledger"] = self.driver.sampler, self.driver.ledger
        out.update({c.name: c for c in self.circuits}, **self.drift.stateful())
        return out

    def _resume_driver(self) -> None:
        """After a load: the driver's data position and log, the sampler's weights, then the RNGs."""
        if self.driver is not None:
            self.checkpointer.restore_deferred({"sampler": self.driver.sampler, "ledger": self.driver.ledger})
            self.driver.resume_log(self.iteration)
        stage_sds = self.stage.gather_weights()
        if self.driver is not None:
            self.driver.update_sampler(stage_sds)
        self.checkpointer.restore_deferred({"rng": RNGState()})

    # ------------------------------------------------------------------ one iteration
    def train_step(self) -> Optional[Dict]:
        """Run iteration ``self.iteration + 1``; returns the metrics dict on the driver."""
        stage, timers = self.stage, self.timers
        t = heartbeat.mark("iteration", self.iteration + 1)  # this rank's progress, for a peer that names it
        t_start = time.perf_counter()
        full, received = self.rollout(t)  # the whole batch (driver only) and this replica's share
        batch = place_batch(received, self.ctx.device)  # on the stage's device (compat/placement.py)
        if not self.dense_steps.is_dense(t):  # masks of this iteration, on a background thread
            stage.prefetch_codec(batch, t, timers)  # and pcaq/prepass=1's forward (timing_s/boundary_prepass)
        for c in self.circuits:
            with timers.phase(c.phase):
                c.after_rollout(t, full if full is not None else received)  # CPU tensors
        with self.dense_steps.iteration(t):  # a dense step: dense boundaries, no correction (dense_step.py)
            stats = {}
            if not self.cfg.old_log_prob_from_update:  # else the update pass's own (stage.update)
                with timers.phase("old_log_prob"):
                    stats = stage.old_log_prob(batch, t)
            if stage.ref_model is not None:
                with timers.phase("ref"):
                    stage.ref_log_prob(batch, t)
            probed = self.drift.probed(t)
            if probed:
                with timers.phase("probe"):
                    self.drift.probe.run(batch, t)
            every = self.cfg.logging.grad_fidelity_interval
            fid = self.fidelity if every and t % every == 0 else None
            if fid is not None:
                with timers.phase("fidelity"):
                    fid.prepare(batch, t)
            with timers.phase("update"):  # includes the probe's dense forward+backward when probed
                for c in self.circuits:
                    c.before_optimizer_step(t, timers)
                stats.update(stage.update(batch, t, probe=fid))
        if probed:  # beside the compressed view's old log-probs, which may come from the update
            stats.update(self.drift.probe.metrics(batch, t, dense_step=self.dense_steps.is_dense(t)))
        with timers.phase("sync"):
            stage_sds = stage.gather_weights()
            if self.driver is not None:
                self.driver.update_sampler(stage_sds)
            c = self.cfg.checkpoint
            if is_save_iteration(t, c.save, c.save_interval, self.cfg.optim.train_iters):
                self._full_sync(t)  # before the metrics: its bytes are this iteration's
        self.iteration = t
        self.weight_trace.record(t)  # --log-weight-sample
        m = self._metrics(full, stats, t, time.perf_counter() - t_start)
        if self.driver is not None:
            m.update(self.driver.evaluate_on_cadence(t))  # the stages wait meanwhile
            self.driver.write(m)
        return m

    def rollout(self, t: int):
        """Steps 1-4 of iteration ``t``: the driver generates and scores the batch, every stage
        receives it (a collective over the rollout group, its bytes kept for the ledger).

        Tensor parallel: every TP rank receives the whole batch (the rollout group is every trainer
        rank); ``comm/batch_bytes`` counts one copy per other stage (a stage's TP ranks share a host).

        Data parallel (issue 14): each replica receives only its share
        (``grpo.batch.replica_rows``: the ``dp_rank``-th contiguous slice of every mini-batch,
        global ``sample_ids`` kept), sent by the driver to each trainer rank (every TP rank of
        a replica gets the replica's share; ``comm/batch_bytes`` counts one copy per other
        stage and replica, TP rank 0's, at TP > 1).

        Returns:
            (the whole packed batch on the driver, else None; this replica's rows).
        """
        ctx = self.ctx
        full = self.driver.generate_and_score(t, self.timers) if self.driver is not None else None
        with self.timers.phase("broadcast"):  # the rollout group: the stages wait as long as the driver generates
            if ctx.dp_size == 1:
                batch, self._batch_bytes = broadcast_metered(full, ctx.rollout_group,
                                                             copies=ctx.pp_size - 1 if ctx.tp_size > 1 else None)
                return (batch if full is not None else None), batch
            shards = None
            if full is not None:
                n = full["tokens"].shape[0]
                shards = [{k: v[rows] for k, v in full.items()} for rows in
                          (replica_rows(n, self.cfg.global_batch_size, r, ctx.dp_size) for r in range(ctx.dp_size))]
            # at TP > 1 one copy per other (stage, replica): a stage's TP ranks share a host
            counted = (lambda g: g % ctx.tp_size == 0) if ctx.tp_size > 1 else None
            batch, self._batch_bytes = scatter_metered(shards, ctx.replica_of, ctx.rollout_group, counted)
        return full, batch

    def _metrics(self, batch, stats: Dict[str, float], t: int, seconds: float) -> Optional[Dict]:
        """Loss metrics from the last stage, every stage's reduced by the declared rules, the
        driver's batch statistics and timers (the driver's dict; ``train_step`` adds the
        evaluation on its cadence and writes the log). A stage's TP ranks
        merge first (``StageMetricsReducer.merge_tp_ranks``: each rank's bytes and shard sums added),
        then its DP replicas; TP rank 0 of the driver's pipeline carries the stage's dict."""
        ctx = self.ctx
        obj = [stats if ctx.is_last_stage else None]
        if ctx.is_pipeline_leader:  # the losses are already summed over the replicas (equal on the TP ranks)
            dist.broadcast_object_list(obj, src=ctx.last_stage_rank, group=ctx.pp_group)
        local = {**self.stage.stage_metrics(), **self.drift.probe.stage_metrics()}
        if self.fidelity is not None:
            local.update(self.fidelity.stage_metrics())
        for c in self.circuits:
            local.update(c.stage_metrics(t))
        if ctx.tp_size > 1:  # this stage's TP ranks first (bytes and shard sums added; reduce.py)
            ranks = [None] * ctx.tp_size
            dist.all_gather_object(ranks, local, group=ctx.tp_group)
            local = self.reducer.merge_tp_ranks(ranks)
        if ctx.dp_group is not None:  # this stage's replicas (bytes summed; reduce.py)
            replicas = [None] * ctx.dp_size
            dist.all_gather_object(replicas, local, group=ctx.dp_group)
            local = self.reducer.merge_replicas(replicas)
        gathered = [None] * ctx.pp_size if ctx.is_driver else None
        if ctx.is_pipeline_leader:  # the driver's pipeline (replica 0, TP rank 0) carries the merged stage dicts
            dist.gather_object(local, gathered, dst=dist.get_global_rank(ctx.pp_group, 0), group=ctx.pp_group)
        if self.driver is None:
            return self.drift.decide(t, None, self.dense_steps.on_interval(t + 1)) or None  # {} here
        m = {"step": t, **Driver.batch_metrics(batch), **self.driver.rollout_metrics(), **obj[0],
             **self.reducer.reduce(gathered)}
        for c in self.circuits:
            m.update(c.driver_metrics())
        m.update(self.stage.gatherer.metrics())
        m["comm/batch_bytes"], m["comm/dense_step"] = self._batch_bytes, int(self.dense_steps.is_dense(t))
        m.update(self.driver.ledger.step(m))  # the whole-step ledger, and over the run (ledger.py)
        m.update(self.drift.decide(t, m, self.dense_steps.on_interval(t + 1)))  # a collective on a probe iteration
        m.update(self.timers.snapshot_and_reset())
        m["timing_s/step"] = seconds
        m.update(perf_metrics(m, self.cfg.logging.peak_tflops))
        return m

    # ------------------------------------------------------------------ the loop
    def train(self) -> Optional[Dict]:
        """Iterations up to ``--train-iters`` with evaluation before and after, checkpoints on
        the save cadence; returns the summary on the driver (None elsewhere)."""
        cfg = self.cfg
        summary = {}
        if self.iteration == 0:
            summary.update(self._evaluate_before())
        bar = (tqdm(total=cfg.optim.train_iters, desc="GRPO", unit="it", file=sys.stdout, dynamic_ncols=True)
               if self.driver is not None and cfg.logging.tqdm else None)
        last = None
        while self.iteration < cfg.optim.train_iters:
            last = self.train_step()
            c = cfg.checkpoint
            if is_save_iteration(self.iteration, c.save, c.save_interval, cfg.optim.train_iters):
                with self.timers.phase("save"):
                    self.save_checkpoint()
            if self.driver is not None:
                self._progress(last, bar)
        if bar is not None:
            bar.close()
        if self.stage.comm is not None:
            self.stage.comm.close()  # the codec prefetch thread (pipeline/prefetch.py)
        for c in self.circuits:
            c.finish(self.iteration, self.timers)
        if cfg.data.num_holdout:
            after = self._driver_phase(lambda d: d.evaluate_holdout(self.iteration))
            if after:
                summary["final"] = after
                self.driver.write({"step": self.iteration, **after})
                self._log(f"held-out greedy accuracy after {self.iteration} iterations: "
                          f"{after['val/holdout/acc']:.3f} ± {after['val/holdout/acc_stderr']:.3f} "
                          f"({after['val/holdout/num_rows']} rows, ± one standard error)")
        if self.driver is None:
            return None
        summary["last_metrics"] = last
        self.driver.close(summary)
        return summary

    def _evaluate_before(self) -> Dict:
        out = {}
        if self.cfg.data.eval_interval:
            ev = self._driver_phase(lambda d: d.evaluate_suite(0))
            if ev:
                self.driver.write({"step": 0, **ev})
        if self.cfg.data.num_holdout:
            before = self._driver_phase(lambda d: d.evaluate_holdout(0))
            if before:
                out["initial"] = before
                self.driver.write({"step": 0, **before})
                self._log(f"held-out greedy accuracy before training: {before['val/holdout/acc']:.3f} ± "
                          f"{before['val/holdout/acc_stderr']:.3f} ({before['val/holdout/num_rows']} rows, "
                          f"{before['timing_s/eval']:.0f} s)")
        return out

    def _progress(self, m: Dict, bar) -> None:
        line = format_progress(m, self.cfg.optim.train_iters)
        if bar is not None:
            bar.update(1)
        if m["step"] % self.cfg.logging.log_interval == 0:
            (bar.write if bar is not None else lambda s: print(s, flush=True))(line)

    def _driver_phase(self, fn):
        """Run ``fn(driver)`` on the driver while the other stages wait (rollout group)."""
        res = fn(self.driver) if self.driver is not None else None
        dist.barrier(group=self.ctx.rollout_group)
        return res

    # ------------------------------------------------------------------ checkpoints
    def _full_sync(self, t: int) -> None:
        """The whole tied embedding W to the first stage once per iteration t: its file holds the true W."""
        if self._synced_at != t and self.ctx.is_replica_leader:  # only replica 0 writes checkpoints
            self.stage.tied.full_sync()
            self._synced_at = t

    def save_checkpoint(self) -> Optional[str]:
        """Write everything the run needs to continue bit for bit (docs/checkpoints.md;
        ``checkpointer.py``); the driver lets each circuit add its own state. Data parallel:
        replica 0 writes (the replicas hold the same weights and optimizer state); the others
        return None."""
        if not self.ctx.is_replica_leader:
            return None
        self._full_sync(self.iteration)
        names = [n for n, _ in self.stage.model.named_parameters()]
        before_commit = None
        if self.driver is not None and self.circuits:
            def before_commit(tmp):
                for c in self.circuits:
                    c.save_into(tmp)
        return self.checkpointer.save(self.iteration, self.stage.model, dict(zip(names, self.stage.theta0)),
                                      self._stateful(), before_commit)
