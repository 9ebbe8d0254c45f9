"""The compression-off drift probe (status 2026-07-31 section 3, "A drift controller").

Every ``--drift-probe-interval`` iterations, before the update, the stage repeats the
old-logprob (and reference) passes with the dense codec, billed to a meter of its own
(:meth:`DriftProbe.run`); once the compressed view's old log-probs exist (after the update
where they come from the update pass, ``TrainConfig.old_log_prob_from_update``),
:meth:`DriftProbe.metrics` reports the two views side by side.
"""

from __future__ import annotations

from functools import partial
from typing import Dict

import torch

from megatron_cegrpo.compression import ByteMeter, get_codec
from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.training import data_parallel as dpx

__all__ = ["DriftProbe"]


class DriftProbe:
    """One stage's side of the probe.

    Args:
        stage: the :class:`~megatron_cegrpo.training.stage.StageWorker` (PP >= 2: its
            communicator switches to the dense codec for the probe's passes).
    """

    def __init__(self, stage):
        self.stage = stage
        self._passes = None  # the dense passes of the last run(), until metrics()

    @torch.no_grad()
    def run(self, batch: Dict[str, torch.Tensor], t: int) -> None:
        """The dense old-logprob (and reference) passes of iteration ``t`` at the current weights."""
        st = self.stage
        lp_fn = partial(st._logprob_loss_fn, False)
        st.tied.refresh_rows(batch["tokens"])
        with st.comm.using(get_codec("dense"), ByteMeter()):
            dense = st.runner.run(st.model, batch, step=t, forward_only=True, loss_fn=lp_fn)
            dense_ref = (st.runner.run(st.ref_model, batch, step=t, forward_only=True, loss_fn=lp_fn)
                         if st.ref_model is not None else None)
        self._passes = (dense, dense_ref)

    @torch.no_grad()
    def metrics(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """The last :meth:`run`'s numbers beside the compression view's, nats per response token
        over the batch's replicas: ``probe/abs_logprob_diff_mean`` (sampler vs dense trainer: the
        true train-inference mismatch), ``probe/view_abs_logprob_diff`` (compressed vs dense
        trainer view), ``probe/kl_to_ref`` (KL to the reference by ``--kl-loss-type``, dense
        view) and ``probe/kl_to_ref_compressed`` (the same in the compression view). {} on the
        stages before the last.

        Raises:
            RuntimeError: no :meth:`run` since the last call.
        """
        if self._passes is None:
            raise RuntimeError("DriftProbe.metrics() before DriftProbe.run() of this iteration")
        (dense, dense_ref), self._passes = self._passes, None
        st = self.stage
        if not st.ctx.is_last_stage:
            return {}
        lp = torch.cat([o["logprobs"] for o in dense])
        names = ["probe/abs_logprob_diff_mean", "probe/view_abs_logprob_diff"]
        vals = [(batch["sampler_logprobs"] - lp).abs(), (batch["old_logprobs"] - lp).abs()]
        if dense_ref is not None:
            ref = torch.cat([o["logprobs"] for o in dense_ref])
            kind = st.cfg.grpo.kl_loss_type
            names += ["probe/kl_to_ref", "probe/kl_to_ref_compressed"]
            mask = batch["loss_mask"]
            vals += [ca.kl_penalty(lp, ref, kind, mask),
                     ca.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], kind, mask)]
        return dict(zip(names, dpx.masked_means(vals, batch["loss_mask"], st.dp_group)))
