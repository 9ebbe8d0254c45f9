"""The GRPO iteration loop on a compressed megatron-core pipeline (DESIGN.md section 2).

One iteration t, each phase in a named timer:
  gen           driver draws prompts, the dense sampler generates G responses each
  reward        the verifier scores them; group-normalised advantages
  broadcast     the packed batch goes to every stage
  old_log_prob  forward-only pipeline pass, compressed (masks keyed by t)
  ref           the frozen reference, same masks (only when --kl-coef > 0)
  update        megatron-core 1F1B forward+backward per mini-batch, optimizer step
                (pre-step hooks: correction slot, then global-norm clipping)
  sync          stage weights -> driver's sampler
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from functools import partial
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_cegrpo.arguments import TrainConfig
from megatron_cegrpo.checkpointing import is_save_iteration
from megatron_cegrpo.compression import ByteMeter, build_codec, get_codec
from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.grpo.batch import pack_rollouts, slice_batch
from megatron_cegrpo.initialize import DistContext
from megatron_cegrpo.metrics import PhaseTimers, build_writers, format_progress, truncate_metrics
from megatron_cegrpo.models import (
    allreduce_tied_embedding_grads,
    build_stage,
    hf_to_megatron,
    load_hf_state_dict,
    load_stage_weights,
    load_tokenizer,
    megatron_to_hf,
    resolve_model,
    transformer_config_from_hf,
)
from megatron_cegrpo.optim.factory import build_lr_scheduler, build_optimizer
from megatron_cegrpo.optim.hooks import GradClipHook, SignCorrectionHook
from megatron_cegrpo.pipeline.communicator import CompressedP2PCommunicator
from megatron_cegrpo.pipeline.schedule import PipelineRunner
from megatron_cegrpo.pipeline.weight_sync import StageWeightGatherer
from megatron_cegrpo.rewards import score_responses

__all__ = ["GRPOTrainer"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _log(ctx: DistContext, msg: str) -> None:
    if ctx.is_driver:
        print(f"[cegrpo] {msg}", flush=True)


class GRPOTrainer:
    """Holds one pipeline stage (+ reference) per rank; the driver also holds sampler and data.

    Args:
        cfg: the validated TrainConfig.
        ctx: the DistContext from ``initialize_distributed``.
    """

    def __init__(self, cfg: TrainConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        t0 = time.perf_counter()
        source = resolve_model(cfg.model.model)
        hf_config, hf_sd = load_hf_state_dict(source)
        self.hf_config = hf_config
        dtype = _DTYPES[cfg.model.params_dtype]
        self.tf_config = transformer_config_from_hf(
            hf_config,
            pipeline_model_parallel_size=ctx.pp_size,
            params_dtype=dtype,
            num_layers_in_first_pipeline_stage=cfg.parallel.decoder_first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=cfg.parallel.decoder_last_pipeline_num_layers,
            calculate_per_token_loss=True,
        )
        stage_sd = hf_to_megatron(hf_sd, hf_config, self.tf_config, ctx.pp_rank, ctx.pp_size)
        self.model = build_stage(hf_config, self.tf_config, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size,
                                 pg_collection=ctx.pg_collection)
        load_stage_weights(self.model, stage_sd)
        self.ref_model = None
        if cfg.grpo.kl_coef > 0:
            self.ref_model = build_stage(hf_config, self.tf_config, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size,
                                         pg_collection=ctx.pg_collection)
            load_stage_weights(self.ref_model, stage_sd)
            self.ref_model.requires_grad_(False)
            self.ref_model.eval()
        del stage_sd
        # theta_0 for actor/weight_rel_change: the frozen reference when there is one
        self._theta0 = ([p.detach() for p in self.ref_model.parameters()] if self.ref_model is not None
                        else [p.detach().clone() for p in self.model.parameters()])

        # boundary compression + the pipeline schedule
        self.codec = build_codec(cfg.codec.boundary_codec, cfg.codec.boundary_keep_ratio)
        self.meter = ByteMeter()
        self.comm = None
        if ctx.pp_size > 1:
            self.comm = CompressedP2PCommunicator(ctx.pp_group, self.tf_config, self.codec, self.meter,
                                                  seed=cfg.optim.seed)
        self.runner = PipelineRunner(self.comm, ctx.pg_collection, cfg.parallel.micro_batch_size, ctx.pp_size)

        # optimizer: correction slot first, then clipping (optim/hooks.py)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, cfg.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim)
        self.correction = SignCorrectionHook(params, alpha=cfg.anchor.sign_blend_alpha,
                                             beta=cfg.anchor.sign_blend_beta)
        self.optimizer.register_step_pre_hook(self.correction)
        norm_params = [p for p in params if not self._is_duplicate_tied_weight(p)]
        self.clip = GradClipHook(params, norm_params, cfg.optim.clip_grad,
                                 group=ctx.pp_group if ctx.pp_size > 1 else None)
        self.optimizer.register_step_pre_hook(self.clip)

        self.gatherer = StageWeightGatherer(self.model, ctx.pp_group)
        # a tied embedding's gradient is summed across the first and last stage every step: dense
        # traffic between stages outside the boundary codec, metered as comm/embd_sync_bytes
        tied = (ctx.pp_size > 1 and getattr(self.model, "share_embeddings_and_output_weights", False)
                and (ctx.is_first_stage or ctx.is_last_stage))
        w = self.model.shared_embedding_or_output_weight() if tied else None
        self._tied_grad_bytes = w.numel() * w.element_size() if w is not None else 0
        self._embd_sync_bytes = 0
        self.anchor = None
        if ctx.anchor_rank is not None:
            from megatron_cegrpo.anchor.client import AnchorClient
            from megatron_cegrpo.models import stage_layer_range

            tied_copy = any(self._is_duplicate_tied_weight(p) for p in params)
            self.anchor = AnchorClient(self.model, stage_layer_range(self.tf_config, ctx.pp_rank, ctx.pp_size)[0],
                                       tied_copy, ctx.anchor_rank, ctx.is_driver, cfg, self.correction,
                                       group=ctx.anchor_group, rank=ctx.rank)
        self.timers = PhaseTimers()
        self.iteration = 0
        if cfg.checkpoint.load:
            self.load_checkpoint(cfg.checkpoint.load)
        if self.anchor is not None:
            self.anchor.connect()

        # driver: data, tokenizer, sampler, verifier, log
        if ctx.is_driver:
            self._init_driver(source, hf_config, hf_sd)
        del hf_sd
        if cfg.checkpoint.load:
            self._restore_driver_and_sync()
        self.temperature = float(cfg.rollout.temperature)
        _log(ctx, f"model {cfg.model.model}: {self.tf_config.num_layers} layers, d={self.tf_config.hidden_size}, "
                  f"PP={ctx.pp_size}, codec={cfg.codec.boundary_codec}"
                  + (f" (k={self.codec.k(self.tf_config.hidden_size)} of d)" if hasattr(self.codec, "k") else "")
                  + f"; set up in {time.perf_counter() - t0:.1f} s")

    # ------------------------------------------------------------------ setup
    def _is_duplicate_tied_weight(self, p: torch.nn.Parameter) -> bool:
        """The last stage's copy of a tied embedding (counted once, on the first stage)."""
        return (self.ctx.pp_size > 1 and not self.ctx.is_first_stage
                and getattr(self.model, "share_embeddings_and_output_weights", False)
                and getattr(self.model, "post_process", False)
                and p is self.model.shared_embedding_or_output_weight())

    def _init_driver(self, source, hf_config, hf_sd) -> None:
        from megatron_cegrpo.data import PromptSampler, build_prompt, load_train_split, select_prompts
        from megatron_cegrpo.rewards import get_verifier
        from megatron_cegrpo.rollout.base import get_rollout_engine

        cfg = self.cfg
        if cfg.data.data_root:
            os.environ["CEGRPO_DATA_ROOT"] = cfg.data.data_root
        self.tokenizer = load_tokenizer(source)
        split = load_train_split(cfg.data.train_data, format=cfg.data.train_data_format,
                                 num_holdout=cfg.data.num_holdout, seed=cfg.optim.seed, data_root=cfg.data.data_root)
        path, holdout = split.path, split.holdout
        kept, self.prompt_ids, too_long = select_prompts(
            split.train, lambda q: self._encode_prompt(q, build_prompt), cfg.rollout.max_prompt_length,
            source=f"--train-data {path}")
        if too_long:
            print(f"[cegrpo] warning: skipped {too_long} prompts longer than --max-prompt-length="
                  f"{cfg.rollout.max_prompt_length} tokens", flush=True)
        self.train_records = kept
        self.holdout_records = holdout
        self.holdout_ids = [self._encode_prompt(r.question, build_prompt) for r in holdout]
        self.sampler = PromptSampler(len(kept), cfg.grpo.rollout_batch_size, cfg.optim.seed)
        self.get_verifier = get_verifier  # evaluation always scores with the data set's verifier
        self.get_reward_fn = get_verifier  # training reward: the verifier or a custom function
        if cfg.data.custom_reward_function:
            from megatron_cegrpo.rewards.custom import load_custom_reward_function

            fn = load_custom_reward_function(cfg.data.custom_reward_function)
            self.get_reward_fn = lambda _name: fn
        self.rollout = get_rollout_engine(cfg.rollout.engine, hf_config=hf_config, hf_state_dict=hf_sd,
                                          tokenizer=self.tokenizer)
        lg = cfg.logging
        self.writer = build_writers(lg.log_dir, wandb_project=lg.wandb_project, tensorboard_dir=lg.tensorboard_dir,
                                    config=cfg.to_dict(), resume=bool(cfg.checkpoint.load),
                                    run_name=lg.wandb_run_name, wandb_mode=lg.wandb_mode)
        self.eval_modes = self.eval_sets = None
        if cfg.data.eval_datasets:
            from megatron_cegrpo.evaluation import load_eval_datasets, parse_dataset_specs

            self.eval_modes = parse_dataset_specs(cfg.data.eval_datasets)
            self.eval_sets = load_eval_datasets(list(self.eval_modes), cfg.data.eval_limit)
        with open(os.path.join(cfg.logging.log_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        print(f"[cegrpo] data {path}: {len(kept)} train prompts, {len(holdout)} held out", flush=True)

    def _encode_prompt(self, question: str, build_prompt) -> torch.Tensor:
        text = build_prompt(self.tokenizer, question, self.cfg.data.prompt_template)
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    # --------------------------------------------------------------- rollout
    def _generate_and_score(self, t: int) -> Dict[str, torch.Tensor]:
        cfg, G = self.cfg, self.cfg.grpo.num_generations
        with self.timers.phase("gen"):
            idx = self.sampler.next_batch()
            prompts = [self.prompt_ids[i] for i in idx for _ in range(G)]
            with _all_cores():
                out = self.rollout.generate(prompts, max_new_tokens=cfg.rollout.max_new_tokens,
                                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                            generator_seed=cfg.optim.seed * 1_000_003 + t)
        with self.timers.phase("reward"):
            recs = [self.train_records[i] for i in idx for _ in range(G)]
            scores = score_responses(self.get_reward_fn, cfg.data.custom_reward_function, recs, out.texts)
            adv = ca.compute_grpo_outcome_advantage(scores, G, norm_adv_by_std=cfg.grpo.norm_adv_by_std)
        batch = pack_rollouts(out.prompt_ids, out.response_ids, out.response_logprobs, scores, adv,
                              pad_token_id=self.rollout.pad_token_id,
                              max_seq_length=int(self.hf_config.max_position_embeddings))
        batch["finished"] = out.finished.float()
        return batch

    # ------------------------------------------------------------ loss fns
    def _logprob_loss_fn(self, want_entropy: bool, mb, logits):
        logits = logits.float() / self.temperature
        out = {"logprobs": ca.logprobs_from_logits(logits, mb["labels"]).detach()}
        if want_entropy:
            out["entropy"] = ca.entropy_from_logits(logits).detach()
        return torch.zeros(()), torch.tensor(0, dtype=torch.int), out

    def _update_loss_fn(self, num_tokens: float, num_seqs: float, mb, logits):
        g = self.cfg.grpo
        logits = logits.float() / self.temperature
        logp = ca.logprobs_from_logits(logits, mb["labels"])
        mask = mb["loss_mask"]
        pol = ca.compute_policy_loss(mb["old_logprobs"], logp, mb["advantages"], mask,
                                     clip_ratio_low=g.clip_ratio_low, clip_ratio_high=g.clip_ratio_high)
        loss_mat = pol["pg_losses"]
        ntok = mask.sum()
        stats = {"pg_loss_sum": (pol["pg_losses"].detach() * mask).sum(),
                 "clip_sum": pol["pg_clipfrac"] * ntok, "ppo_kl_sum": pol["ppo_kl"] * ntok, "tokens": ntok}
        if self.ref_model is not None:
            kl = ca.kl_penalty(logp, mb["ref_logprobs"], g.kl_loss_type)
            loss_mat = loss_mat + g.kl_coef * kl
            stats["kl_sum"] = (kl.detach() * mask).sum()
        loss = ca.agg_loss(loss_mat, mask, g.loss_agg_mode, global_num_tokens=num_tokens, global_num_seqs=num_seqs)
        return loss, ntok.to(torch.int), stats

    # ------------------------------------------------------------ one iteration
    def train_step(self) -> Optional[Dict]:
        """Run iteration ``self.iteration + 1``; returns the metrics dict on the driver."""
        cfg, ctx = self.cfg, self.ctx
        t = self.iteration + 1
        t_start = time.perf_counter()
        batch = self._generate_and_score(t) if ctx.is_driver else None
        with self.timers.phase("broadcast"):
            # over the rollout group: the other stages wait here as long as the driver generates
            obj = [batch]
            dist.broadcast_object_list(obj, src=dist.get_global_rank(ctx.rollout_group, 0), group=ctx.rollout_group)
            batch = obj[0]

        if self.anchor is not None:
            with self.timers.phase("anchor"):
                self.anchor.after_rollout(t, batch)

        self.model.eval()  # dropout is 0 anyway; eval keeps the passes identical
        with self.timers.phase("old_log_prob"), torch.no_grad():
            outs = self.runner.run(self.model, batch, step=t, forward_only=True,
                                   loss_fn=partial(self._logprob_loss_fn, True))
        stats: Dict[str, float] = {}
        if ctx.is_last_stage:
            batch["old_logprobs"] = torch.cat([o["logprobs"] for o in outs])
            entropy = torch.cat([o["entropy"] for o in outs])
            mask = batch["loss_mask"]
            stats["actor/entropy"] = float(ca.masked_mean(entropy, mask))
            diff = batch["sampler_logprobs"] - batch["old_logprobs"]
            stats["mismatch/abs_logprob_diff_mean"] = float(ca.masked_mean(diff.abs(), mask))
            stats["mismatch/logprob_diff_mean"] = float(ca.masked_mean(diff, mask))
        if self.ref_model is not None:
            with self.timers.phase("ref"), torch.no_grad():
                outs = self.runner.run(self.ref_model, batch, step=t, forward_only=True,
                                       loss_fn=partial(self._logprob_loss_fn, False))
            if ctx.is_last_stage:
                batch["ref_logprobs"] = torch.cat([o["logprobs"] for o in outs])

        probe_every = cfg.logging.drift_probe_interval
        if probe_every and t % probe_every == 0 and self.comm is not None:
            with self.timers.phase("probe"), torch.no_grad():
                stats.update(self._drift_probe(batch, t))

        with self.timers.phase("update"):
            stats.update(self._update(batch, t))

        with self.timers.phase("sync"):
            stage_sds = self.gatherer.gather()
            if ctx.is_driver:
                hf_sd = megatron_to_hf(stage_sds, self.hf_config, self.tf_config, ctx.pp_size)
                self.rollout.update_weights(hf_sd)
        self.iteration = t
        return self._collect_metrics(batch, stats, t, time.perf_counter() - t_start)

    def _drift_probe(self, batch: Dict[str, torch.Tensor], t: int) -> Dict[str, float]:
        """Compression-off probe of true drift (status 2026-07-31 section 3, "A drift controller").

        Repeats the old-logprob (and reference) passes with the dense codec, billed to a
        separate meter, and reports beside the compression-view numbers:
        ``probe/abs_logprob_diff_mean`` (sampler vs dense trainer: the true train-inference
        mismatch), ``probe/view_abs_logprob_diff`` (compressed vs dense trainer view),
        ``probe/kl_to_ref`` (k3 KL to the reference, dense view) and
        ``probe/kl_to_ref_compressed`` (the same in the compression view).
        """
        meter = ByteMeter()
        lp_fn = partial(self._logprob_loss_fn, False)
        with self.comm.using(get_codec("dense"), meter):
            dense = self.runner.run(self.model, batch, step=t, forward_only=True, loss_fn=lp_fn)
            dense_ref = (self.runner.run(self.ref_model, batch, step=t, forward_only=True, loss_fn=lp_fn)
                         if self.ref_model is not None else None)
        if not self.ctx.is_last_stage:
            return {}
        mask = batch["loss_mask"]
        lp = torch.cat([o["logprobs"] for o in dense])
        out = {
            "probe/abs_logprob_diff_mean": float(ca.masked_mean((batch["sampler_logprobs"] - lp).abs(), mask)),
            "probe/view_abs_logprob_diff": float(ca.masked_mean((batch["old_logprobs"] - lp).abs(), mask)),
        }
        if dense_ref is not None:
            ref = torch.cat([o["logprobs"] for o in dense_ref])
            kind = self.cfg.grpo.kl_loss_type
            out["probe/kl_to_ref"] = float(ca.masked_mean(ca.kl_penalty(lp, ref, kind), mask))
            out["probe/kl_to_ref_compressed"] = float(
                ca.masked_mean(ca.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], kind), mask))
        return out

    def _update(self, batch: Dict[str, torch.Tensor], t: int) -> Dict[str, float]:
        cfg = self.cfg
        n = batch["tokens"].shape[0]
        gbs = cfg.global_batch_size
        sums = {"pg_loss_sum": 0.0, "clip_sum": 0.0, "ppo_kl_sum": 0.0, "kl_sum": 0.0, "tokens": 0.0}
        norms = []
        if self.anchor is not None:
            self.anchor.before_optimizer_step(t, self.timers)
            dump = os.environ.get("CEGRPO_ANCHOR_DUMP_DIR")
            if dump:
                self.correction.dump_path = os.path.join(dump, f"stage{self.ctx.pp_rank}_step{t:05d}.pt")
        applied_before = self.correction.num_applied
        self.model.train()
        for _ in range(cfg.grpo.ppo_epochs):
            for start in range(0, n, gbs):
                mini = slice_batch(batch, start, start + gbs)
                num_tokens = float(mini["loss_mask"].sum())
                self.optimizer.zero_grad(set_to_none=True)
                outs = self.runner.run(self.model, mini, step=t, forward_only=False,
                                       loss_fn=partial(self._update_loss_fn, num_tokens, float(gbs)))
                for o in outs:
                    for k in sums:
                        if k in o:
                            sums[k] += float(o[k])
                if self.ctx.pp_size > 1:
                    allreduce_tied_embedding_grads(self.model, self.ctx.embd_group)
                    self._embd_sync_bytes += self._tied_grad_bytes
                skipped = self.clip.num_skipped
                self.optimizer.step()
                norms.append(self.clip.last_grad_norm)
                if self.clip.num_skipped > skipped and self.ctx.is_driver:
                    print(f"[cegrpo] warning: iteration {t}: the gradient norm is {self.clip.last_grad_norm} "
                          f"(NaN or inf); the optimizer step was skipped ({self.clip.num_skipped} so far)",
                          flush=True)
        self.scheduler.step()
        out = {"actor/grad_norm": float(sum(norms) / len(norms)), "actor/lr": self.optimizer.param_groups[0]["lr"],
               "actor/num_optimizer_steps": len(norms), "actor/skipped_steps": self.clip.num_skipped}
        self._correction_applied = self.correction.num_applied - applied_before
        if self.ctx.is_last_stage:
            tok = max(sums["tokens"], 1.0)
            out.update({"actor/pg_loss": sums["pg_loss_sum"] / tok, "actor/pg_clipfrac": sums["clip_sum"] / tok,
                        "actor/ppo_kl": sums["ppo_kl_sum"] / tok})
            if self.ref_model is not None:
                out["actor/kl_loss"] = sums["kl_sum"] / tok
        return out

    def _collect_metrics(self, batch, stats: Dict[str, float], t: int, seconds: float) -> Optional[Dict]:
        ctx = self.ctx
        # last stage -> driver (loss metrics), every rank -> driver (bytes)
        obj = [stats if ctx.is_last_stage else None]
        dist.broadcast_object_list(obj, src=ctx.last_stage_rank, group=ctx.pp_group)
        last_stats = obj[0]
        local = {"comm": self.meter.snapshot_and_reset(), "weight": self._weight_change_sums(),
                 "embd_sync_bytes": self._embd_sync_bytes}
        self._embd_sync_bytes = 0
        if self.anchor is not None:
            local["anchor"] = self.anchor.metrics(t)
            local["agreement"] = self.correction.last_agreement if self._correction_applied else (0, 0)
            local["applied"] = self._correction_applied
        gathered = [None] * ctx.pp_size if ctx.is_driver else None
        dist.gather_object(local, gathered, dst=dist.get_global_rank(ctx.pp_group, 0), group=ctx.pp_group)
        if not ctx.is_driver:
            return None
        merged: Dict[str, float] = {}
        for i, d in enumerate(gathered):
            diff_sq, base_sq = d["weight"]
            merged[f"actor/weight_rel_change/stage_{i}"] = math.sqrt(diff_sq / max(base_sq, 1e-30))
        tot_diff = sum(d["weight"][0] for d in gathered)
        tot_base = sum(d["weight"][1] for d in gathered)
        merged["actor/weight_rel_change"] = math.sqrt(tot_diff / max(tot_base, 1e-30))
        for d in gathered:
            for k, v in d["comm"].items():
                if k != "comm/bytes_ratio":
                    merged[k] = merged.get(k, 0) + v
        wire = merged.get("comm/fwd_bytes", 0) + merged.get("comm/bwd_bytes", 0)
        dense = merged.get("comm/dense_equiv_bytes", 0)
        merged["comm/bytes_ratio"] = wire / dense if dense else 0.0
        scores, resp_len = batch["scores"], batch["response_lengths"].float()
        adv_seq = batch["advantages"].sum(1) / batch["loss_mask"].sum(1).clamp(min=1)
        m = {"step": t}
        m.update({
            "critic/score/mean": float(scores.mean()), "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/advantages/mean": float(adv_seq.mean()), "critic/advantages/max": float(adv_seq.max()),
            "critic/advantages/min": float(adv_seq.min()),
            "response_length/mean": float(resp_len.mean()), "response_length/max": float(resp_len.max()),
            "response_length/min": float(resp_len.min()),
            "response_length/clip_ratio": float(1.0 - batch["finished"].mean()),
            "prompt_length/mean": float(batch["prompt_lengths"].float().mean()),
        })
        m.update(last_stats)
        m.update(merged)
        if self.anchor is not None:
            m.update(self._anchor_metrics(gathered, t))
        m["comm/embd_sync_bytes"] = sum(d["embd_sync_bytes"] for d in gathered)
        m["sync/bytes"] = self.gatherer.last_bytes
        m.update(self.timers.snapshot_and_reset())
        m["timing_s/step"] = seconds
        every = self.cfg.data.eval_interval
        if every and t % every == 0:  # the other stages wait for the next batch meanwhile
            m.update(self.evaluate_suite())
        self.writer.write(m)
        return m

    def _anchor_metrics(self, gathered, t: int) -> Dict:
        """anchor/* for the log: bytes both ways (all stages), the correction, and on fire
        iterations the anchor's own statistics (branch, staleness, M norm, counters)."""
        m = {"anchor/fire": gathered[0]["anchor"]["anchor/fire"],
             "anchor/bytes_in": sum(d["anchor"]["anchor/bytes_in"] for d in gathered),
             "anchor/bytes_out": sum(d["anchor"]["anchor/bytes_out"] for d in gathered),
             "anchor/correction_applied": int(min(d["applied"] for d in gathered) > 0),
             "anchor/alive": min(d["anchor"]["anchor/alive"] for d in gathered)}
        agree = sum(d["agreement"][0] for d in gathered)
        total = sum(d["agreement"][1] for d in gathered)
        if total:
            m["anchor/sign_agreement"] = agree / total
        stats = self.anchor.stats
        if stats:
            m.update({k: v for k, v in stats.items() if k != "anchor/fire"})
            self.anchor.stats = {}
        return m

    @torch.no_grad()
    def _weight_change_sums(self):
        """(||theta - theta_0||^2, ||theta_0||^2) over this stage's parameters (fp64)."""
        diff = base = 0.0
        for p, p0 in zip(self.model.parameters(), self._theta0):
            diff += float((p.detach().double() - p0.double()).square().sum())
            base += float(p0.double().square().sum())
        return diff, base

    # ------------------------------------------------------------ evaluation
    def evaluate_holdout(self) -> Optional[Dict[str, float]]:
        """Greedy accuracy of the dense sampler on the held-out training rows (driver only):
        ``val/holdout/acc``, ``val/holdout/num_rows``."""
        if not self.ctx.is_driver or not self.holdout_records:
            return None
        from megatron_cegrpo.evaluation import evaluate

        with _all_cores():
            return evaluate(self.rollout, self.tokenizer, {"holdout": self.holdout_records}, modes="greedy",
                            max_new_tokens=self.cfg.data.eval_max_new_tokens,
                            batch_size=self.cfg.data.eval_batch_size, template=self.cfg.data.prompt_template,
                            progress=False, seed=self.cfg.optim.seed)

    def evaluate_suite(self) -> Optional[Dict[str, float]]:
        """Dense-view evaluation on ``--eval-datasets`` (greedy or avg@k per data set; driver
        only): ``val/<dataset>/acc`` and friends (``megatron_cegrpo.evaluation``)."""
        if not self.ctx.is_driver or not self.eval_sets:
            return None
        from megatron_cegrpo.evaluation import evaluate

        with _all_cores():
            ev = evaluate(self.rollout, self.tokenizer, self.eval_sets, modes=self.eval_modes,
                          max_new_tokens=self.cfg.data.eval_max_new_tokens,
                          batch_size=self.cfg.data.eval_batch_size, template=self.cfg.data.prompt_template,
                          progress=self.cfg.logging.tqdm, seed=self.cfg.optim.seed)
        accs = ", ".join(f"{k[4:-4]} {v:.3f}" for k, v in ev.items() if k.startswith("val/") and k.endswith("/acc"))
        _log(self.ctx, f"dense-view evaluation at iteration {self.iteration}: {accs}")
        return ev

    # ------------------------------------------------------------ the loop
    def train(self) -> Optional[Dict]:
        cfg, ctx = self.cfg, self.ctx
        summary = {}
        if cfg.data.eval_interval and self.iteration == 0:
            ev = self._barrier_after(self.evaluate_suite)
            if ev:
                self.writer.write({"step": 0, **ev})
        if cfg.data.num_holdout and self.iteration == 0:
            before = self._barrier_after(self.evaluate_holdout)
            if before:
                summary["initial"] = before
                self.writer.write({"step": 0, **before})
                _log(ctx, f"held-out greedy accuracy before training: {before['val/holdout/acc']:.3f} "
                          f"({before['val/holdout/num_rows']} rows, {before['timing_s/eval']:.0f} s)")
        bar = None
        if ctx.is_driver and cfg.logging.tqdm:
            from tqdm import tqdm

            bar = tqdm(total=cfg.optim.train_iters, desc="GRPO", unit="it", file=sys.stdout, dynamic_ncols=True)
        last = None
        while self.iteration < cfg.optim.train_iters:
            m = self.train_step()
            c = cfg.checkpoint
            if is_save_iteration(self.iteration, c.save, c.save_interval, cfg.optim.train_iters):
                with self.timers.phase("save"):
                    self.save_checkpoint()
            if ctx.is_driver:
                last = m
                line = format_progress(m, cfg.optim.train_iters)
                if bar is not None:
                    bar.update(1)
                    if m["step"] % cfg.logging.log_interval == 0:
                        bar.write(line)
                elif m["step"] % cfg.logging.log_interval == 0:
                    print(line, flush=True)
        if bar is not None:
            bar.close()
        if self.anchor is not None:
            self.anchor.finish(self.iteration, self.timers)
        if cfg.data.num_holdout:
            after = self._barrier_after(self.evaluate_holdout)
            if after:
                summary["final"] = after
                self.writer.write({"step": self.iteration, **after})
                _log(ctx, f"held-out greedy accuracy after {self.iteration} iterations: "
                          f"{after['val/holdout/acc']:.3f} ({after['val/holdout/num_rows']} rows)")
        if ctx.is_driver:
            summary["last_metrics"] = last
            with open(os.path.join(cfg.logging.log_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            _log(ctx, f"metrics: {self.writer.path}")
            self.writer.close()
        return summary if ctx.is_driver else None

    # ------------------------------------------------------------ checkpoints
    def _reference_tensors(self) -> Dict[str, torch.Tensor]:
        names = [n for n, _ in self.model.named_parameters()]
        return dict(zip(names, self._theta0))

    def save_checkpoint(self) -> str:
        """Write everything the run needs to continue bit for bit (docs: README "Checkpoints").

        Per stage: ``model`` and ``reference`` weights (safetensors) and a ``trainer_state``
        blob (optimizer moments and steps, LR scheduler, every RNG, byte-meter totals,
        codec state; on the driver also the prompt sampler's position). Atomic: see
        ``megatron_cegrpo.checkpointing``.
        """
        from megatron_cegrpo import checkpointing as ck
        from megatron_cegrpo.rng_state import get_rng_state

        cfg, ctx, it = self.cfg, self.ctx, self.iteration
        bad = [n for n, p in self.model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
        if bad:
            raise ck.CheckpointError(f"stage {ctx.pp_rank}: refusing to save non-finite weights ({bad[:3]}); "
                                     f"resume from the last checkpoint with a lower --lr")
        # the stages' collectives only: a dead or slow anchor cannot block a save
        tmp = ck.begin_save(cfg.checkpoint.save, it, group=ctx.pp_group)
        ck.write_stage_file(tmp, ctx.pp_rank, ck.MODEL_FILE, ck.stage_model_state_dict(self.model))
        ck.write_stage_file(tmp, ctx.pp_rank, "reference", self._reference_tensors())
        state = {
            "iteration": it,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": get_rng_state(),
            "meter": self.meter.state_dict(),
            "codec": self.codec.state_dict(),
        }
        if ctx.is_driver:
            state["sampler"] = self.sampler.state_dict()
        if self.anchor is not None:
            state["anchor_client"] = self.anchor.state_dict()
        ck.write_stage_blob(tmp, ctx.pp_rank, "trainer_state", state)
        if self.anchor is not None and ctx.is_driver:
            self.anchor.save_anchor_state(tmp, ck.ANCHOR_DIR)
        meta = ck.make_meta(
            hf_config=self.hf_config, pp_size=ctx.pp_size,
            num_layers_in_first=cfg.parallel.decoder_first_pipeline_num_layers,
            num_layers_in_last=cfg.parallel.decoder_last_pipeline_num_layers,
            codec=cfg.codec, model_name=cfg.model.model, params_dtype=cfg.model.params_dtype,
            extra={"seed": cfg.optim.seed, "train_data": cfg.data.train_data}, options=cfg.resume_options())
        path = ck.commit_save(cfg.checkpoint.save, tmp, it, meta, cfg.checkpoint.keep_last, group=ctx.pp_group)
        _log(ctx, f"saved checkpoint {path}")
        return path

    def load_checkpoint(self, load_dir: str) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` (every rank, its stage).

        A collective over the pipeline group: a problem one stage finds (a corrupt file of
        its own) is raised on every stage (``checkpointing.agree_on_errors``).

        ``--load`` without a checkpoint starts fresh only when it is the ``--save``
        directory (auto-resume); options that shape the trajectory must equal the
        checkpoint's (``checkpointing.check_resume``; weights-only checkpoints start a new
        run and are not compared).

        Raises:
            CheckpointError: missing, corrupt (sha256 mismatch), or incompatible checkpoint
                (another model, PP size / split, codec or trajectory option), or a --load
                other than --save that holds no checkpoint, naming the file and the fix.
        """
        from megatron_cegrpo import checkpointing as ck

        ck.agree_on_errors(lambda: self._load_checkpoint_here(load_dir), group=self.ctx.pp_group)

    def _load_checkpoint_here(self, load_dir: str) -> None:
        """This rank's part of :meth:`load_checkpoint`."""
        from megatron_cegrpo import checkpointing as ck
        from megatron_cegrpo.models import load_stage_weights as _load

        cfg, ctx = self.cfg, self.ctx
        self._resume_rng = self._resume_sampler = None
        found = ck.find_resume_checkpoint(load_dir, cfg.checkpoint.save)
        if found is None:
            _log(ctx, f"--load {load_dir} holds no checkpoint yet (it is the --save directory): starting from "
                      f"--model {cfg.model.model}")
            return
        ckpt_dir, it = found
        meta = ck.read_meta(ckpt_dir)
        ck.check_compatible(meta, hf_config=self.hf_config, pp_size=ctx.pp_size,
                            num_layers_in_first=cfg.parallel.decoder_first_pipeline_num_layers,
                            num_layers_in_last=cfg.parallel.decoder_last_pipeline_num_layers, codec=cfg.codec)
        weights_only = "trainer_state.pt" not in ck.stage_file_names(meta, ctx.pp_rank)
        if not weights_only:
            for warning in ck.check_resume(meta, cfg.resume_options(), train_iters=cfg.optim.train_iters):
                _log(ctx, f"warning: {warning}")
        ck.load_stage_model(ckpt_dir, ctx.pp_rank, self.model, meta=meta)
        if weights_only:
            # a converted, weights-only checkpoint: the run starts at iteration 0 from these weights
            if self.ref_model is not None:
                ck.load_stage_model(ckpt_dir, ctx.pp_rank, self.ref_model, meta=meta)
                self._theta0 = [p.detach() for p in self.ref_model.parameters()]
            else:
                self._theta0 = [p.detach().clone() for p in self.model.parameters()]
            _log(ctx, f"initialised the policy and the reference from {ckpt_dir} (weights only)")
            return
        ref = ck.read_stage_file(ckpt_dir, ctx.pp_rank, "reference", meta=meta)
        if self.ref_model is not None:
            _load(self.ref_model, ref)
            self._theta0 = [p.detach() for p in self.ref_model.parameters()]
        else:
            names = [n for n, _ in self.model.named_parameters()]
            self._theta0 = [ref[n].clone() for n in names]
        state = ck.read_stage_blob(ckpt_dir, ctx.pp_rank, "trainer_state", meta=meta)
        if state["iteration"] != it:
            raise ck.CheckpointError(f"{ckpt_dir}: trainer_state says iteration {state['iteration']}, "
                                     f"the directory {it}; the checkpoint is inconsistent")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.meter.load_state_dict(state["meter"])
        self.codec.load_state_dict(state["codec"])
        if self.anchor is not None and "anchor_client" in state:
            self.anchor.load_state_dict(state["anchor_client"])
        self._resume_rng = state["rng"]
        self._resume_sampler = state.get("sampler")
        self.iteration = it
        _log(ctx, f"resuming from {ckpt_dir} (iteration {it})")

    def _restore_driver_and_sync(self) -> None:
        """After load: the driver's data position, the sampler's weights, then the RNGs."""
        from megatron_cegrpo.rng_state import set_rng_state

        if self.ctx.is_driver:
            if self._resume_sampler is not None:
                self.sampler.load_state_dict(self._resume_sampler)
            for warning in truncate_metrics(self.writer.path, self.iteration):
                _log(self.ctx, f"warning: {warning}")
        stage_sds = self.gatherer.gather()
        if self.ctx.is_driver:
            self.rollout.update_weights(megatron_to_hf(stage_sds, self.hf_config, self.tf_config, self.ctx.pp_size))
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)

    def _barrier_after(self, fn):
        """Run a driver-only phase while the other stages wait."""
        res = fn()
        dist.barrier(group=self.ctx.rollout_group)
        return res


class _all_cores:
    """Give the driver every core while the other ranks wait (generation and eval only)."""

    def __enter__(self):
        self.prev = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or self.prev)

    def __exit__(self, *exc):
        torch.set_num_threads(self.prev)
