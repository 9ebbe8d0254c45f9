"""The run's rank layout, from the flags and the world size: the one place for its arithmetic
(issue 34, "a run plan resolved once"; DESIGN.md section 1).

Plain integers, no torch: the supervisor (which must stay small), the flag checks
(``TrainConfig.validate``), distributed start-up (``initialize.py``) and ``DistContext`` all ask
the same :class:`Layout`.

Rank order (megatron-core's default tp-cp-ep-dp-pp, ``parallel_state`` and ``HyperCommGrid``
alike): trainer rank ``r`` is TP rank ``r % TP``, data-parallel replica ``(r // TP) % DP``, pipeline
stage ``r // (TP x DP)``; the ``--anchor-ranks`` anchor ranks follow the trainer ranks.
DP = (world - anchor ranks) / (TP x PP), Megatron's convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from megatron_cegrpo.errors import ConfigError

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Who is who in a launch of ``world`` ranks.

    Args:
        world: the launch's ranks (``WORLD_SIZE``).
        pp: ``--pipeline-model-parallel-size``.
        tp: ``--tensor-model-parallel-size``.
        anchor_ranks: ``--anchor-ranks`` (the last ranks of the world).
    """

    world: int
    pp: int = 1
    tp: int = 1
    anchor_ranks: int = 0

    @property
    def trainers(self) -> int:
        """Ranks that hold a stage (the world less the anchor ranks)."""
        return self.world - self.anchor_ranks

    @property
    def model_parallel(self) -> int:
        """TP x PP: the ranks of one replica of the model."""
        return self.tp * self.pp

    @property
    def fits(self) -> bool:
        """The trainer ranks are a positive multiple of TP x PP."""
        return self.trainers >= self.model_parallel and self.trainers % self.model_parallel == 0

    @property
    def dp(self) -> int:
        """Data-parallel replicas; 0 when the launch does not fit (:meth:`check` names the fix)."""
        return self.trainers // self.model_parallel if self.fits else 0

    @property
    def per_stage(self) -> int:
        """Ranks of one stage: TP x DP."""
        return self.tp * self.dp

    @property
    def stage_ranks(self) -> List[int]:
        """Global ranks of replica 0's TP rank 0 of each stage, in stage order (the pipeline the
        driver, the sampler sync, checkpoints and the anchor talk to)."""
        return [i * self.per_stage for i in range(self.pp)]

    def is_anchor(self, rank: int) -> bool:
        return self.anchor_ranks > 0 and rank >= self.trainers

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica of trainer rank ``rank``."""
        return (rank // self.tp) % max(self.dp, 1)

    def pp_rank(self, rank: int) -> int:
        return rank // max(self.per_stage, 1)

    def role(self, rank: int) -> str:
        """``"anchor"``, or ``"pipeline stage <s>"`` with ``" (data-parallel replica <r>, TP rank <t>)"``
        for the parts that exist (DP > 1, TP > 1): how the supervisor names a rank."""
        if self.is_anchor(rank):
            return "anchor"
        where = (([f"data-parallel replica {self.replica_of(rank)}"] if self.dp > 1 else [])
                 + ([f"TP rank {self.tp_rank(rank)}"] if self.tp > 1 else []))
        return f"pipeline stage {self.pp_rank(rank)}" + (f" ({', '.join(where)})" if where else "")

    def fitting_world(self) -> int:
        """The nearest launch size that fits (at least one replica): the fix a launch error names."""
        mp = self.model_parallel
        return mp * max(1, self.trainers // mp) + self.anchor_ranks

    def check(self) -> int:
        """Returns DP. Raises ConfigError, one line naming the flags and the launch that fits (at
        TP = 1 the message names PP alone, at TP > 1 both flags)."""
        if self.fits:
            return self.dp
        tp, pp, anchors, world, trainers = self.tp, self.pp, self.anchor_ranks, self.world, self.trainers
        fit = self.fitting_world()
        alt = ""
        if anchors and world == pp:
            alt = ", or pass --anchor-ranks 0 for the fast circuit alone"
        elif world == 1 and tp == 1:
            alt = ", or pass --pipeline-model-parallel-size 1 --anchor-ranks 0 for one plain process"
        raise ConfigError(
            f"world size {world} minus --anchor-ranks ({anchors}) leaves {trainers} trainer rank"
            f"{'' if trainers == 1 else 's'}, not a multiple of "
            + (f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) (world = TP ranks "
               "x stages x data-parallel replicas + anchor ranks)" if tp > 1 else
               f"--pipeline-model-parallel-size ({pp}) (world = stages x data-parallel replicas + anchor ranks)")
            + f"; fix: launch with `deepspeed --num_gpus {fit}` (or `torchrun --nproc-per-node {fit}`){alt}")
