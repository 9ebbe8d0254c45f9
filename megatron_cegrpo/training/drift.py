"""The drift probe and the drift controller as the trainer loop calls them (issue 31 items 1 and 3;
docs/training_health.md).

Per iteration t, on every trainer rank:

1. :meth:`DriftMonitor.probed` (``t % --drift-probe-interval == 0``, PP >= 2): the probe's dense
   passes run before the update (``DriftProbe.run``), its numbers after it (``DriftProbe.metrics``,
   on the last stage);
2. :meth:`DriftMonitor.decide`, inside the metrics step: the controller counts a dense step it
   scheduled for t (``DriftController.end_iteration``); on a probe iteration the driver's reduced
   inputs (``probe/kl_to_base`` from the last stage, the byte meters' cumulative boundary totals
   summed over the stages) go to every trainer rank in one broadcast over the rollout group
   (3 fp64 values), and every rank's controller takes the same decision from them: whether t + 1
   is a dense step (``DenseSteps.is_dense``).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_cegrpo.training.drift_controller import DriftController
from megatron_cegrpo.training.drift_probe import DriftProbe

__all__ = ["DriftMonitor"]


class DriftMonitor:
    """The run's probe (always built: it costs nothing unless ``--drift-probe-interval``) and its
    controller (``--drift-controller``; else None).

    Args:
        cfg: the TrainConfig.
        ctx: the DistContext (``rollout_group``: every trainer rank, the driver its rank 0).
        stage: the rank's StageWorker.
        reducer: the trainer's StageMetricsReducer (``probe/bytes`` is declared in it).
    """

    def __init__(self, cfg, ctx, stage, reducer):
        self.ctx, self.stage, self.interval = ctx, stage, int(cfg.logging.drift_probe_interval)
        self.probe = DriftProbe(stage, cfg.logging.drift_probe_window)
        self.probe.declare_metrics(reducer)
        c = cfg.codec
        self.controller: Optional[DriftController] = (
            DriftController(c.drift_target_kl, c.drift_target_kl_low, c.drift_max_boundary_ratio)
            if c.drift_controller else None)

    def probed(self, t: int) -> bool:
        """Whether iteration ``t`` runs the probe (never at PP = 1)."""
        return bool(self.interval and t % self.interval == 0 and self.stage.comm is not None)

    def stateful(self) -> Dict:
        """The checkpointed objects by their ``trainer_state`` key."""
        out = {"drift_probe": self.probe}
        if self.controller is not None:
            out["drift_controller"] = self.controller
        return out

    def decide(self, t: int, m: Optional[Dict], next_dense: bool) -> Dict:
        """The controller's bookkeeping and decision at the end of iteration ``t``, after its
        passes and optimizer steps (a collective over the rollout group on a probe iteration: every
        trainer rank calls it every iteration, the driver with its reduced metrics ``m``, the
        others with None).

        Args:
            t: the iteration just finished.
            m: on the driver the iteration's reduced metrics (``probe/kl_to_base``,
                ``comm/total_wire_bytes``, ``comm/total_dense_equiv_bytes``); None elsewhere.
            next_dense: iteration t + 1 is an interval dense step anyway.
        Returns:
            the ``drift/*`` metrics on the driver; {} elsewhere and without a controller.
        Raises:
            RuntimeError: the backend's, when a peer is gone.
        """
        ctl = self.controller
        if ctl is None:
            return {}
        ctl.end_iteration(t)
        if self.probed(t):
            vals = torch.zeros(3, dtype=torch.float64)
            if m is not None:
                vals = torch.tensor([m.get("probe/kl_to_base", math.nan), m.get("comm/total_wire_bytes", 0),
                                     m.get("comm/total_dense_equiv_bytes", 0)], dtype=torch.float64)
            group = self.ctx.rollout_group
            dist.broadcast(vals, src=dist.get_global_rank(group, 0), group=group)
            measured, wire, dense = (float(v) for v in vals)
            ctl.observe(t, measured, wire, dense, next_dense=next_dense)
        return ctl.metrics() if m is not None else {}
