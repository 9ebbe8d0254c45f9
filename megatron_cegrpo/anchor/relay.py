"""One sign relay for every layout (issue 34): how the signs the anchor sends one rank of a stage
reach every other rank of that stage.

Only (data-parallel replica 0, TP rank 0) of each stage talks to the anchor (``anchor/client.py``):
it ships the stage's weights (the whole, gathered weights at TP > 1: ``models/tp_shard.py``) and
receives the whole stage's sign(M), 1 bit a parameter. Every other rank of the stage takes its signs
over megatron-core's own groups, inside a host (not in the whole-step ledger, like megatron's TP and
DP collectives), along at most two :class:`Hop` s that the :class:`Layout` decides
(:func:`build_relay`):

======================  ======================  ==========================================
rank of the stage       receives from           sends on
======================  ======================  ==========================================
replica 0, TP rank 0    the anchor              the DP hop (if DP > 1), then the TP hop (if TP > 1)
replica > 0, TP rank 0  the DP hop              the TP hop (if TP > 1)
any replica, TP r > 0   the TP hop              nothing
======================  ======================  ==========================================

- **the DP hop** (LA-WARMUP-V2 invariant 2, "DP replicas receive identical signs"): over the DP
  group of the stage's TP-rank-0s (megatron's DP group of TP rank 0), the whole stage's signs,
  broadcast; metered as ``anchor/bytes_dp_fanout``.
- **the TP hop**: over each replica's TP group, each TP rank r receives **only r's shard** of every
  tensor (:func:`shard_signs`: ``models.tp_shard.shard_tensor``'s chunk along megatron's partition
  dim, ``cat[gate_r, up_r]`` for the GLU fc1, the whole tensor for a replicated norm), point to
  point; metered as ``anchor/bytes_tp_fanout``.

One protocol on both hops, after every optimizer-step preparation (the same call point on every
rank): a broadcast header ``[alive, code]`` (int64 x 2; code :data:`KEEP` 0 = signs unchanged,
:data:`NEW` 1 = new signs follow, :data:`CLEARED` 2 = signs cleared, :data:`PARTIAL` 3 = new signs
follow after a per-tensor "informative" bitmap, also broadcast: the sender holds no sign for a
tensor whose anchor M is all 0, ``anchor/memory.py``) and, for codes 1 and 3, the signs packed 1 bit
a parameter (``anchor/signs.py``; a tensor without a sign packs as +1 and is dropped again by the
receiver). A rank that holds the whole stage's signs at TP > 1 (TP rank 0) gives its own hook its
shard. So every rank applies exactly its slice of the one whole-stage sign(M), including after the
anchor is lost (``alive`` 0 reaches every rank in the next header) and under ``--sign-fold fire-only``.

:func:`sign_deviation` checks it from the signs each replica's hook actually holds:
``anchor/sign_dev_across_dp`` = max over coordinates of ``(max_r s_r - min_r s_r) / 2`` (a replica
without signs counts 0 there), 0 when every replica applies the same sign everywhere.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.signs import pack_bits, pack_sign_list, packed_nbytes, unpack_bits, unpack_sign_list
from megatron_cegrpo.anchor.transport import is_fire_step
from megatron_cegrpo.models.tp_shard import shard_tensor

__all__ = ["Hop", "SignRelay", "RelayFollower", "build_relay", "shard_signs", "held_signs", "sign_deviation",
           "KEEP", "NEW", "CLEARED", "PARTIAL"]

KEEP, NEW, CLEARED, PARTIAL = 0, 1, 2, 3

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


def _code(before: Signs, after: Signs) -> int:
    """The header's code for the change from ``before`` to ``after`` (``after is before``: unchanged)."""
    return (KEEP if after is before else CLEARED if after is None
            else PARTIAL if any(s is None for s in after) else NEW)


