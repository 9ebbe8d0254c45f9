"""The sampler's bf16 weights, kept in sync by sending only the entries that changed
(``--rollout-dtype bf16``; issue 12 item 3).

Every non-driver stage keeps the bf16 bits it last delivered; the driver (pipeline rank 0, where
the sampler lives) keeps a bf16 mirror of each such stage. Both start from the checkpoint every
rank loads (the driver's mirror of stage r is ``hf_to_megatron(hf_state_dict, stage r)``), so
nothing crosses before the first step; a mirror that differs is caught by the first sync's
state digest and fixed by a full copy. One sync, per non-driver stage r (``delta_codec.py``):

    stage r -> driver   header (int64 [HEADER_LEN]: seq, kind, CRC-32, state digest) + payload
    driver -> stage r   ack (uint8 [1]): 0 accepted, 1 rejected -> stage r sends a FULL copy
                        under a new header and the driver checks it the same way

A rejected sync (wrong sequence number, corrupt payload, digest mismatch) is logged as one
``[cegrpo] warning`` line and counted in ``sync/full_resyncs``; a full copy that fails too
raises, so the sampler never runs on weights other than the trainer's rounded to bf16.

Metering (:meth:`DeltaWeightSync.metrics`, on the driver, for the last sync): ``sync/bytes`` is
every byte the non-driver stages and the driver exchanged (headers, payloads, acks). The
driver's own stage never crosses a host: it is rounded in place and counted in no byte key,
only in ``sync/local_changed_frac``. ``sync/dense_bytes`` / ``sync/dense_fp32_bytes`` are one
dense copy of the non-driver stages in bf16 / fp32 (the latter is what ``--rollout-dtype
fp32`` sends).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_cegrpo.pipeline import delta_codec as dc
from megatron_cegrpo.pipeline.weight_sync import gather_meta, unflatten

__all__ = ["DeltaWeightSync"]

_OK, _RESYNC = 0, 1


def _warn(msg: str) -> None:
    print(f"[cegrpo] warning: {msg}", flush=True)


class DeltaWeightSync:
    """bf16 weights of every stage on the driver, sent as changed entries only.

    Args:
        model: this rank's stage.
        pp_group: the pipeline group; its rank 0 is the driver.
        baseline: on the driver, ``baseline(r)`` -> {megatron name: tensor} of stage r as the
            sampler was loaded (None: the first sync of each stage is a logged full resync).
        log: where the resync warning goes (one line).
    """

    def __init__(self, model: torch.nn.Module, pp_group,
                 baseline: Optional[Callable[[int], Dict[str, torch.Tensor]]] = None,
                 log: Callable[[str], None] = _warn):
        self.group, self.log = pp_group, log
        self.pp_rank, self.pp_size = pp_group.rank(), pp_group.size()
        self.driver = dist.get_global_rank(pp_group, 0)
        self.named = list(model.named_parameters())
        self.meta = gather_meta(model, pp_group)
        self.seq = 0  # a stage: last delivered; the driver: last accepted, per stage
        self.state = dc.bf16_bits([p for _, p in self.named])  # a stage: what the driver holds
        self.mirrors: Dict[int, Optional[torch.Tensor]] = {}
        self.seqs: Dict[int, int] = {}
        if self.pp_rank == 0:
            for r in range(1, self.pp_size):
                names = [n for n, _, _ in self.meta[r]]
                self.mirrors[r] = dc.bf16_bits([baseline(r)[n] for n in names]) if baseline else None
                self.seqs[r] = 0
        self._last: Dict[str, float] = {}

    # ------------------------------------------------------------------ a stage
    def _send(self, t: torch.Tensor, peer: int) -> int:
        dist.send(t, dst=peer, group=self.group)
        return t.numel() * t.element_size()

    def _recv(self, t: torch.Tensor, peer: int) -> int:
        dist.recv(t, src=peer, group=self.group)
        return t.numel() * t.element_size()

    @torch.no_grad()
    def _deliver(self) -> None:
        """Stage side: send the delta (or a full copy when smaller) and, if rejected, a full copy."""
        new = dc.bf16_bits([p for _, p in self.named])
        payload, changed = dc.encode_delta(self.state, new)
        kind = dc.KIND_DELTA
        if payload.numel() >= 2 * new.numel():
            payload, kind = dc.encode_full(new), dc.KIND_FULL
        digest = dc.state_digest(new)
        self.seq += 1
        for _ in range(2):
            self._send(dc.make_header(self.seq, kind, new.numel(), payload, changed, digest), self.driver)
            self._send(payload, self.driver)
            ack = torch.zeros(1, dtype=torch.uint8)
            self._recv(ack, self.driver)
            if int(ack) == _OK:
                self.state = new
                return
            payload, kind = dc.encode_full(new), dc.KIND_FULL
        raise RuntimeError(f"sampler weight sync: the driver rejected stage {self.pp_rank}'s full copy")

    # ------------------------------------------------------------------ the driver
    def _receive(self, r: int) -> Dict[str, int]:
        """Driver side for stage r: returns {"bytes", "changed", "resyncs"} of this sync."""
        src = dist.get_global_rank(self.group, r)
        nbytes, resyncs = 0, 0
        for attempt in range(2):
            header = torch.zeros(dc.HEADER_LEN, dtype=torch.int64)
            nbytes += self._recv(header, src)
            f = header.tolist()
            if not 0 <= f[4] <= 2 * f[3] + 64 or not dc.header_ok(header):
                raise RuntimeError(f"sampler weight sync: stage {r}'s header is corrupt (fields {f})")
            payload = torch.empty(f[4], dtype=torch.uint8)
            nbytes += self._recv(payload, src)
            try:  # a resync must be a full copy: no base state is offered for a delta
                base = self.mirrors[r] if attempt == 0 else None
                self.mirrors[r] = dc.check_and_apply(base, header, payload, self.seqs[r] + 1)
                self.seqs[r] = f[1]
                nbytes += self._send(torch.tensor([_OK], dtype=torch.uint8), src)
                return {"bytes": nbytes, "changed": f[5], "resyncs": resyncs}
            except dc.SyncRejected as e:
                nbytes += self._send(torch.tensor([_RESYNC], dtype=torch.uint8), src)  # the stage stops too
                if attempt == 1:
                    raise RuntimeError(f"sampler weight sync: stage {r}'s full copy was rejected ({e})") from None
                self.log(f"sampler weight sync: stage {r}'s update seq {f[1]} rejected ({e}); full resync "
                         f"of {2 * f[3]} bytes")
                resyncs += 1
        raise AssertionError("unreachable")

    @torch.no_grad()
    def gather(self) -> Optional[List[Dict[str, torch.Tensor]]]:
        """Collective over the pipeline. Returns on the driver one {name: bf16 tensor} per stage
        (stage order; the trainer's weights rounded to bf16, bit for bit); None elsewhere.

        Raises:
            RuntimeError: a stage's header is corrupt or its full copy fails verification
                (the sampler's weights cannot be vouched for).
        """
        if self.pp_rank != 0:
            self._deliver()
            return None
        own = dc.bf16_bits([p for _, p in self.named])
        local_changed = int((own != self.state).sum())
        self.state = own
        out = [dict(zip([n for n, _ in self.named], unflatten(own.view(torch.bfloat16),
                                                             [tuple(p.shape) for _, p in self.named])))]
        total = {"bytes": 0, "changed": 0, "resyncs": 0}
        for r in range(1, self.pp_size):
            for k, v in self._receive(r).items():
                total[k] += v
            shapes = [s for _, s, _ in self.meta[r]]
            out.append(dict(zip([n for n, _, _ in self.meta[r]],
                                unflatten(self.mirrors[r].view(torch.bfloat16), shapes))))
        shipped = sum(m.numel() for m in self.mirrors.values() if m is not None)
        self._last = {"sync/bytes": total["bytes"], "sync/dense_bytes": 2 * shipped,
                      "sync/dense_fp32_bytes": 4 * shipped, "sync/changed_entries": total["changed"],
                      "sync/changed_frac": total["changed"] / shipped if shipped else 0.0,
                      "sync/local_changed_frac": local_changed / max(own.numel(), 1),
                      "sync/full_resyncs": total["resyncs"]}
        return out

    def metrics(self) -> Dict[str, float]:
        """The last sync's metrics (driver; empty elsewhere): ``sync/bytes`` (wire bytes, both
        directions), ``sync/dense_bytes`` (a dense bf16 copy of the non-driver stages),
        ``sync/dense_fp32_bytes`` (the same in fp32), ``sync/changed_entries`` and
        ``sync/changed_frac`` (entries whose bf16 value changed, non-driver stages),
        ``sync/local_changed_frac`` (the same for the driver's own stage, sent nowhere),
        ``sync/full_resyncs`` (rejected updates answered by a full copy)."""
        return dict(self._last)
