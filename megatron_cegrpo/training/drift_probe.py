"""The compression-off drift probe (status 2026-07-31 section 3, "A drift controller"; issue 31
item 1; docs/training_health.md).

Every ``--drift-probe-interval`` iterations, before the update, the stage repeats the
old-logprob pass and the base model's pass with the dense codec, billed to a meter of its own
(:meth:`DriftProbe.run`, ``probe/bytes``, timer ``timing_s/probe``); once the compressed view's
old log-probs exist (after the update where they come from the update pass,
``TrainConfig.old_log_prob_from_update``), :meth:`DriftProbe.metrics` reports the two views side
by side. It measures in every configuration:

- the dense-view drift: ``probe/kl_to_base``, KL(pi_t || pi_base) per response token, both
  log-probs through dense boundaries. The base model is the frozen reference when the loss has a
  KL term (``--kl-coef`` > 0), else a frozen copy of the base stage the trainer builds only when
  the probe is on (``StageWorker.base_model``; it stands in for the copy of the base weights
  every stage keeps anyway for ``actor/weight_rel_change``, so the parameter memory is unchanged);
- the compression-view gap ``probe/view_abs_logprob_diff`` (compressed vs dense trainer view, the
  codec's own error on the policy's log-probs) and its least-squares slope over the last
  ``--drift-probe-window`` probes, ``probe/view_gap_slope`` (nats per token per iteration);
- the weight movement per stage, ``actor/weight_rel_change/stage_<i>`` = ||theta - theta_base|| /
  ||theta_base|| (logged every iteration by the stage worker, ``stage.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_cegrpo.compression import ByteMeter, build_codec
from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.training import data_parallel as dpx
from megatron_cegrpo.grpo.batch import RolloutBatch

__all__ = ["DriftProbe", "KL_TO_BASE_ESTIMATOR", "window_slope"]

#: the estimator of ``probe/kl_to_base`` whatever ``--kl-loss-type`` is: k3 (``low_var_kl``),
#: non-negative and unbiased for KL(pi || pi_base) on tokens drawn from pi (Schulman 2020,
#: "Approximating KL divergence"; ``core_algos.kl_penalty``)
KL_TO_BASE_ESTIMATOR = "low_var_kl"


def window_slope(points: Sequence[Tuple[int, float]]) -> float:
    """Ordinary least-squares slope of ``y`` on ``t`` over ``points`` ([(t, y)], fp64):
    sum((t - mean t)(y - mean y)) / sum((t - mean t)^2), units of y per iteration.

    Raises:
        ValueError: fewer than two points or all at the same t.
    """
    if len(points) < 2:
        raise ValueError(f"a slope needs two points or more, got {len(points)}")
    ts, ys = [float(t) for t, _ in points], [float(y) for _, y in points]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        raise ValueError("a slope needs points at two iterations or more")
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


class DriftProbe:
    """One stage's side of the probe.

    Args:
        stage: the :class:`~megatron_cegrpo.training.stage.StageWorker` (PP >= 2: its
            communicator switches to the dense codec for the probe's passes); its ``base_model``
            is the frozen base stage.
        window: ``--drift-probe-window``, the probes in ``probe/view_gap_slope``.
    """

    def __init__(self, stage, window: int = 8):
        self.stage, self.window = stage, int(window)
        self.meter = ByteMeter()  # the probe's own dense traffic, never in comm/*
        self.dense = build_codec("dense")
        self._passes = None  # the dense passes of the last run(), until metrics()
        self._gaps: List[Tuple[int, float]] = []  # (t, probe/view_abs_logprob_diff) of the last probes

    @staticmethod
    def declare_metrics(reducer) -> None:
        """``probe/bytes`` (:meth:`stage_metrics`) sums over the stages."""
        reducer.declare("probe/bytes", "sum")

    @torch.no_grad()
    def run(self, batch: RolloutBatch, t: int) -> None:
        """The dense policy and base passes of iteration ``t`` at the current weights."""
        st = self.stage
        lp_fn = partial(st.logprob_loss_fn, False)
        st.tied.refresh_rows(batch["tokens"])
        with st.comm.using(self.dense, self.meter):
            dense = st.runner.run(st.model, batch, step=t, forward_only=True, loss_fn=lp_fn)
            base = st.runner.run(st.base_model, batch, step=t, forward_only=True, loss_fn=lp_fn)
        self._passes = (dense, base)

    def stage_metrics(self) -> Dict[str, int]:
        """``probe/bytes``: this stage's probe bytes sent (both directions) since the last call,
        on iterations that probed ({} otherwise)."""
        m = self.meter.snapshot_and_reset()
        sent = m["comm/fwd_bytes"] + m["comm/bwd_bytes"]
        return {"probe/bytes": sent} if m["comm/dense_equiv_bytes"] else {}

    @torch.no_grad()
    def metrics(self, batch: RolloutBatch, t: int, dense_step: bool = False) -> Dict[str, float]:
        """The last :meth:`run`'s numbers beside the compression view's, nats per response token
        over the batch's replicas (the last stage; {} on the others):

        - ``probe/kl_to_base``: KL(pi_t || pi_base), dense view, k3 (:data:`KL_TO_BASE_ESTIMATOR`);
        - ``probe/abs_logprob_diff_mean``: |sampler - dense trainer| (the true train-inference
          mismatch; ~0 with the dense, synced sampler);
        - ``probe/view_abs_logprob_diff``: |compressed - dense trainer view|, and
          ``probe/view_gap_slope``, its least-squares slope over the last ``window`` probes of
          compressed iterations (:func:`window_slope`; from the second on). On a dense step
          (``dense_step``) the compressed view is dense, so the gap is 0: logged, but kept out of
          the window, and no slope is logged;
        - with a reference (``--kl-coef`` > 0) ``probe/kl_to_ref`` (by ``--kl-loss-type``, dense
          view) and ``probe/kl_to_ref_compressed`` (the same in the compression view).

        Raises:
            RuntimeError: no :meth:`run` since the last call.
        """
        if self._passes is None:
            raise RuntimeError("DriftProbe.metrics() before DriftProbe.run() of this iteration")
        (dense, base), self._passes = self._passes, None
        st = self.stage
        if not st.ctx.is_last_stage:
            return {}
        lp, base_lp = torch.cat([o["logprobs"] for o in dense]), torch.cat([o["logprobs"] for o in base])
        mask = batch["loss_mask"]
        names = ["probe/abs_logprob_diff_mean", "probe/view_abs_logprob_diff", "probe/kl_to_base"]
        vals = [(batch["sampler_logprobs"] - lp).abs(), (batch["old_logprobs"] - lp).abs(),
                ca.kl_penalty(lp, base_lp, KL_TO_BASE_ESTIMATOR, mask)]
        if st.ref_model is not None:  # the base model is the reference
            kind = st.cfg.grpo.kl_loss_type
            names += ["probe/kl_to_ref", "probe/kl_to_ref_compressed"]
            vals += [ca.kl_penalty(lp, base_lp, kind, mask),
                     ca.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], kind, mask)]
        out = dict(zip(names, dpx.masked_means(vals, mask, st.dp_group)))
        if not dense_step:
            self._gaps = (self._gaps + [(t, out["probe/view_abs_logprob_diff"])])[-self.window:]
        if len(self._gaps) >= 2 and not dense_step:
            out["probe/view_gap_slope"] = window_slope(self._gaps)
        return out

    def state_dict(self) -> Dict:
        return {"gaps": [list(p) for p in self._gaps]}

    def load_state_dict(self, state: Dict) -> None:
        self._gaps = [(int(t), float(y)) for t, y in state["gaps"]]