class Hop:
    """One link of the relay over a process group: its member 0 sends, the others receive.

    Args:
        group: the process group (the stage's DP group of TP rank 0, or a replica's TP group).
        shapes: the shapes each receiver's signs have, in the hook's order (the whole stage's on
            the DP hop; a TP rank's shard shapes on the TP hop: megatron splits evenly, so every
            TP rank's are the same).
        names: on a TP hop, the stage-local names (each receiver gets its own shard of the whole
            signs, :func:`shard_signs`); None on a DP hop (every receiver gets the same signs).
        metric: the metric key its sender's bytes go to (``anchor/bytes_dp_fanout``, ``..._tp_fanout``).
        upstream_name: who the receivers hear from, for the one line when the anchor is lost.
    Attributes:
        sent_bytes: bytes member 0 sent since the last :meth:`take_bytes` (each header and bitmap
            once per receiver; the packed signs once per receiver).
    """

    def __init__(self, group, shapes: Sequence[Tuple[int, ...]], names: Optional[Sequence[str]] = None,
                 metric: str = "anchor/bytes_dp_fanout", upstream_name: str = "replica 0"):
        self.group, self.metric, self.upstream_name = group, metric, upstream_name
        self.names = list(names) if names is not None else None
        self.size = dist.get_world_size(group)
        self.ranks = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.shapes = [tuple(s) for s in shapes]
        self.numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
        if self.names is not None and len(self.names) != len(self.shapes):
            raise ValueError(f"{len(self.names)} names for {len(self.shapes)} sign tensors")
        self.sent_bytes = 0

    def _packed(self, signs: List[Optional[torch.Tensor]]) -> torch.Tensor:
        return pack_sign_list([s if s is not None else torch.ones(sh) for s, sh in zip(signs, self.shapes)])[0]

    def send(self, alive: bool, before: Signs, after: Signs) -> None:
        """On member 0 (a collective over the group): the change from ``before`` to ``after``
        (whole-stage sign lists or None) and whether the anchor is alive."""
        code = _code(before, after)
        src, others = self.ranks[0], self.size - 1
        dist.broadcast(torch.tensor([int(alive), code], dtype=torch.int64), src=src, group=self.group)
        self.sent_bytes += 16 * others
        if code == PARTIAL:
            bitmap = pack_bits(torch.tensor([s is not None for s in after], dtype=torch.bool))
            dist.broadcast(bitmap, src=src, group=self.group)
            self.sent_bytes += bitmap.numel() * others
        if code not in (NEW, PARTIAL):
            return
        if self.names is None:  # every receiver the same signs
            packed = self._packed(after)
            dist.broadcast(packed, src=src, group=self.group)
            self.sent_bytes += packed.numel() * others
            return
        for r in range(1, self.size):  # each receiver its own shard
            packed = self._packed(shard_signs(self.names, after, r, self.size))
            dist.send(packed, dst=self.ranks[r], group=self.group)
            self.sent_bytes += packed.numel()

    def recv(self) -> Tuple[bool, int, Signs]:
        """On the other members: ``(alive, code, signs)``, signs as {-1, +1} fp32 tensors of
        :attr:`shapes` for codes :data:`NEW` and :data:`PARTIAL` (None for a tensor the sender
        holds no sign for), else None."""
        hdr = torch.zeros(2, dtype=torch.int64)
        src = self.ranks[0]
        dist.broadcast(hdr, src=src, group=self.group)
        alive, code = bool(hdr[0]), int(hdr[1])
        if code not in (NEW, PARTIAL):
            return alive, code, None
        info = [True] * len(self.shapes)
        if code == PARTIAL:
            bitmap = torch.empty(packed_nbytes(len(self.shapes)), dtype=torch.uint8)
            dist.broadcast(bitmap, src=src, group=self.group)
            info = unpack_bits(bitmap, len(self.shapes))
        packed = torch.empty(packed_nbytes(self.numel), dtype=torch.uint8)
        if self.names is None:
            dist.broadcast(packed, src=src, group=self.group)
        else:
            dist.recv(packed, src=src, group=self.group)
        return alive, code, [s if ok else None for s, ok in zip(unpack_sign_list(packed, self.shapes), info)]

    def take_bytes(self) -> int:
        """:attr:`sent_bytes`, reset to 0."""
        n, self.sent_bytes = self.sent_bytes, 0
        return n


