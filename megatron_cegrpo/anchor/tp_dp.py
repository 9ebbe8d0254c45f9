"""The anchor at tensor x data parallel (issue 14): the DP fan-out of whole-stage signs, then the TP split.

At ``--tensor-model-parallel-size`` T > 1 and data-parallel size DP > 1 each stage has T x DP ranks
(megatron-core's order, TP fastest: stage rank ``dp_rank x T + tp_rank``). The composition uses the
groups megatron-core already builds, nothing of its own:

1. **the anchor link**: only (replica 0, TP rank 0) of each stage talks to the anchor, exactly as a
   TP = 1, DP = 1 stage does: it ships the stage's gathered whole weights (``anchor/tp_split.py``) and
   receives the whole stage's sign(M), 1 bit a parameter (the TP = 1 bytes, once);
2. **over DP** (``anchor/dp_fanout.py``'s :class:`SignFanout` on the DP group of the TP-rank-0s,
   megatron's DP group of TP rank 0: ``{0, T, 2T, ...}`` inside the stage): it broadcasts the whole
   signs its hook's split holds to TP rank 0 of every other replica (``anchor/bytes_dp_fanout``:
   the header and the packed whole-stage signs, once per other replica, when they change);
3. **over TP** (``anchor/tp_split.py``'s :class:`TPSignSplit` on each replica's TP group): every
   replica's TP rank 0 then sends each other TP rank of its replica only that rank's shard
   (``anchor/bytes_tp_fanout``, summed over the replicas).

So every one of the T x DP ranks of a stage applies exactly its TP slice of the one whole-stage sign(M)
the anchor sent, and the replicas of a TP rank hold identical signs (``anchor/sign_dev_across_dp``,
computed on every rank over its own DP group from the shard signs its hook holds, is 0).

Both fan-outs run inside a host in the intended placement (TP and DP inside, stage boundaries between
hosts), like megatron's own TP and DP collectives, and stay out of the whole-step ledger.
"""

from __future__ import annotations

from megatron_cegrpo.anchor.dp_fanout import FollowerClient, SignFanout
from megatron_cegrpo.anchor.tp_split import TPSignSplit

__all__ = ["TPDPFanout", "TPDPFollowerClient"]


class TPDPFanout:
    """The ``fanout`` of (replica 0, TP rank 0)'s ``AnchorClient``: :meth:`lead` broadcasts the whole
    signs over the DP group of the TP-rank-0s, then splits them over its own TP group.

    Args:
        dp: the stage's :class:`SignFanout` over the DP group of TP rank 0 (whole-stage shapes).
        split: this replica's :class:`TPSignSplit` (TP rank 0's; it is also the client's correction).
    """

    def __init__(self, dp: SignFanout, split: TPSignSplit):
        self.dp, self.split = dp, split

    def lead(self, alive: bool, before, after) -> None:
        """Collectives on the DP group, then the TP group (every member at the same call point).

        Args:
            alive: whether the anchor is alive (the header's first word).
            before, after: the whole-stage sign lists (or None) before and after this step's
                preparation; ``after is before`` means unchanged.
        """
        self.dp.lead(alive, before, after)
        self.split.lead(alive, before, after)


class TPDPFollowerClient(FollowerClient):
    """The anchor client of TP rank 0 of a replica other than 0: no anchor traffic; it takes the
    whole-stage signs from replica 0's TP rank 0 over the DP group (:class:`SignFanout`), holds them in
    its replica's :class:`TPSignSplit` (which sets its own hook's shard) and splits them to the other TP
    ranks of its replica. It writes no checkpoint (replica 0 does); on a resume it loads replica 0's
    TP rank 0 state (``trainer_state_tp00``: the whole signs).

    Args:
        anchor: the AnchorConfig.
        split: this replica's :class:`TPSignSplit` (the ``correction`` the follower sets).
        dp: the stage's :class:`SignFanout` over the DP group of TP rank 0 (whole-stage shapes).
        rank: this rank's global rank (for the one line when the anchor is lost).
    """

    def __init__(self, anchor, split: TPSignSplit, dp: SignFanout, rank: int = 0):
        super().__init__(anchor, split, dp, rank=rank)
        self.split = split

    def before_optimizer_step(self, t: int, timers) -> None:
        """Take replica 0's whole signs (DP group), then hand each TP rank of this replica its shard."""
        before = self.split.signs
        super().before_optimizer_step(t, timers)
        self.split.lead(self.alive, before, self.split.signs)
