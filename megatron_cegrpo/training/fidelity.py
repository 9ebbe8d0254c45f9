"""The gradient-fidelity probe (``--grad-fidelity-interval N``; issue 10 item 1).

What does the compressed pipeline teach? On a probed iteration, for every optimizer step of
the update, the stage computes — on the same mini-batch and the same weights, before the
codec pass — the gradient a *dense* pipeline would compute, ``G_dense``, and compares it
with the codec's gradient ``G_codec`` once that is complete (tied-embedding sum done),
before the optimizer's pre-step hooks (the anchor's sign correction, then clipping):

    fidelity/cos            = <G_codec, G_dense> / (|G_codec| |G_dense|), all stages
    fidelity/cos/stage_<i>  = the same over stage i's parameters
    fidelity/sign_agreement = #{sign G_codec = sign G_dense, G_dense != 0} / #{G_dense != 0}
    fidelity/norm_ratio     = |G_codec| / |G_dense|

Dot products, squared norms and sign counts are summed over the stages (fp64); the tied
embedding counts once (the last stage's copy is left out, as in clipping). With several
optimizer steps per iteration (``--global-batch-size`` or ``--ppo-epochs``) each step gives
these numbers and the log holds their mean over the steps where they are defined (both
gradients non-zero). The sign-agreement definition is the emulation's
(``../shared/tools/grad_fidelity_emulation.py``).

``G_dense`` is the gradient of the same GRPO update loss with every boundary dense, in all
the passes it depends on: its ``old_logprobs`` (and ``ref_logprobs``) come from dense
forward passes of this iteration's batch at the iteration's start weights (computed by
:meth:`GradFidelityProbe.prepare`), exactly what a dense run would use. Feeding the
codec's old log-probs into a dense pass instead would make the ratio exp(dense - codec)
(exp(+-15) under the 5 % mask) and clip most tokens' gradient away.

Cost per probed iteration: one more dense forward+backward per optimizer step, plus one
dense forward-only pass (two with a reference model, ``--kl-coef > 0``), and one copy of
the stage's gradients; the dense traffic is billed to the probe's own ByteMeter, not to
``comm/*``. The probe never changes the run: its passes precede the codec pass, every RNG
is restored after them, and the codec pass starts from ``grad = None`` as without it
(a run with the probe equals one without it bit for bit; tests/e2e/test_fidelity.py).

Data parallel (issue 14): each replica computes G_dense of its share of the mini-batch and
sums it over the stage's DP group, as the codec pass sums G_codec, so both gradients are the
whole mini-batch's and every replica holds the same sums (the reducer keeps replica 0's);
one more all-reduce of the stage's gradients per probed step, not counted in
``comm/dp_grad_allreduce_bytes``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import partial
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_cegrpo.compression import ByteMeter, build_codec
from megatron_cegrpo.models import allreduce_tied_embedding_grads
from megatron_cegrpo.rng_state import get_rng_state, set_rng_state
from megatron_cegrpo.training import data_parallel as dpx
from megatron_cegrpo.grpo.batch import RolloutBatch

__all__ = ["GradFidelityProbe", "gradient_sums", "fidelity_metrics", "SUM_KEYS"]

_PREFIX = "_fidelity/"
#: the per-stage sums one optimizer step contributes (see :func:`gradient_sums`)
SUM_KEYS = ("dot", "sq_codec", "sq_dense", "sign_agree", "sign_total")


@torch.no_grad()
def gradient_sums(pairs: Iterable[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]) -> Dict[str, float]:
    """Sums over ``(G_codec, G_dense)`` tensor pairs of one stage (any shape and float
    dtype; None = no gradient = zeros), accumulated in fp64:

    ``dot`` = sum G_codec * G_dense, ``sq_codec`` = sum G_codec^2, ``sq_dense`` = sum G_dense^2,
    ``sign_agree`` = #{sign G_codec == sign G_dense and G_dense != 0},
    ``sign_total`` = #{G_dense != 0}.
    """
    out = dict.fromkeys(SUM_KEYS, 0.0)
    for gc, gd in pairs:
        if gc is None and gd is None:
            continue
        gc = torch.zeros_like(gd) if gc is None else gc
        gd = torch.zeros_like(gc) if gd is None else gd
        gc, gd = gc.detach().double(), gd.detach().double()
        out["dot"] += float((gc * gd).sum())
        out["sq_codec"] += float(gc.square().sum())
        out["sq_dense"] += float(gd.square().sum())
        nz = gd != 0
        out["sign_agree"] += float(((gc.sign() == gd.sign()) & nz).sum())
        out["sign_total"] += float(nz.sum())
    return out


def _step_metrics(stages: Sequence[Dict[str, float]]) -> Optional[Dict[str, float]]:
    """The fidelity/* numbers of one optimizer step from each stage's sums (stage order);
    None when either gradient is zero everywhere (the cosine is undefined)."""
    tot = {k: sum(s[k] for s in stages) for k in SUM_KEYS}
    if tot["sq_codec"] <= 0.0 or tot["sq_dense"] <= 0.0:
        return None
    out = {"fidelity/cos": tot["dot"] / math.sqrt(tot["sq_codec"] * tot["sq_dense"]),
           "fidelity/sign_agreement": tot["sign_agree"] / max(tot["sign_total"], 1.0),
           "fidelity/norm_ratio": math.sqrt(tot["sq_codec"] / tot["sq_dense"])}
    for i, s in enumerate(stages):
        den = math.sqrt(s["sq_codec"] * s["sq_dense"])
        out[f"fidelity/cos/stage_{i}"] = s["dot"] / den if den > 0 else float("nan")
    return out


def fidelity_metrics(reduced: Dict) -> Dict[str, float]:
    """Derived metric (``training/reduce.py``): from ``_fidelity/<sum>`` = [stage][step] lists
    (the ``stages`` reduction), the mean over the defined steps of :func:`_step_metrics`.
    Nothing on iterations without the probe or without a defined step."""
    if _PREFIX + "dot" not in reduced:
        return {}
    per_stage = [dict(zip(SUM_KEYS, vals)) for vals in zip(*(reduced[_PREFIX + k] for k in SUM_KEYS))]
    steps = []
    for j in range(len(per_stage[0]["dot"])):
        m = _step_metrics([{k: s[k][j] for k in SUM_KEYS} for s in per_stage])
        if m is not None:
            steps.append(m)
    if not steps:
        return {}
    return {k: sum(m[k] for m in steps) / len(steps) for k in steps[0]}


@contextmanager
def _rng_preserved():
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


class GradFidelityProbe:
    """One stage's side of the probe (module docstring). The trainer calls :meth:`prepare`
    before the update, the update calls :meth:`dense_gradient` before and :meth:`compare`
    after each codec backward, and :meth:`stage_metrics` hands the sums to the reducer.

    Args:
        stage: the :class:`~megatron_cegrpo.training.stage.StageWorker` (PP >= 2).
    Raises:
        ValueError: a stage without a boundary (PP = 1).
    """

    def __init__(self, stage):
        if stage.comm is None:
            raise ValueError("the gradient-fidelity probe needs a pipeline boundary (PP >= 2)")
        self.stage = stage
        self.dense_codec = build_codec("dense")
        self.meter = ByteMeter()  # the probe's own dense traffic, never in comm/*
        self._old: Optional[torch.Tensor] = None
        self._ref: Optional[torch.Tensor] = None
        self._dense: Optional[List[Optional[torch.Tensor]]] = None
        self._steps: List[Dict[str, float]] = []

    @staticmethod
    def declare_metrics(reducer) -> None:
        """``_fidelity/*``: per stage, a list over the iteration's optimizer steps."""
        reducer.declare(_PREFIX, "stages").derive(fidelity_metrics)

    @torch.no_grad()
    def prepare(self, batch: RolloutBatch, t: int) -> None:
        """Dense old-logprob (and reference) passes of iteration ``t``'s batch at the current
        weights; the last stage keeps them for :meth:`dense_gradient` (fp32 [N, S])."""
        st = self.stage
        lp_fn = partial(st.logprob_loss_fn, False)
        st.model.eval()
        with _rng_preserved(), st.comm.using(self.dense_codec, self.meter):
            old = st.runner.run(st.model, batch, step=t, forward_only=True, loss_fn=lp_fn)
            ref = (st.runner.run(st.ref_model, batch, step=t, forward_only=True, loss_fn=lp_fn)
                   if st.ref_model is not None else None)
        if st.ctx.is_last_stage:
            self._old = torch.cat([o["logprobs"] for o in old])
            self._ref = torch.cat([o["logprobs"] for o in ref]) if ref is not None else None
        self._steps = []

    def dense_gradient(self, mini: Dict[str, torch.Tensor], start: int, t: int, loss_fn) -> None:
        """G_dense of one optimizer step: the update's ``loss_fn`` on rows ``start:`` of the
        batch (``mini``) with dense boundaries and dense old/ref log-probs; stashed, and every
        ``grad`` left None for the codec pass."""
        st = self.stage
        mb = dict(mini)
        if st.ctx.is_last_stage:
            n = mini["tokens"].shape[0]
            mb["old_logprobs"] = self._old[start:start + n]
            if self._ref is not None:
                mb["ref_logprobs"] = self._ref[start:start + n]
        st.optimizer.zero_grad(set_to_none=True)
        with _rng_preserved(), st.comm.using(self.dense_codec, self.meter):
            st.runner.run(st.model, mb, step=t, forward_only=False, loss_fn=loss_fn)
        allreduce_tied_embedding_grads(st.model, st.ctx.embd_group)
        # data parallel: the whole mini-batch's G_dense, as the codec pass's (not in dp_bytes: the probe's own)
        dpx.allreduce_gradients(st.params, st.dp_group)
        self._dense = [p.grad for p in st.params]
        for p in st.params:
            p.grad = None

    def compare(self) -> None:
        """After the codec pass of the same step (gradients complete, before the optimizer's
        pre-step hooks): add this stage's :func:`gradient_sums` to the iteration's steps."""
        st = self.stage
        pairs = [(p.grad, gd) for p, gd in zip(st.params, self._dense) if st.counted_here(p)]
        self._steps.append(gradient_sums(pairs))
        self._dense = None

    def stage_metrics(self) -> Dict[str, List[float]]:
        """``_fidelity/<sum>``: this stage's sums per optimizer step since :meth:`prepare`
        (empty when the iteration was not probed); reset on read."""
        if not self._steps:
            return {}
        out = {_PREFIX + k: [s[k] for s in self._steps] for k in SUM_KEYS}
        self._steps = []
        return out