class SignRelay:
    """What one trainer rank holds and whom it tells: the ``correction`` its anchor client sets.

    Args:
        hook: this rank's ``SignCorrectionHook`` (its own parameter shapes: shards at TP > 1).
        names: the stage-local names of the hook's parameters, in order.
        upstream: the :class:`Hop` this rank receives from; None on the rank that talks to the anchor.
        downstream: the hops this rank sends on, in order (DP before TP).
        shard: ``(tp_rank, tp_size)`` when this rank holds the whole stage's signs and its hook
            applies only its shard (TP rank 0 at TP > 1); None when what it holds is what its
            hook applies.
    Attributes:
        signs: the signs last set (the whole stage's where ``shard`` is given; None when cleared).
    """

    def __init__(self, hook, names: Sequence[str], upstream: Optional[Hop] = None,
                 downstream: Sequence[Hop] = (), shard: Optional[Tuple[int, int]] = None):
        self.hook, self.names, self.shard = hook, list(names), shard
        self.upstream, self.downstream = upstream, list(downstream)
        self.signs: Signs = None

    def set_signs(self, signs: Signs) -> None:
        """Hold ``signs`` (or None: clear; a list of only None entries clears, as the hook does)
        and set the hook to them, or to this rank's shard of them.

        Raises:
            ValueError: a count or shape that does not fit the hook's parameters.
        """
        if signs is not None and all(s is None for s in signs):
            signs = None
        self.hook.set_signs(signs if self.shard is None else shard_signs(self.names, signs, *self.shard))
        self.signs = signs

    def lead(self, alive: bool, before: Signs, after: Signs) -> None:
        """Send the change from ``before`` to ``after`` on every downstream hop (none: nothing)."""
        for hop in self.downstream:
            hop.send(alive, before, after)

    def receive(self) -> Tuple[bool, int]:
        """On a rank with an upstream hop: take its header and signs into :meth:`set_signs`.

        Returns:
            ``(alive, code)`` as the sender wrote them.
        """
        alive, code, signs = self.upstream.recv()
        if code in (NEW, PARTIAL):
            self.set_signs(signs)
        elif code == CLEARED:
            self.set_signs(None)
        return alive, code

    def take_bytes(self) -> Dict[str, int]:
        """Per downstream hop's metric key, the bytes this rank sent on it since the last call."""
        out: Dict[str, int] = {}
        for hop in self.downstream:
            out[hop.metric] = out.get(hop.metric, 0) + hop.take_bytes()
        return out


def build_relay(ctx, hook, names: Sequence[str], whole_shapes: Sequence[Tuple[int, ...]]) -> SignRelay:
    """This rank's :class:`SignRelay` from its place in the layout (module docstring's table).

    Args:
        ctx: the DistContext (``tp_rank``, ``tp_size``, ``tp_group``, ``dp_rank``, ``dp_group``:
            megatron's DP group of this rank's TP rank, None at DP = 1).
        hook: this rank's ``SignCorrectionHook``.
        names: the stage-local names of the hook's parameters (``StageWorker.named_owned``).
        whole_shapes: the whole stage's parameter shapes in the same order (the hook's at TP = 1).
    """
    tp = ctx.tp_size
    dp_hop = (Hop(ctx.dp_group, whole_shapes, metric="anchor/bytes_dp_fanout", upstream_name="replica 0")
              if ctx.dp_group is not None and ctx.tp_rank == 0 else None)
    tp_hop = (Hop(ctx.tp_group, [tuple(p.shape) for p in hook.params], names=names,
                  metric="anchor/bytes_tp_fanout", upstream_name="TP rank 0 of its stage") if tp > 1 else None)
    shard = (ctx.tp_rank, tp) if tp > 1 and ctx.tp_rank == 0 else None
    if ctx.tp_rank > 0:
        upstream, downstream = tp_hop, []
    elif ctx.dp_rank == 0:
        upstream, downstream = None, [h for h in (dp_hop, tp_hop) if h is not None]
    else:
        upstream, downstream = dp_hop, [h for h in (tp_hop,) if h is not None]
    return SignRelay(hook, names, upstream=upstream, downstream=downstream, shard=shard)


