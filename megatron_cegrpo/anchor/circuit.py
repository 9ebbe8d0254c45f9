"""The anchor circuit as the stage worker's correction circuit (``training/circuit.py``).

Per stage: the sign correction ``G = alpha G_comp + beta |G_comp| sign(M)`` (registered as
the stage's correction, before clipping) and the :class:`AnchorClient` that ships weights,
sends batches and receives sign(M) (``anchor/client.py``). Metrics: ``anchor/*``.

Who talks to the anchor: (data-parallel replica 0, TP rank 0) of each stage. The other ranks of a
stage take its signs along the one relay the layout decides (``anchor/relay.py``: over the DP group
of the TP-rank-0s, then each replica's TP group).
"""

from __future__ import annotations

import os
from typing import Dict

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.basis import stage_boundaries
from megatron_cegrpo.anchor.client import ANCHOR_BATCH_KEYS, AnchorClient
from megatron_cegrpo.anchor.relay import RelayFollower, build_relay, sign_deviation
from megatron_cegrpo.anchor.replay import SHARED_PREFIX_KEYS
from megatron_cegrpo.checkpointing import ANCHOR_DIR
from megatron_cegrpo.optim.hooks import SignCorrectionHook

__all__ = ["AnchorCircuit"]


class AnchorCircuit:
    """The anchor's side on one trainer rank.

    Args:
        cfg: the TrainConfig (``cfg.anchor``).
        ctx: the DistContext (``anchor_rank``, ``anchor_group``).
        stage: the rank's StageWorker (model, parameters, layer offset, correction slot).
    """

    name = "anchor_client"  # its key in trainer_state (the format of earlier versions)
    phase = "anchor"

    def __init__(self, cfg, ctx, stage):
        self.ctx = ctx
        owned = [p for _, p in stage.named_owned]
        self.correction = SignCorrectionHook(owned, alpha=cfg.anchor.sign_blend_alpha,
                                             beta=cfg.anchor.sign_blend_beta,
                                             magnitude=cfg.anchor.sign_blend_magnitude,
                                             counted=[p for p in owned if stage.counted_here(p)])
        stage.register_correction(self.correction)
        tied_copy = any(stage.is_duplicate_tied_weight(p) for p in owned)
        self.tp = ctx.tp_size
        # at TP > 1 TP rank 0 ships the gathered stage and holds the whole signs (its hook its shard)
        whole = _whole_owned(stage) if self.tp > 1 else stage.named_owned
        self.relay = build_relay(ctx, self.correction, [n for n, _ in stage.named_owned],
                                 [tuple(p.shape) for _, p in whole])
        # anchor/sign_dev_across_dp: on every rank, over its own DP group, from the signs its hook holds
        self._dev_shapes = [tuple(p.shape) for p in owned]
        if self.relay.upstream is None:  # (replica 0, TP rank 0): the anchor's end of the relay
            self.client = AnchorClient(whole, stage.layer_offset, tied_copy, ctx.anchor_rank,
                                       ctx.is_driver, cfg.anchor, self.relay,
                                       group=ctx.anchor_group, rank=ctx.rank, bases=_anchor_bases(cfg, ctx, stage),
                                       batch_keys=ANCHOR_BATCH_KEYS + (SHARED_PREFIX_KEYS if cfg.parallel.shared_prefix
                                                                       else ()))
        else:
            self.client = RelayFollower(cfg.anchor, self.relay, rank=ctx.rank, writes_own_state=ctx.tp_rank > 0)
        self._dump = cfg.anchor.anchor_debug_dir
        self._applied_before = 0

    def connect(self) -> None:
        self.client.connect()

    def after_rollout(self, t: int, batch) -> None:
        self.client.after_rollout(t, batch)

    def before_optimizer_step(self, t: int, timers) -> None:
        self.client.before_optimizer_step(t, timers)
        if self._dump:
            tp = f"_tp{self.ctx.tp_rank:02d}" if self.tp > 1 else ""
            tp += f"_dp{self.ctx.dp_rank:02d}" if self.ctx.dp_group is not None else ""
            self.correction.dump_path = os.path.join(self._dump, f"stage{self.ctx.pp_rank}{tp}_step{t:05d}.pt")
        self._applied_before = self.correction.num_applied

    @staticmethod
    def declare_metrics(reducer) -> None:
        """Bytes add up over the stages; the fire is the schedule's; the anchor is alive and
        the correction applied only if on every stage; the sign agreement pools all stages;
        the replicas' sign deviation is the largest anywhere (data parallel)."""
        (reducer.declare("anchor/bytes_", "sum").declare("anchor/fire", "first").declare("anchor/alive", "min")
         .declare("anchor/ship_resyncs", "sum")
         .declare("anchor/sign_dev_across_dp", "max")
         .declare("_anchor/applied", "min").declare("_anchor/agree", "sum")
         .declare("_anchor/total", "sum").derive(_correction))

    def stage_metrics(self, t: int) -> Dict[str, float]:
        applied = self.correction.num_applied - self._applied_before
        agree, total = self.correction.last_agreement if applied else (0, 0)
        out = self.client.metrics(t)
        out.update({"_anchor/applied": applied, "_anchor/agree": agree, "_anchor/total": total})
        sent = self.relay.take_bytes()  # what this rank relayed (0 where it relays nothing)
        if self.ctx.dp_group is not None:
            out["anchor/bytes_dp_fanout"] = sent.get("anchor/bytes_dp_fanout", 0)
            out.update(self._replica_metrics(applied))
        if self.tp > 1:
            out["anchor/bytes_tp_fanout"] = sent.get("anchor/bytes_tp_fanout", 0)
        return out

    def _replica_metrics(self, applied: int) -> Dict[str, float]:
        """Data parallel: when any replica applied a correction this iteration,
        ``anchor/sign_dev_across_dp`` from the signs each replica's hook holds (at TP > 1 each TP
        rank's shard, over its own DP group: collectives over the DP group, every replica in the
        same order)."""
        group = self.ctx.dp_group
        out = {}
        flag = torch.tensor([int(applied > 0)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()):
            numel = sum(int(torch.Size(s).numel()) for s in self._dev_shapes)
            out["anchor/sign_dev_across_dp"] = sign_deviation(self.correction.signs, numel, group, self._dev_shapes)
        return out

    def driver_metrics(self) -> Dict:
        """The anchor's own statistics of a fire (branch, staleness, M norm, ...), received by
        the driver with the signs."""
        stats, self.client.stats = self.client.stats, {}
        return {k: v for k, v in stats.items() if k != "anchor/fire"}

    def save_into(self, tmp_dir: str) -> None:
        self.client.save_anchor_state(tmp_dir, ANCHOR_DIR)

    def finish(self, t: int, timers) -> None:
        self.client.finish(t, timers)

    def state_dict(self) -> Dict:
        return self.client.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.client.load_state_dict(state)


def _whole_owned(stage):
    """``[(name, whole tensor)]`` of the stage's owned parameters at TP > 1: the tensors of the
    stage's ``TPGatheredStage`` (``stage.whole``), gathered from the TP shards and refreshed in place
    by every iteration's sampler sync (``StageWorker.gather_weights``; after a resume by the
    trainer's first gather), so a shipment at iteration t reads theta(t - 1) whole, without a
    collective of its own. Only TP rank 0 ships them."""
    whole = dict(stage.whole.named_parameters())
    return [(n, whole[n]) for n, _ in stage.named_owned]


def _anchor_bases(cfg, ctx, stage):
    """``(slots, sink)`` for :class:`AnchorClient` when the anchor owns the lowrank basis, else None."""
    if cfg.codec.boundary_codec != "lowrank" or cfg.codec.lowrank_q_owner != "anchor":
        return None
    d = stage.tf_config.hidden_size
    slots = [(b, stage.codec.fwd.basis_shape(d), stage.tf_config.pipeline_dtype)
             for b in stage_boundaries(ctx.pp_rank, ctx.pp_size)]
    return slots, stage.codec.stage_basis


def _correction(m: Dict) -> Dict:
    """``anchor/correction_applied`` (1 when every stage applied the hook) and
    ``anchor/sign_agreement``: agreeing / compared coordinates pooled over the stages, where a
    coordinate is compared only when corrected and its gradient is non-zero (optim/hooks.py);
    absent when none is (e.g. a step whose gradient is exactly 0)."""
    out = {"anchor/correction_applied": int(m["_anchor/applied"] > 0)}
    if m["_anchor/total"]:
        out["anchor/sign_agreement"] = m["_anchor/agree"] / m["_anchor/total"]
    return out
