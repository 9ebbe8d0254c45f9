"""The anchor with data parallelism (issue 14; LA-WARMUP-V2 invariant 2: "DP replicas receive
identical signs").

Only data-parallel replica 0 of each stage (the leader) talks to the anchor: it ships the
stage's weights (the replicas hold the same ones) and receives the stage's sign(M) slice over
the slow link, once. After every optimizer-step preparation (``AnchorClient.before_optimizer_step``)
the leader fans the signs its correction hook now holds out to the stage's other replicas over
megatron-core's DP group (inside a host): a header ``[alive, code]`` (int64 x 2; code 0 = signs
unchanged, 1 = new signs follow, 2 = signs cleared, 3 = new signs follow after a per-tensor
"informative" bitmap: the leader holds no sign for a tensor whose anchor M is all 0,
``anchor/memory.py``) and, for codes 1 and 3, the signs packed 1 bit a parameter
(``anchor/signs.py``; a tensor without a sign packs as +1 and is dropped again by the follower),
packed again from the very tensors the leader's hook applies.
A follower (:class:`FollowerClient`) sets exactly those signs in its own hook, so every replica
of a stage applies the identical slice, including after the anchor is lost (``alive`` 0) and
under ``--sign-fold fire-only``.

:func:`sign_deviation` checks it from the signs each replica's hook actually holds:
``anchor/sign_dev_across_dp`` = max over coordinates of ``(max_r s_r - min_r s_r) / 2`` (a
replica without signs counts 0 there), 0 when every replica applies the same sign everywhere.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.signs import pack_bits, pack_sign_list, packed_nbytes, unpack_bits, unpack_sign_list
from megatron_cegrpo.anchor.transport import is_fire_step

__all__ = ["SignFanout", "FollowerClient", "held_signs", "sign_deviation"]

KEEP, NEW, CLEARED, PARTIAL = 0, 1, 2, 3


class SignFanout:
    """The leader -> followers broadcast of one stage's held signs over its DP group.

    Args:
        group: the stage's DP group (``DistContext.dp_group``).
        shapes: the stage's sign tensor shapes, in the hook's parameter order.
    Attributes:
        sent_bytes: bytes the leader sent since the last :meth:`take_bytes` (header and packed
            signs, once per follower: a broadcast from one member to ``n - 1`` others).
    """

    def __init__(self, group, shapes: Sequence[Tuple[int, ...]]):
        self.group = group
        self.src = dist.get_global_rank(group, 0)
        self.shapes = [tuple(s) for s in shapes]
        self.numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
        self.sent_bytes = 0

    def lead(self, alive: bool, before, after) -> None:
        """On replica 0: broadcast the change from ``before`` to ``after`` (the hook's sign
        lists, or None) and whether the anchor is alive."""
        code = (KEEP if after is before else CLEARED if after is None
                else PARTIAL if any(s is None for s in after) else NEW)
        hdr = torch.tensor([int(alive), code], dtype=torch.int64)
        dist.broadcast(hdr, src=self.src, group=self.group)
        n = dist.get_world_size(self.group) - 1
        self.sent_bytes += 16 * n
        if code == PARTIAL:
            bitmap = pack_bits(torch.tensor([s is not None for s in after], dtype=torch.bool))
            dist.broadcast(bitmap, src=self.src, group=self.group)
            self.sent_bytes += bitmap.numel() * n
        if code in (NEW, PARTIAL):
            packed, _ = pack_sign_list([s if s is not None else torch.ones(sh) for s, sh in zip(after, self.shapes)])
            dist.broadcast(packed, src=self.src, group=self.group)
            self.sent_bytes += packed.numel() * n

    def follow(self) -> Tuple[bool, int, Optional[List[torch.Tensor]]]:
        """On the other replicas: ``(alive, code, signs)``, signs as {-1, +1} fp32 tensors for
        codes :data:`NEW` and :data:`PARTIAL` (None for a tensor the leader holds no sign for),
        else None."""
        hdr = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(hdr, src=self.src, group=self.group)
        alive, code = bool(hdr[0]), int(hdr[1])
        if code not in (NEW, PARTIAL):
            return alive, code, None
        info = [True] * len(self.shapes)
        if code == PARTIAL:
            bitmap = torch.empty(packed_nbytes(len(self.shapes)), dtype=torch.uint8)
            dist.broadcast(bitmap, src=self.src, group=self.group)
            info = unpack_bits(bitmap, len(self.shapes))
        packed = torch.empty(packed_nbytes(self.numel), dtype=torch.uint8)
        dist.broadcast(packed, src=self.src, group=self.group)
        return alive, code, [s if ok else None for s, ok in zip(unpack_sign_list(packed, self.shapes), info)]

    def take_bytes(self) -> int:
        n, self.sent_bytes = self.sent_bytes, 0
        return n


class FollowerClient:
    """The anchor client of a data-parallel replica other than 0: no anchor traffic; its
    correction hook holds whatever the leader's holds (:class:`SignFanout`). The interface of
    ``AnchorClient`` that ``AnchorCircuit`` calls.

    Args:
        anchor: the AnchorConfig (c, for ``anchor/fire``).
        correction: this replica's SignCorrectionHook.
        fanout: the stage's :class:`SignFanout`.
        rank: this rank's global rank (for the one line when the anchor is lost).
    """

    def __init__(self, anchor, correction, fanout: SignFanout, rank: int = 0):
        self.a, self.correction, self.fanout, self.rank = anchor, correction, fanout, rank
        self.alive = True
        self.stats: Dict = {}
        self._state: Dict = {}
        self._lost_line = "replica 0 lost the anchor"  # who told us (the TP follower says TP rank 0)

    def connect(self) -> None:
        """Nothing: the anchor knows only replica 0's stages."""

    def after_rollout(self, t: int, batch) -> None:
        """Nothing: replica 0 ships the weights and the driver the batch."""

    def before_optimizer_step(self, t: int, timers) -> None:
        """Take the leader's signs (the same call point on every replica)."""
        with timers.phase("anchor_wait"):
            alive, code, signs = self.fanout.follow()
        if code in (NEW, PARTIAL):
            self.correction.set_signs(signs)
        elif code == CLEARED:
            self.correction.set_signs(None)
        if self.alive and not alive:
            self.alive = False
            print(f"[cegrpo] rank {self.rank}: {self._lost_line}; training goes on without the sign "
                  f"correction (anchor/alive = 0)", flush=True)

    def finish(self, t_last: int, timers) -> None:
        """Nothing to drain."""

    def save_anchor_state(self, tmp_dir: str, anchor_subdir: str) -> bool:
        return False  # only the driver (replica 0) saves

    def state_dict(self) -> Dict:
        """Replica 0's state as loaded (replicas other than 0 write no checkpoint)."""
        return dict(self._state)

    def load_state_dict(self, state: Dict) -> None:
        """Replica 0's ``AnchorClient`` state from the checkpoint: its held signs become ours."""
        self._state = dict(state)
        self.correction.set_signs(held_signs(state["signs"]))

    def metrics(self, t: int) -> Dict:
        return {"anchor/fire": int(is_fire_step(t, self.a.anchor_interval) and self.alive),
                "anchor/bytes_in": 0, "anchor/bytes_out": 0, "anchor/bytes_ship": 0, "anchor/bytes_ship_fp32": 0,
                "anchor/alive": int(self.alive), "anchor/ship_resyncs": 0,
                **({"anchor/bytes_ship_check": 0} if self.a.anchor_ship_check else {})}