class RelayFollower:
    """The anchor client of every rank that does not talk to the anchor (``AnchorClient``'s
    interface, as ``AnchorCircuit`` calls it): no anchor traffic; at each optimizer-step preparation
    it takes what its upstream hop sends and passes it on (:meth:`SignRelay.receive`, :meth:`~SignRelay.lead`).

    Checkpoints: a TP rank > 0 writes its own held shard signs (``trainer_state_tpRR``); a rank
    with TP rank 0 on a replica > 0 writes none (replica 0 does) and on a resume loads replica 0's
    TP rank 0 state (the whole signs), as its relay then holds them.

    Args:
        anchor: the AnchorConfig (c, for ``anchor/fire``; ``anchor_ship_check``).
        relay: this rank's :class:`SignRelay` (with an upstream hop).
        rank: this rank's global rank (for the one line when the anchor is lost).
        writes_own_state: True on a TP rank > 0 (its :meth:`state_dict` is its shard signs).
    """

    def __init__(self, anchor, relay: SignRelay, rank: int = 0, writes_own_state: bool = False):
        self.a, self.relay, self.rank, self.writes_own_state = anchor, relay, rank, writes_own_state
        self.alive = True
        self.stats: Dict = {}
        self._state: Dict = {}

    def connect(self) -> None:
        """Nothing: the anchor knows only (replica 0, TP rank 0) of each stage."""

    def after_rollout(self, t: int, batch) -> None:
        """Nothing: the anchor's rank ships the weights and the driver the batch."""

    def before_optimizer_step(self, t: int, timers) -> None:
        """Take the upstream signs and pass them on (the same call point on every rank)."""
        before = self.relay.signs
        with timers.phase("anchor_wait"):
            alive, _ = self.relay.receive()
        if self.alive and not alive:
            self.alive = False
            print(f"[cegrpo] rank {self.rank}: {self.relay.upstream.upstream_name} lost the anchor; training goes "
                  f"on without the sign correction (anchor/alive = 0)", flush=True)
        self.relay.lead(self.alive, before, self.relay.signs)

    def finish(self, t_last: int, timers) -> None:
        """Nothing to drain."""

    def save_anchor_state(self, tmp_dir: str, anchor_subdir: str) -> bool:
        return False  # only the driver saves the anchor's state

    def state_dict(self) -> Dict:
        """A TP rank > 0: its held shard signs (int8, None entries kept). Otherwise the state
        loaded from replica 0 (replicas other than 0 write no checkpoint)."""
        if not self.writes_own_state:
            return dict(self._state)
        signs = self.relay.signs
        return {"signs": [s.to(torch.int8) if s is not None else None for s in signs] if signs is not None else None}

    def load_state_dict(self, state: Dict) -> None:
        """The checkpoint's held signs (``state["signs"]``) become the relay's."""
        self._state = dict(state)
        self.relay.set_signs(held_signs(state["signs"]))

    def metrics(self, t: int) -> Dict:
        return {"anchor/fire": int(is_fire_step(t, self.a.anchor_interval) and self.alive),
                "anchor/bytes_in": 0, "anchor/bytes_out": 0, "anchor/bytes_ship": 0, "anchor/bytes_ship_fp32": 0,
                "anchor/alive": int(self.alive), "anchor/ship_resyncs": 0,
                **({"anchor/bytes_ship_check": 0} if self.a.anchor_ship_check else {})}


def held_signs(stored) -> Signs:
    """The hook's signs from a checkpoint's ``signs`` (int8 tensors, None entries for tensors
    without a sign, or None): fp32 {-1, +1} tensors, None kept."""
    if stored is None:
        return None
    return [s.float() if s is not None else None for s in stored]


@torch.no_grad()
def sign_deviation(signs: Signs, numel: int, group, shapes: Optional[Sequence[Tuple[int, ...]]] = None) -> float:
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
