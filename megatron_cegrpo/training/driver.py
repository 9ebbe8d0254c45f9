"""The driver's work on rank 0 (DESIGN.md section 1 and section 2, steps 1-3, 8, 9): data,
the dense sampler, the reward, evaluation, the log.

Only rank 0 builds a :class:`Driver`; the stages never see it.
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Dict, List, Optional

import torch

from megatron_cegrpo.compat.placement import usable_cores
from megatron_cegrpo.data import PromptSampler, encode_prompt, load_train_split, select_prompts
from megatron_cegrpo.evaluation import evaluate_detailed, load_eval_datasets, parse_dataset_specs, write_eval_rows
from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.grpo.batch import RolloutBatch, pack_rollouts
from megatron_cegrpo.grpo.dynamic_sampling import enough_mixed, round_seed, select_groups
from megatron_cegrpo.metrics import build_writers, logged_restarts, lost_iterations, truncate_metrics
from megatron_cegrpo.models import load_tokenizer, megatron_to_hf
from megatron_cegrpo.models.stage import PolicyStage
from megatron_cegrpo.restart import elastic_restarts
from megatron_cegrpo.rewards import get_verifier, score_responses
from megatron_cegrpo.rewards.custom import load_custom_reward_function
from megatron_cegrpo.rollout.base import RolloutOutput, get_rollout_engine
from megatron_cegrpo.training.ledger import RunLedger

__all__ = ["Driver", "all_cores", "log", "rollout_engine_options"]


def log(msg: str) -> None:
    """A driver line on stdout (``[cegrpo] ...``)."""
    print(f"[cegrpo] {msg}", flush=True)


def rollout_engine_options(cfg, hf_config) -> Dict:
    """The keyword arguments of ``--rollout-engine`` beyond those every engine takes: for vllm
    the longest sequence (``vllm_config.max_model_len``), ``--rollout-kv-cache-mb``,
    ``--rollout-compile`` and the run's seed; for hf the compute dtype
    (``compat.precision.rollout_compute_dtype``)."""
    r = cfg.rollout
    if r.engine != "vllm":
        from megatron_cegrpo.compat.precision import rollout_compute_dtype

        return {"compute_dtype": rollout_compute_dtype(r)}
    from megatron_cegrpo.rollout.vllm_config import max_model_len

    return dict(max_model_len=max_model_len(r.max_prompt_length, r.max_new_tokens, cfg.data.eval_max_new_tokens,
                                            int(getattr(hf_config, "max_position_embeddings", 0) or 0)),
                kv_cache_mb=r.kv_cache_mb, compile=r.compile, seed=cfg.optim.seed)


class all_cores:
    """Give the driver every core it may use (:func:`usable_cores`) while the other ranks wait
    (generation and evaluation)."""

    def __enter__(self):
        self.prev = torch.get_num_threads()
        torch.set_num_threads(usable_cores())

    def __exit__(self, *exc):
        torch.set_num_threads(self.prev)


class Driver:
    """Prompts, sampler, reward and log of the run.

    Args:
        cfg: the TrainConfig.
        policy: the stage built on rank 0, with ``hf_state_dict`` kept (the sampler's weights).
        tf_config: the pipeline's TransformerConfig (HF <-> megatron names).
        pp_size: pipeline stages.
    """

    def __init__(self, cfg, policy: PolicyStage, pp_size: int):
        self.cfg, self.hf_config, self.tf_config, self.pp_size = cfg, policy.hf_config, policy.tf_config, pp_size
        d = cfg.data
        self.tokenizer = load_tokenizer(policy.source)
        split = load_train_split(d.train_data, format=d.train_data_format, num_holdout=d.num_holdout,
                                 seed=cfg.holdout_split_seed, data_root=d.data_root)
        encode = partial(encode_prompt, self.tokenizer, template=d.prompt_template)
        kept, self.prompt_ids, too_long = select_prompts(split.train, encode, cfg.rollout.max_prompt_length,
                                                         source=f"--train-data {split.path}")
        if too_long:
            log(f"warning: skipped {too_long} prompts longer than --max-prompt-length="
                f"{cfg.rollout.max_prompt_length} tokens")
        self.train_records, self.holdout_records = kept, split.holdout
        self.sampler = PromptSampler(len(kept), cfg.grpo.rollout_batch_size, cfg.optim.seed)
        self.ledger = RunLedger()  # the whole-step ledger over the run (training/ledger.py), checkpointed
        self._rollout_metrics: Dict[str, float] = {}  # --filter-groups: the last batch's (rollout_metrics)
        self._reward_metrics: Dict[str, float] = {}  # --overlong-buffer-len: the last batch's (rollout_metrics)
        # training reward: the data set's verifier or a custom function; evaluation: the verifier
        custom = load_custom_reward_function(d.custom_reward_function) if d.custom_reward_function else None
        self.get_reward_fn = (lambda _name: custom) if custom is not None else get_verifier
        self.rollout = get_rollout_engine(cfg.rollout.engine, hf_config=policy.hf_config,
                                          hf_state_dict=policy.hf_state_dict, tokenizer=self.tokenizer,
                                          dtype=cfg.rollout.dtype, **rollout_engine_options(cfg, policy.hf_config))
        lg = cfg.logging
        self.recovery = self._recovery_start(os.path.join(lg.log_dir, "metrics.jsonl"))
        self.writer = build_writers(lg.log_dir, wandb_project=lg.wandb_project, tensorboard_dir=lg.tensorboard_dir,
                                    config=cfg.to_dict(), resume=bool(cfg.checkpoint.load),
                                    run_name=lg.wandb_run_name, wandb_mode=lg.wandb_mode)
        self.eval_modes = self.eval_sets = None
        if d.eval_datasets:
            self.eval_modes = parse_dataset_specs(d.eval_datasets)
            self.eval_sets = load_eval_datasets(list(self.eval_modes), d.eval_limit, d.data_root)
        with open(os.path.join(lg.log_dir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        dup = f" ({split.duplicates_dropped} training rows repeating a held-out question dropped)" \
            if split.duplicates_dropped else ""
        log(f"data {split.path}: {len(kept)} train prompts, {len(split.holdout)} held out{dup}")

    def _recovery_start(self, path: str) -> Dict[str, int]:
        """Under torchrun with ``--max-restarts``: ``recovery/restarts`` (this start's restart count)
        and ``recovery/lost_iterations`` (0 here; counted by :meth:`resume_log`, or here when a
        restart without ``--load`` starts over and the log is about to be cleared); else nothing."""
        r = elastic_restarts()
        if r is None:
            return {}
        lost = lost_iterations(path, 0) if r.restarted and not self.cfg.checkpoint.load else 0
        return {"recovery/restarts": r.count, "recovery/lost_iterations": lost}

    # ------------------------------------------------------------------ steps 1-3
    def generate_and_score(self, t: int, timers) -> RolloutBatch:
        """Draw B prompts, generate G responses each with the dense sampler, score them,
        group-normalise the advantages and pack the batch (``grpo/batch.py``).

        With ``--filter-groups`` (DAPO's dynamic sampling, ``grpo/dynamic_sampling.py``): rounds
        of ``--gen-batch-size`` more prompts (default B) until B groups with mixed scores are drawn
        or ``--max-num-gen-batches`` rounds were; the batch is B of the groups drawn
        (:meth:`rollout_metrics` says which)."""
        if not self.cfg.grpo.filter_groups:
            idx = self.sampler.next_batch()
            out, scores = self._generate_round(idx, t, 0, timers)
            return self._pack(out, scores, timers)
        B, G = self.cfg.grpo.rollout_batch_size, self.cfg.grpo.num_generations
        rounds, tied = [], []
        while not enough_mixed(tied, B) and len(rounds) < self.cfg.grpo.max_num_gen_batches:
            out, scores = self._generate_round(self.sampler.next_batch(self.cfg.grpo.prompts_per_round), t,
                                               len(rounds), timers)
            rounds.append((out, scores))
            tied.append(ca.tied_groups(scores, G))
        sel = select_groups(tied, B)
        rows = [(r, g * G + j) for r, g in sel.groups for j in range(G)]
        out = RolloutOutput(*([getattr(rounds[r][0], k)[i] for r, i in rows]
                              for k in ("prompt_ids", "response_ids", "response_logprobs", "texts")),
                            finished=torch.stack([rounds[r][0].finished[i] for r, i in rows]))
        scores = torch.stack([rounds[r][1][i] for r, i in rows])
        self._rollout_metrics = sel.metrics()
        self._rollout_metrics["batch/kept_groups"] = int((~ca.tied_groups(scores, G)).sum())  # of the batch itself
        if sel.filled_with_tied:
            log(f"iteration {t}: {sel.kept} groups of {B} with mixed scores after {sel.rounds} generation rounds "
                f"(--max-num-gen-batches); {sel.filled_with_tied} tied groups fill the batch")
        return self._pack(out, scores, timers)

    def _generate_round(self, idx: List[int], t: int, r: int, timers):
        """Generation round ``r`` of iteration ``t``: G responses to each prompt of ``idx``, scored.
        Returns (the RolloutOutput, fp32 scores [len(idx) * G])."""
        cfg, G = self.cfg, self.cfg.grpo.num_generations
        with timers.phase("gen"):
            prompts = [self.prompt_ids[i] for i in idx for _ in range(G)]
            with all_cores():
                out = self.rollout.generate(prompts, max_new_tokens=cfg.rollout.max_new_tokens,
                                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                            generator_seed=round_seed(cfg.optim.seed, t, r))
        with timers.phase("reward"):
            recs = [self.train_records[i] for i in idx for _ in range(G)]
            scores = score_responses(self.get_reward_fn, cfg.data.custom_reward_function, recs, out.texts)
        return out, scores

    def _pack(self, out, scores: torch.Tensor, timers) -> RolloutBatch:
        """Group-normalised advantages of the rewards and the packed batch of ``out``. The rewards
        are the verifier's ``scores``, plus DAPO's overlong penalty with ``--overlong-buffer-len``
        (``ca.overlong_penalty``; ``--filter-groups`` judges ties on the scores, verl's ``acc``)."""
        g = self.cfg.grpo
        with timers.phase("reward"):
            rewards = scores
            if g.overlong_buffer_len:
                lengths = torch.tensor([r.numel() for r in out.response_ids])
                penalty = ca.overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, g.overlong_buffer_len,
                                              g.overlong_penalty_factor)
                rewards = scores + penalty
                G = g.num_generations
                length_only = ca.tied_groups(scores, G) & ~ca.tied_groups(rewards, G)
                self._reward_metrics = {
                    "critic/rewards/mean": float(rewards.mean()), "critic/rewards/max": float(rewards.max()),
                    "critic/rewards/min": float(rewards.min()),
                    "response_length/overlong_penalty": float(penalty.mean()),
                    "response_length/overlong_frac": float((penalty < 0).float().mean()),
                    "response_length/length_only_groups": int(length_only.sum())}
            adv = ca.compute_grpo_outcome_advantage(rewards, g.num_generations, norm_adv_by_std=g.norm_adv_by_std)
        batch = pack_rollouts(out.prompt_ids, out.response_ids, out.response_logprobs, scores, adv,
                              pad_token_id=self.rollout.pad_token_id,
                              max_seq_length=int(self.hf_config.max_position_embeddings))
        batch["finished"] = out.finished.float()
        return batch

    def rollout_metrics(self) -> Dict[str, float]:
        """The last batch's ``batch/*`` metrics of ``--filter-groups`` (empty without it):
        ``batch/num_gen_batches`` (rounds drawn), ``batch/kept_groups`` (groups of the batch with
        mixed scores), ``batch/filled_with_tied`` (tied groups of the batch: the bound was hit),
        ``batch/tied_groups_dropped``, ``batch/mixed_groups_unused`` (drawn, left out); and with
        ``--overlong-buffer-len`` verl's ``critic/rewards/{mean,max,min}`` (score + length penalty),
        ``response_length/overlong_penalty`` (its mean), ``response_length/overlong_frac`` (the
        share of responses it touched) and ``response_length/length_only_groups`` (groups whose
        scores tie and whose rewards do not: their advantages come from the penalty alone)."""
        return {**self._rollout_metrics, **self._reward_metrics}

    @staticmethod
    def batch_metrics(batch: RolloutBatch) -> Dict[str, float]:
        """verl's ``critic/*``, ``response_length/*`` and ``prompt_length/mean`` of a batch, and
        ``batch/response_tokens`` (the tokens the loss trains on; the ledger's per-token bytes)."""
        scores, resp_len = batch["scores"], batch["response_lengths"].float()
        adv_seq = batch["advantages"].sum(1) / batch["loss_mask"].sum(1).clamp(min=1)
        return {
            "critic/score/mean": float(scores.mean()), "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "critic/advantages/mean": float(adv_seq.mean()), "critic/advantages/max": float(adv_seq.max()),
            "critic/advantages/min": float(adv_seq.min()),
            "response_length/mean": float(resp_len.mean()), "response_length/max": float(resp_len.max()),
            "response_length/min": float(resp_len.min()),
            "response_length/clip_ratio": float(1.0 - batch["finished"].mean()),
            "prompt_length/mean": float(batch["prompt_lengths"].float().mean()),
            "batch/response_tokens": int(batch["response_lengths"].sum()),
        }

    # ------------------------------------------------------------------ step 8
    def update_sampler(self, stage_sds: List[Dict[str, torch.Tensor]]) -> None:
        """The sampler takes the stages' new weights (HF names)."""
        self.rollout.update_weights(megatron_to_hf(stage_sds, self.hf_config, self.tf_config, self.pp_size))

    # ------------------------------------------------------------------ evaluation
    def evaluate_holdout(self, step: int) -> Optional[Dict[str, float]]:
        """Greedy accuracy of the dense sampler on the held-out training rows at training step
        ``step`` (0: before training): ``val/holdout/acc``, ``val/holdout/num_rows`` and friends
        (None without held-out rows). Each row's correctness goes to
        ``<log dir>/eval_rows/holdout-step<step>.jsonl`` (:meth:`_keep_rows`)."""
        if not self.holdout_records:
            return None
        with all_cores():
            report = evaluate_detailed(self.rollout, self.tokenizer, {"holdout": self.holdout_records},
                                       modes="greedy", max_new_tokens=self.cfg.data.eval_max_new_tokens,
                                       batch_size=self.cfg.data.eval_batch_size,
                                       template=self.cfg.data.prompt_template, progress=False,
                                       seed=self.cfg.optim.seed)
        self._keep_rows(report, step)
        return report.metrics

    def evaluate_on_cadence(self, t: int) -> Dict[str, float]:
        """The evaluations due after iteration ``t``: ``--eval-datasets`` every ``--eval-interval``
        iterations (:meth:`evaluate_suite`) and the held-out rows every ``--holdout-eval-interval``
        (:meth:`evaluate_holdout`, the learning curve; not after the last iteration, whose held-out
        evaluation is the trainer's after training). Returns their metrics ({} when none is due)."""
        d, m = self.cfg.data, {}
        if d.eval_interval and t % d.eval_interval == 0:
            m.update(self.evaluate_suite(t) or {})
        if d.holdout_eval_interval and t % d.holdout_eval_interval == 0 and t < self.cfg.optim.train_iters:
            ho = dict(self.evaluate_holdout(t))
            ho["timing_s/eval"] += m.get("timing_s/eval", 0.0)  # both evaluations' time when both ran
            m.update(ho)
            log(f"held-out greedy accuracy at iteration {t}: {ho['val/holdout/acc']:.3f} ± "
                f"{ho['val/holdout/acc_stderr']:.3f} ({ho['timing_s/eval/holdout']:.0f} s)")
        return m

    def evaluate_suite(self, iteration: int) -> Optional[Dict[str, float]]:
        """Dense-view evaluation on ``--eval-datasets`` (greedy or avg@k per data set) at training
        step ``iteration``: ``val/<dataset>/acc`` and friends (``megatron_cegrpo.evaluation``);
        None without them. Each data set's per-row scores go to
        ``<log dir>/eval_rows/<name>-step<iteration>.jsonl`` (:meth:`_keep_rows`)."""
        if not self.eval_sets:
            return None
        with all_cores():
            report = evaluate_detailed(self.rollout, self.tokenizer, self.eval_sets, modes=self.eval_modes,
                                       max_new_tokens=self.cfg.data.eval_max_new_tokens,
                                       batch_size=self.cfg.data.eval_batch_size,
                                       template=self.cfg.data.prompt_template, progress=self.cfg.logging.tqdm,
                                       seed=self.cfg.optim.seed)
        self._keep_rows(report, iteration)
        ev = report.metrics
        accs = ", ".join(f"{k[4:-4]} {v:.3f}" for k, v in ev.items() if k.startswith("val/") and k.endswith("/acc"))
        log(f"dense-view evaluation at iteration {iteration}: {accs}")
        return ev

    def _keep_rows(self, report, step: int) -> None:
        """Every data set's per-row correctness of ``report`` into the log dir
        (``evaluation.write_eval_rows``); a file that cannot be written is a warning, not the
        end of the run (the evaluation's means are in metrics.jsonl all the same)."""
        for res in report.datasets.values():
            try:
                write_eval_rows(self.cfg.logging.log_dir, res, step)
            except OSError as e:
                log(f"warning: the per-row scores of {res.name} at step {step} were not written ({e}); "
                    "the paired statistics of tools/study_report.py will be missing for this run")

    # ------------------------------------------------------------------ log and state
    def write(self, record: Dict) -> None:
        """One record into every writer, with the ``recovery/*`` keys of a run that may restart."""
        self.writer.write({**record, **self.recovery})

    def resume_log(self, iteration: int) -> None:
        """Drop log lines past the checkpoint's iteration (and a corrupt last line); on a restart,
        count them first as ``recovery/lost_iterations``."""
        if self.recovery.get("recovery/restarts"):
            self.recovery["recovery/restarts"] = max(self.recovery["recovery/restarts"],
                                                     logged_restarts(self.writer.path) + 1)
            lost = lost_iterations(self.writer.path, iteration)
            log(f"restart {self.recovery['recovery/restarts']}: resuming at iteration {iteration + 1}; "
                f"iterations recomputed over the run: {lost} (recovery/lost_iterations)")
            self.recovery["recovery/lost_iterations"] = lost
        for warning in truncate_metrics(self.writer.path, iteration):
            log(f"warning: {warning}")

    def close(self, summary: Dict) -> None:
        """Write ``summary.json`` (with the run's byte totals under ``"comm"``) and close the log."""
        summary["comm"] = self.ledger.totals()
        log(self.ledger.describe())
        with open(os.path.join(self.cfg.logging.log_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        log(f"metrics: {self.writer.path}")
        self.writer.close()

    def state_dict(self) -> Dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