def held_signs(stored) -> Optional[List[Optional[torch.Tensor]]]:
    """The hook's signs from a checkpoint's ``signs`` (int8 tensors, None entries for tensors
    without a sign, or None): fp32 {-1, +1} tensors, None kept."""
    if stored is None:
        return None
    return [s.float() if s is not None else None for s in stored]


@torch.no_grad()
def sign_deviation(signs: Optional[Sequence[Optional[torch.Tensor]]], numel: int, group,
                   shapes: Optional[Sequence[Tuple[int, ...]]] = None) -> float:
    """``anchor/sign_dev_across_dp``: max over coordinates of ``(max_r s_r - min_r s_r) / 2`` over
    the replicas ``r`` of the DP ``group`` (a collective: every replica calls it).

    Args:
        signs: this replica's held signs ({-1, +1} tensors, the hook's order) or None (counts 0);
            a None entry (no sign for that tensor: its M is all 0) counts 0 on its coordinates.
        numel: the total coordinates of the stage's signs (the same on every replica).
        shapes: the tensors' shapes (needed only when ``signs`` has None entries).
    Returns:
        0.0 when every replica holds the same signs; 1.0 where two disagree; 0.5 where one
        holds none.
    """
    if signs is None:
        v = torch.zeros(numel, dtype=torch.int32)
    else:
        shapes = shapes if shapes is not None else [tuple(s.shape) for s in signs]
        v = torch.cat([(s if s is not None else torch.zeros(sh)).reshape(-1) for s, sh in zip(signs, shapes)])
        v = v.to(torch.int32)
    hi, neg_lo = v.clone(), -v
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(neg_lo, op=dist.ReduceOp.MAX, group=group)
    return float((hi + neg_lo).max()) / 2 if numel else 0.0
