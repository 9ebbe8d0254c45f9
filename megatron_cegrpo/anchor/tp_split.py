"""The anchor with tensor parallelism (issue 14): whole-stage shipments, per-TP-rank sign slices.

The anchor's dense replica knows only whole (TP = 1) stages, so at ``--tensor-model-parallel-size``
T > 1 only TP rank 0 of each stage talks to it, exactly as a TP = 1 stage does:

- **shipments**: TP rank 0 ships the whole stage, gathered from the T shards by the stage's
  ``TPGatheredStage`` (``models/tp_shard.py``; refreshed in place by every iteration's sampler
  sync, so at ship time it holds theta(t - 1)): the TP = 1 stage's names, shapes and bytes, metered
  once (``anchor/bytes_ship`` on TP rank 0; the other TP ranks send nothing to the anchor).
- **signs**: the anchor answers TP rank 0 with the whole stage's sign(M), 1 bit a parameter (the
  TP = 1 bytes). TP rank 0 holds them whole (:class:`TPSignSplit` stands in for the correction hook
  in ``AnchorClient``) and gives its own hook its shard; after every optimizer-step preparation it
  sends each other TP rank r of the stage only **rank r's shard** of every tensor
  (:func:`models.tp_shard.shard_tensor`: the chunk along megatron's partition dim for column-,
  row- and vocab-parallel weights, ``cat[gate_r, up_r]`` for the GLU fc1, the whole tensor for a
  replicated norm), over the stage's TP group (inside a host): a broadcast header
  ``[alive, code]`` (int64 x 2; the codes of ``anchor/dp_fanout.py``: 0 unchanged, 1 new signs,
  2 cleared, 3 new signs after a per-tensor "informative" bitmap, also broadcast) and, for codes
  1 and 3, the shard's signs packed 1 bit a parameter (``anchor/signs.py``), point to point.
  ``anchor/bytes_tp_fanout`` meters what TP rank 0 sends there (not part of the whole-step ledger:
  it stays inside the stage, like megatron's own TP all-reduces).

Every TP rank therefore applies ``G = alpha G_comp + beta |G_comp| sign(M)`` to its shard with
exactly the matching slice of the whole-stage sign tensor, which is what the TP = 1 stage applies
to those coordinates; the replicated parameters get the same whole sign on every TP rank, so their
copies stay equal.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.dp_fanout import CLEARED, KEEP, NEW, PARTIAL, FollowerClient, held_signs
from megatron_cegrpo.anchor.signs import pack_bits, pack_sign_list, packed_nbytes, unpack_bits, unpack_sign_list
from megatron_cegrpo.models.tp_shard import shard_tensor

__all__ = ["TPSignSplit", "TPFollowerClient", "shard_signs"]

Signs = Optional[List[Optional[torch.Tensor]]]


def shard_signs(names: Sequence[str], whole: Signs, tp_rank: int, tp_size: int) -> Signs:
    """TP rank ``tp_rank``'s slices of a stage's whole-stage signs.

    Args:
        names: the stage-local megatron names, in the signs' order.
        whole: {-1, +1} tensors of the whole (TP = 1) parameter shapes, any dtype; a None entry
            (no sign for that tensor) stays None; None stays None.
        tp_rank, tp_size: the TP rank whose shards to take.
    Returns:
        per name the shard (:func:`models.tp_shard.shard_tensor`: contiguous, the TP rank's
        parameter shape, same dtype) or the whole tensor for a replicated parameter.
    Raises:
        ValueError: ``len(names) != len(whole)``, a rank out of range or a split dim ``tp_size``
            does not divide.
    """
    if whole is None:
        return None
    if len(names) != len(whole):
        raise ValueError(f"{len(whole)} sign tensors for {len(names)} parameter names")
    return [None if s is None else shard_tensor(n, s, tp_rank, tp_size) for n, s in zip(names, whole)]


class TPSignSplit:
    """One stage's sign slices over its TP group: TP rank 0 holds the whole-stage signs and sends
    each other TP rank its shard (module docstring).

    On TP rank 0 it is also the ``correction`` the ``AnchorClient`` feeds (:meth:`set_signs`,
    :attr:`signs`: whole shapes) and its ``fanout`` (:meth:`lead`); on the other TP ranks
    :meth:`follow` receives the shard.

    Args:
        group: the stage's TP group (``DistContext.tp_group``, size T > 1).
        names: the stage-local names of the hook's parameters (``StageWorker.named_owned``), in order.
        hook: this TP rank's ``SignCorrectionHook`` over its shards (same order).
    Attributes:
        signs: on TP rank 0, the whole-stage signs last set (None when cleared).
        sent_bytes: bytes TP rank 0 sent since the last :meth:`take_bytes` (each header and bitmap
            once per other TP rank, each rank's packed shard signs).
    """

    def __init__(self, group, names: Sequence[str], hook):
        self.group, self.names, self.hook = group, list(names), hook
        self.tp_size, self.tp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.ranks = [dist.get_global_rank(group, r) for r in range(self.tp_size)]
        # every TP rank's shard of a tensor has the same shape (megatron splits evenly)
        self.shapes: List[Tuple[int, ...]] = [tuple(p.shape) for p in hook.params]
        self.numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
        if len(self.names) != len(self.shapes):
            raise ValueError(f"{len(self.names)} names for {len(self.shapes)} hook parameters")
        self.signs: Signs = None
        self.sent_bytes = 0

    # ------------------------------------------------------------------ TP rank 0: the client's correction
    def set_signs(self, whole: Signs) -> None:
        """Hold the whole-stage signs ``whole`` (or None: clear) and set this rank's hook to its
        shard. A list of only None entries clears, as the hook does.

        Raises:
            ValueError: a shape that does not shard to the hook's parameter shapes.
        """
        if whole is not None and all(s is None for s in whole):
            whole = None
        self.hook.set_signs(shard_signs(self.names, whole, self.tp_rank, self.tp_size))
        self.signs = whole

    def lead(self, alive: bool, before: Signs, after: Signs) -> None:
        """On TP rank 0 (a collective over the TP group, every rank at the same call point): send
        the change from the whole signs ``before`` to ``after`` and whether the anchor is alive;
        each other TP rank gets its shards of ``after``."""
        code = (KEEP if after is before else CLEARED if after is None
                else PARTIAL if any(s is None for s in after) else NEW)
        hdr = torch.tensor([int(alive), code], dtype=torch.int64)
        dist.broadcast(hdr, src=self.ranks[0], group=self.group)
        others = self.tp_size - 1
        self.sent_bytes += 16 * others
        if code == PARTIAL:
            bitmap = pack_bits(torch.tensor([s is not None for s in after], dtype=torch.bool))
            dist.broadcast(bitmap, src=self.ranks[0], group=self.group)
            self.sent_bytes += bitmap.numel() * others
        if code in (NEW, PARTIAL):
            for r in range(1, self.tp_size):
                shard = shard_signs(self.names, after, r, self.tp_size)
                packed, _ = pack_sign_list([s if s is not None else torch.ones(sh)
                                            for s, sh in zip(shard, self.shapes)])
                dist.send(packed, dst=self.ranks[r], group=self.group)
                self.sent_bytes += packed.numel()

    # ------------------------------------------------------------------ the other TP ranks
    def follow(self) -> Tuple[bool, int, Signs]:
        """On a TP rank > 0: ``(alive, code, signs)``, signs this rank's shards as {-1, +1} fp32
        tensors for codes 1 and 3 (None for a tensor TP rank 0 holds no sign for), else None."""
        hdr = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(hdr, src=self.ranks[0], group=self.group)
        alive, code = bool(hdr[0]), int(hdr[1])
        if code not in (NEW, PARTIAL):
            return alive, code, None
        info = [True] * len(self.shapes)
        if code == PARTIAL:
            bitmap = torch.empty(packed_nbytes(len(self.shapes)), dtype=torch.uint8)
            dist.broadcast(bitmap, src=self.ranks[0], group=self.group)
            info = unpack_bits(bitmap, len(self.shapes))
        packed = torch.empty(packed_nbytes(self.numel), dtype=torch.uint8)
        dist.recv(packed, src=self.ranks[0], group=self.group)
        return alive, code, [s if ok else None for s, ok in zip(unpack_sign_list(packed, self.shapes), info)]

    def take_bytes(self) -> int:
        """:attr:`sent_bytes`, reset to 0."""
        n, self.sent_bytes = self.sent_bytes, 0
        return n


class TPFollowerClient(FollowerClient):
    """The anchor client of a TP rank > 0: no anchor traffic; its hook holds its shard of what TP
    rank 0 holds (:class:`TPSignSplit`). Unlike a data-parallel follower it writes its own
    checkpoint blob (``trainer_state_tpRR``): its held shard signs.

    Args:
        anchor: the AnchorConfig.
        correction: this TP rank's SignCorrectionHook.
        split: the stage's :class:`TPSignSplit`.
        rank: this rank's global rank (for the one line when the anchor is lost).
    """

    def __init__(self, anchor, correction, split: TPSignSplit, rank: int = 0):
        super().__init__(anchor, correction, split, rank=rank)
        self._lost_line = "TP rank 0 of its stage lost the anchor"

    def state_dict(self) -> Dict:
        """This TP rank's held shard signs (int8, None entries kept; a resumed run reconnects to the
        anchor, as TP rank 0's ``AnchorClient`` does)."""
        signs = self.correction.signs
        return {"signs": [s.to(torch.int8) if s is not None else None for s in signs] if signs is not None else None}

    def load_state_dict(self, state: Dict) -> None:
        """Restore :meth:`state_dict`: the held shard signs become the hook's."""
        self.correction.set_signs(held_signs(state["signs"]))
