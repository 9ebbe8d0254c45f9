"""The trainer ranks' side of the anchor circuit (DESIGN.md section 4).

Every stage ships theta(s) every c iterations without waiting (``isend``), the driver
adds the rollout batches, and on a fire the stages take sign(M) and hand it to the
optimizer's pre-step correction hook. See ``anchor/transport.py`` for the schedule.

The anchor is advisory: when it dies (its connection closes) or a fire's signs take longer
than ``--anchor-timeout-minutes``, each stage drops the held sign, stops all anchor traffic,
says so once, logs ``anchor/alive`` 0 and trains on without the correction; under torchrun with
restarts left the stage stops instead and every rank restarts (``restart.py``).
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.relay import held_signs
from megatron_cegrpo.anchor.shipment import ShipmentEncoder
from megatron_cegrpo.anchor.signs import packed_nbytes, unpack_bits, unpack_sign_list
from megatron_cegrpo.anchor.transport import (
    META_TAG, TAG_BASIS, TAG_BATCH, TAG_MIRROR_ACK, TAG_PARAMS, TAG_PARAMS_EXACT, TAG_PARAMS_HDR, TAG_SAVE,
    TAG_SAVE_DONE, TAG_SIGN_HDR, TAG_SIGN_INFO, TAG_SIGNS, TAG_STATS, flatten_params, is_fire_step, is_ship_step,
    isend_object, recv_object, recv_tensor, send_object,
)
from megatron_cegrpo.restart import restarts_left
from megatron_cegrpo.grpo.batch import RolloutBatch

__all__ = ["AnchorClient", "ANCHOR_BATCH_KEYS"]

# what the anchor needs to replay a batch: token ids, masks, advantages (no rewards, no text)
ANCHOR_BATCH_KEYS = ("tokens", "position_ids", "labels", "loss_mask", "advantages", "sample_ids")


class AnchorClient:
    """One per trainer rank.

    Args:
        named_params: ``[(name, parameter)]`` of this rank's stage that the stage trains, in the
            order of the signs (the stage's model order; without the first stage's tied
            embedding under ``--tied-embedding-sync sparse``: the anchor takes W from the last
            stage's copy).
        layer_offset: global index of the stage's first layer.
        tied_output: True on the last stage of a tied-embedding model with PP > 1.
        anchor_rank: global rank of the anchor.
        is_driver: this rank also sends batches and receives the anchor's statistics.
        anchor: the AnchorConfig (c, the apply and fold modes, the timeout, the debug dir).
        correction: this rank's ``SignRelay`` (``anchor/relay.py``): it sets the optimizer's
            SignCorrectionHook (to this TP rank's shard of the whole signs at TP > 1) and, after each
            ``before_optimizer_step``, passes the signs it holds on to the stage's other ranks.
        group: the anchor group (``DistContext.anchor_group``).
        rank: this rank's global rank (for messages).
        bases: with an anchor-owned lowrank basis, ``(slots, sink)``: ``slots`` the
            ``(boundary, shape, dtype)`` of each basis the anchor sends this stage (ascending
            boundaries), ``sink(boundary, q, first_step)`` the codec's ``stage_basis``; a basis
            received during iteration t serves from t + 1 at both ends. None: no bases.
        batch_keys: the rollout batch's keys sent to the anchor (with a shipment, or on a fire step
            that had none; ``ANCHOR_BATCH_KEYS``, plus ``replay.SHARED_PREFIX_KEYS`` under
            ``--shared-prefix``).
    """

    def __init__(self, named_params, layer_offset: int, tied_output: bool, anchor_rank: int, is_driver: bool,
                 anchor, correction, group=None, rank: int = 0, bases=None, batch_keys=ANCHOR_BATCH_KEYS):
        self.a = anchor
        self.batch_keys = tuple(batch_keys)
        named_params = list(named_params)
        self.params = [p for _, p in named_params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.anchor = anchor_rank
        self.is_driver = is_driver
        self.correction = correction
        self.group = group
        self.rank = rank
        self.alive = True
        self.timeout = (timedelta(minutes=self.a.anchor_timeout_minutes) if self.a.anchor_timeout_minutes > 0
                        else None)
        self._pending: List[list] = []
        self._sent_batch_at: Optional[int] = None
        self._awaiting: Optional[int] = None  # fire iteration whose signs are still to be received
        self._fresh_for: Optional[int] = None
        self.bytes_in = 0  # to the anchor
        self.bytes_out = 0  # from the anchor
        self.shipment = ShipmentEncoder(self.a.anchor_ship)  # theta(s) as fp32 or deltas (anchor/shipment.py)
        self.ship_bytes = 0  # the weight shipments' part of bytes_in
        self.ship_dense_bytes = 0  # the same shipments in fp32 (the ledger's dense baseline)
        self.ship_check_bytes = 0  # --anchor-ship-check's exact copies (debug, not in the ledger)
        self.ship_resyncs = 0  # keyframes the anchor asked for (a refused shipment), this iteration
        self.stats: Dict = {}
        self.bases = bases
        self._now = 0  # the iteration whose before_optimizer_step (or finish) receives signs
        self._meta = {"params": [(n, tuple(p.shape)) for n, p in named_params],
                      "layer_offset": int(layer_offset), "tied_output": bool(tied_output)}
        dump = self.a.anchor_debug_dir
        if dump:
            torch.save(self._meta, os.path.join(dump, f"stage_meta_{layer_offset:04d}.pt"))

    # ------------------------------------------------------------------ liveness
    def _guard(self, what: str, fn: Callable[[], None]) -> bool:
        """Run one exchange with the anchor; on a closed connection or a timeout, go on without it.

        Returns True when ``fn`` ran to completion, False when the anchor is (now) gone.
        """
        if not self.alive:
            return False
        try:
            fn()
            return True
        except RuntimeError as e:  # gloo/NCCL: "Connection closed by peer", timeouts
            self._lose(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            return False

    def _lose(self, why: str) -> None:
        """Go on without the anchor, saying so once; under torchrun with restarts left
        (``restart.restarts_left``) end this stage instead (exit status 1): the agent restarts every
        rank from the newest checkpoint, the anchor's state in it, and no save here goes without it."""
        if restarts_left():
            print(f"[cegrpo] rank {self.rank}: lost the anchor rank {self.anchor} ({why}); this stage stops and "
                  "torchrun restarts every rank from the newest complete checkpoint", flush=True)
            raise SystemExit(1)
        self.alive = False
        self._pending = []
        self._awaiting = None
        self.correction.set_signs(None)
        print(f"[cegrpo] rank {self.rank}: lost the anchor rank {self.anchor} ({why}); training goes on "
              f"without the sign correction (anchor/alive = 0)", flush=True)

    def connect(self) -> None:
        """Send this stage's parameter names/shapes and, after a resume, the fire whose signs it
        still awaits (the anchor sends those again). Call once, after ``load_state_dict``."""
        flat = flatten_params(self.params)
        digest = self.shipment.start(flat)
        meta = dict(self._meta, awaiting=self._awaiting, mirror_digest=digest, ship_seq=self.shipment.seq)

        def hello():
            self.bytes_in += send_object(meta, self.anchor, META_TAG, self.group)
            if digest is not None:  # the anchor's answer: does it hold the mirror already?
                ack = torch.zeros(1, dtype=torch.uint8)
                recv_tensor(ack, self.anchor, TAG_MIRROR_ACK, self.group, self.timeout)
                self.bytes_out += 1
                self.shipment.agreed(bool(int(ack)))
                if not int(ack):
                    print(f"[cegrpo] rank {self.rank}: the anchor's copy of this stage's weights differs from "
                          f"this stage's (mirror digest {digest[:12]}); the first shipment is an fp32 keyframe "
                          f"({4 * flat.numel() / 1e6:.1f} MB)", flush=True)

        self._guard("hello", hello)

    def _wait_pending(self) -> None:
        def wait():
            for keep in self._pending:
                for w in keep[0]:
                    w.wait()
            self._pending = []

        self._guard("waiting for sends", wait)

    # ------------------------------------------------------------------ the schedule
    def after_rollout(self, t: int, batch: RolloutBatch) -> None:
        """Call on every trainer rank once iteration t's batch exists, before any update."""
        c = self.a.anchor_interval
        if is_ship_step(t, c) and self.alive:
            self._wait_pending()  # the previous shipment must be out before its buffers go

            def ship():
                flat = flatten_params(self.params)
                payload = self.shipment.encode(flat)  # None: theta(0), which the anchor holds
                if payload is not None:
                    header, data = self.shipment.header(payload), payload.view(torch.uint8)
                    self._pending.append([[dist.isend(header, dst=self.anchor, tag=TAG_PARAMS_HDR, group=self.group),
                                           dist.isend(data, dst=self.anchor, tag=TAG_PARAMS, group=self.group)],
                                          header, data])
                    self.bytes_in += header.numel() * 8 + data.numel()
                    self.ship_bytes += data.numel()
                self.ship_dense_bytes += flat.numel() * 4
                if self.a.anchor_ship_check:  # debug: the exact weights too, outside the ledger
                    self._pending.append([[dist.isend(flat, dst=self.anchor, tag=TAG_PARAMS_EXACT, group=self.group)],
                                          flat])
                    self.ship_check_bytes += flat.numel() * 4
                if self.is_driver:
                    self._send_batch(t, batch)

            self._guard(f"shipping theta({t - 1})", ship)
        if is_fire_step(t, c) and self.alive:
            if self.is_driver and self._sent_batch_at != t:
                self._guard(f"sending batch {t}", lambda: self._send_batch(t, batch))
            if self.alive:
                self._awaiting = t

    def _send_batch(self, t: int, batch) -> None:
        keep, n = isend_object({k: batch[k] for k in self.batch_keys}, self.anchor, TAG_BATCH, self.group)
        self._pending.append(keep)
        self.bytes_in += n
        self._sent_batch_at = t

    def before_optimizer_step(self, t: int, timers) -> None:
        """Receive the sign where the apply mode says so; set the hook's signs for this step."""
        due = self._awaiting is not None and (
            self.a.anchor_apply == "fire-step" or t > self._awaiting)
        self._now = t
        before = self.correction.signs
        if due:
            fire = self._awaiting
            with timers.phase("anchor_wait"):
                if self._guard(f"waiting for the signs of fire {fire}", self._receive_signs):
                    self._fresh_for = t
            self._awaiting = None
        if self.a.sign_fold == "fire-only" and self._fresh_for != t:
            self.correction.set_signs(None)
        self.correction.lead(self.alive, before, self.correction.signs)  # the stage's other ranks

    def _receive_signs(self) -> None:
        hdr = torch.zeros(1, dtype=torch.int64)
        recv_tensor(hdr, self.anchor, TAG_SIGN_HDR, self.group, self.timeout)
        self.bytes_out += 8
        flags = int(hdr.item())
        if flags & 8:  # the anchor refused one of this stage's shipments: its mirror is gone
            self.shipment.resync()
            self.ship_resyncs += 1
            print(f"[cegrpo] warning: rank {self.rank}: the anchor refused a weight shipment (logged on the "
                  "anchor); the next shipment is a full fp32 keyframe", flush=True)
        info = None  # per tensor: False where the anchor's M is 0 on the whole tensor (no correction)
        if flags & 4:
            bitmap = torch.empty(packed_nbytes(len(self.shapes)), dtype=torch.uint8)
            recv_tensor(bitmap, self.anchor, TAG_SIGN_INFO, self.group, self.timeout)
            self.bytes_out += bitmap.numel()
            info = unpack_bits(bitmap, len(self.shapes))
        if flags & 1:
            numel = sum(int(torch.Size(s).numel()) for s in self.shapes)
            packed = torch.empty(packed_nbytes(numel), dtype=torch.uint8)
            recv_tensor(packed, self.anchor, TAG_SIGNS, self.group, self.timeout)
            self.bytes_out += packed.numel()
            signs = unpack_sign_list(packed, self.shapes)
            self.correction.set_signs(signs if info is None else [s if ok else None for s, ok in zip(signs, info)])
        elif info is not None:  # M is 0 on every tensor of this stage: no correction
            self.correction.set_signs(None)
        if flags & 2:
            self._receive_bases()
        if self.is_driver:
            self.stats, n = recv_object(self.anchor, TAG_STATS, self.group, self.timeout)
            self.bytes_out += n

    def _receive_bases(self) -> None:
        """The anchor's lowrank bases of this stage's boundaries, serving from the next iteration."""
        assert self.bases is not None, "the anchor sent lowrank bases to a stage that expects none"
        slots, sink = self.bases
        for boundary, shape, dtype in slots:
            q = torch.empty(shape, dtype=dtype)
            recv_tensor(q, self.anchor, TAG_BASIS, self.group, self.timeout)
            self.bytes_out += q.numel() * q.element_size()
            sink(boundary, q, self._now + 1)

    def finish(self, t_last: int, timers) -> None:
        """Drain: a fire whose sign was never applied is still received (the anchor sent it)."""
        self._now = t_last
        if self._awaiting is not None:
            with timers.phase("anchor_wait"):
                self._guard("draining the last fire", self._receive_signs)
            self._awaiting = None
        self._wait_pending()

    # ------------------------------------------------------------------ checkpoints
    def save_anchor_state(self, tmp_dir: str, anchor_subdir: str) -> bool:
        """Driver only: have the anchor write its state into the checkpoint being saved.

        Sends ``tmp_dir`` and waits for the anchor's answer. When the anchor is gone (or
        fails to write), ``tmp_dir/anchor_subdir`` is removed so that the checkpoint holds
        no partial anchor file; a resume then starts the anchor empty. Returns True when
        the anchor's state is in the checkpoint.
        """
        reply = {}

        def exchange():
            self.bytes_in += send_object(tmp_dir, self.anchor, TAG_SAVE, self.group)
            reply["v"], n = recv_object(self.anchor, TAG_SAVE_DONE, self.group)
            self.bytes_out += n

        ok = self._guard("saving its state", exchange) and reply.get("v") == "ok"
        if not ok:
            if self.alive:
                print(f"[cegrpo] warning: the anchor could not save its state ({reply.get('v')}); "
                      f"the checkpoint holds none", flush=True)
            shutil.rmtree(os.path.join(tmp_dir, anchor_subdir), ignore_errors=True)
        return ok

    def state_dict(self) -> Dict:
        """What a resumed run needs: the schedule position and the held sign."""
        self._wait_pending()
        signs = self.correction.signs
        return {"sent_batch_at": self._sent_batch_at, "awaiting": self._awaiting, "fresh_for": self._fresh_for,
                "signs": [s.to(torch.int8) if s is not None else None for s in signs] if signs is not None else None,
                "shipment": self.shipment.state_dict()}

    def load_state_dict(self, state: Dict) -> None:
        self._sent_batch_at, self._awaiting = state["sent_batch_at"], state["awaiting"]
        self._fresh_for = state["fresh_for"]
        signs = state["signs"]
        self.correction.set_signs(held_signs(signs))
        self.shipment.load_state_dict(state.get("shipment"))  # absent before issue 12: a keyframe first

    def metrics(self, t: int) -> Dict:
        out = {"anchor/fire": int(is_fire_step(t, self.a.anchor_interval) and self.alive),
               "anchor/bytes_in": self.bytes_in, "anchor/bytes_out": self.bytes_out,
               "anchor/bytes_ship": self.ship_bytes, "anchor/bytes_ship_fp32": self.ship_dense_bytes,
               "anchor/alive": int(self.alive)}
        if self.a.anchor_ship_check:
            out["anchor/bytes_ship_check"] = self.ship_check_bytes
        out["anchor/ship_resyncs"], self.ship_resyncs = self.ship_resyncs, 0
        self.bytes_in = self.bytes_out = self.ship_bytes = self.ship_dense_bytes = self.ship_check_bytes = 0
        return out
