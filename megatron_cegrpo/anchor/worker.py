"""The anchor rank: dense replay at stale or forecast weights, M <- a M + (1 - a) G_anc, sign(M) out.

Status 2026-07-31 section 1.3 and appendix A; DESIGN.md section 4; the 2026-07-04 report
sections 3 and 10. The anchor holds the whole model densely (megatron-core GPTModel with
PP=1, parameter names equal to the stages' up to the layer offset), a frozen reference,
M in fp32 for every parameter and a ring of stale checkpoints. It takes no optimizer
step, generates no rollouts and computes no rewards (it holds no optimizer, sampler or
verifier); its only output is sign(M), one bit per parameter.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.basis import AnchorBasis
from megatron_cegrpo.anchor.forecast import forecast_error, get_forecast
from megatron_cegrpo.anchor.memory import AnchorMemory
from megatron_cegrpo.anchor.replay import SHARED_PREFIX_KEYS, replay_backward
from megatron_cegrpo.anchor.ring import CheckpointRing
from megatron_cegrpo.anchor.shipment import HEADER_LEN, ShipmentDecoder, ShipmentRejected
from megatron_cegrpo.anchor.signs import pack_bits
from megatron_cegrpo.anchor.transport import (
    META_TAG, TAG_BASIS, TAG_BATCH, TAG_MIRROR_ACK, TAG_PARAMS, TAG_PARAMS_EXACT, TAG_PARAMS_HDR, TAG_SIGN_HDR,
    TAG_SIGN_INFO, TAG_SIGNS, TAG_STATS,
    is_fire_step, is_ship_step, isend_object, recv_object, recv_tensor, unflatten,
)
from megatron_cegrpo.optim.mixed_precision import compute_precision

__all__ = ["AnchorWorker", "global_param_name", "ring_capacity", "stage_flat", "put_flat", "sign_agreement_with",
           "receive_shipment"]

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def global_param_name(stage_name: str, layer_offset: int, tied_output: bool) -> str:
    """A stage's parameter name as the PP=1 model names it (layer index + offset; the last
    stage's copy of a tied output weight is the embedding)."""
    if tied_output and stage_name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", stage_name)


def stage_flat(meta: dict, theta: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """A stage's flat fp32 parameters [numel], in its order (``meta["params"]``), from global-named
    ``theta``; None when a name is missing or a shape differs."""
    parts = []
    for name, shape in meta["params"]:
        t = theta.get(global_param_name(name, meta["layer_offset"], meta["tied_output"]))
        if t is None or tuple(t.shape) != tuple(shape):
            return None
        parts.append(t.detach().reshape(-1).float())
    return torch.cat(parts) if parts else None


def put_flat(theta: Dict[str, torch.Tensor], meta: dict, flat: torch.Tensor) -> None:
    """A stage's flat buffer into ``theta`` by global name (the tied copy equals the embedding)."""
    for (name, shape), tensor in zip(meta["params"], unflatten(flat, [s for _, s in meta["params"]])):
        theta.setdefault(global_param_name(name, meta["layer_offset"], meta["tied_output"]), tensor.clone())


def sign_agreement_with(memory: AnchorMemory, grads: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor]) -> float:
    """The fraction of parameters where sign(M), just updated with ``grads``, equals the sign M would
    have had from ``other`` instead: ``M' = M + (1 - a)(other - grads)``, ``a`` the EMA decay
    (``M <- a M + (1 - a) G``, ``anchor/memory.py``). NaN for an empty memory."""
    w = 1.0 - memory.decay
    agree = total = 0
    for n in memory.names:
        m = memory.tensor(n)
        agree += int((torch.sign(m) == torch.sign(m + w * (other[n] - grads[n]))).sum())
        total += m.numel()
    return agree / total if total else float("nan")


def receive_shipment(decoder: ShipmentDecoder, src: int, group, what: str) -> Tuple[Optional[torch.Tensor], int]:
    """One stage's checked shipment from global rank ``src`` (``anchor/shipment.py``): (theta_hat(s),
    fp32 [numel], the decoder's storage, or None when refused: logged, and the decoder wants a
    keyframe, which the next fire asks for; the bytes received)."""
    if decoder.skip_next:  # theta(0) of a new run: both ends hold it, nothing was sent
        return decoder.skip(), 0
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    recv_tensor(header, src, TAG_PARAMS_HDR, group)
    payload = torch.empty(decoder.payload_nbytes(header), dtype=torch.uint8)
    recv_tensor(payload, src, TAG_PARAMS, group)
    n = header.numel() * 8 + payload.numel()
    try:
        return decoder.accept(header, payload), n
    except ShipmentRejected as e:
        print(f"[cegrpo] warning: anchor: {what} refused ({e}); it is not kept and the stage is asked for a "
              "full fp32 keyframe at the next fire", flush=True)
        return None, n


class AnchorWorker:
    """Runs on the anchor rank until the trainer's last iteration.

    Args:
        cfg: the TrainConfig (anchor, GRPO, batch settings).
        model, ref_model: PP=1 GPTModels (policy replica; frozen reference, None without a KL term).
        stage_ranks: global ranks of the pipeline stages, stage order.
        start_iteration: the iteration the trainer resumes from (0 for a new run).
        group: the anchor group (``DistContext.anchor_group``).
        codec: the run's boundary codec (``plan.RunPlan.codec``); read only for an anchor-owned
            lowrank basis (its rank).
    """

    def __init__(self, cfg, model, ref_model, stage_ranks: List[int], start_iteration: int = 0, group=None,
                 codec=None):
        self.cfg, self.a = cfg, cfg.anchor
        self.codec = codec  # the run plan's boundary codec (plan.py): the stages' lowrank rank
        self.model, self.ref_model = model, ref_model
        self.stage_ranks = stage_ranks
        self.start = start_iteration
        self.group = group
        self.params = dict(model.named_parameters())
        self.ring = CheckpointRing(capacity=ring_capacity(self.a), delay=self.a.anchor_delay)
        # --anchor-ship-check: the exact weights beside the shipped ones (debug, not checkpointed)
        self.exact_ring = (CheckpointRing(capacity=ring_capacity(self.a), delay=self.a.anchor_delay)
                           if self.a.anchor_ship_check else None)
        self.memory = AnchorMemory([(n, p.shape) for n, p in self.params.items()], decay=self.a.anchor_ema_decay)
        opts = ({"n_points": self.a.anchor_forecast_points} if self.a.anchor_forecast == "lsq"
                else {"damping": self.a.anchor_forecast_damping})
        name = "matching" if self.a.anchor_replay == "matching" else self.a.anchor_forecast
        self.forecast = get_forecast(name, **opts)
        self.batches: Dict[int, dict] = {}  # iteration -> replayable batch
        self.bytes_in = self.bytes_out = 0
        self.num_replayed_sequences = 0  # sequences through the dense forward + backward, this run
        self.last_stats: Optional[dict] = None  # the newest fire's statistics (sent again after a resume)
        self.forecast_errors: Dict[int, float] = {}  # fire step -> anchor/forecast_error, until reported
        self.dump_dir = self.a.anchor_debug_dir
        self._pending: List[list] = []  # isends in flight (the trainer may take its sign later)
        # names/shapes of every stage, in each stage's parameter order (sent once by the stages)
        self.stage_meta = []
        for r in stage_ranks:
            meta, n = recv_object(r, META_TAG, group)
            self.bytes_in += n
            self.stage_meta.append(meta)
        # one decoder per stage: deltas against a mirror, seeded at start-up when the digests agree
        # (_agree_on_mirrors) or by an fp32 keyframe (anchor/shipment.py)
        self.decoders = [ShipmentDecoder(self.a.anchor_ship, sum(int(torch.Size(s).numel()) for _, s in m["params"]))
                         for m in self.stage_meta]
        self.basis = self._build_basis()

    def _build_basis(self) -> Optional[AnchorBasis]:
        """The boundary bases the anchor owns (``--boundary-codec lowrank --lowrank-q-owner anchor``)."""
        c = self.cfg.codec
        if c.boundary_codec != "lowrank" or c.lowrank_q_owner != "anchor":
            return None
        d = int(self.model.config.hidden_size)
        r = self.codec.fwd.rank(d)  # the stages' lowrank codec, as the run plan built it
        last_layers = [meta["layer_offset"] - 1 for meta in self.stage_meta[1:]]
        return AnchorBasis(self.model.decoder.layers, last_layers, self.cfg.optim.seed, d, r,
                           self.model.config.pipeline_dtype)  # the stages' dtype: bf16 under --bf16, not fp32

    # ------------------------------------------------------------------ loop
    def run(self, on_iteration_end=None) -> None:
        """Follow the trainer's schedule to the last iteration; ``on_iteration_end(t)`` runs
        after each iteration's messages (the runner saves checkpoints there)."""
        c = self.a.anchor_interval
        self._agree_on_mirrors()
        # a checkpoint saved between a fire and the step that takes its signs (--anchor-apply
        # next-step): the resumed stages wait for those signs, which M (restored) still gives
        awaiting = [i for i, meta in enumerate(self.stage_meta) if meta.get("awaiting") is not None]
        if awaiting:
            self._send_signs(self.last_stats or {"anchor/fire": 1}, awaiting)
        for t in range(self.start + 1, self.cfg.optim.train_iters + 1):
            if is_ship_step(t, c):
                self._receive_checkpoint(t - 1)
                self._receive_batch(t)
            if is_fire_step(t, c):
                if t not in self.batches:
                    self._receive_batch(t)
                self._fire(t)
            for k in [k for k in self.batches if k < t - self.a.anchor_delay - 2 * c]:
                del self.batches[k]
            if on_iteration_end is not None:
                on_iteration_end(t)
        self.wait_sends()

    def _agree_on_mirrors(self) -> None:
        """Answer each stage's start-up mirror digest (``anchor/shipment.py``): compared with the
        anchor's own copy of the stage (its model as loaded on a new run, the newest checkpoint of
        its restored ring after a resume); 1 byte back, agreed or not."""
        newest = self.ring.newest() if self.start > 0 else None
        own = newest[1] if newest is not None else (self.params if self.start == 0 else {})
        for r, meta, decoder in zip(self.stage_ranks, self.stage_meta, self.decoders):
            decoder.seq = int(meta.get("ship_seq", 0))
            digest = meta.get("mirror_digest")
            if digest is None:
                continue
            ok = decoder.agree(digest, stage_flat(meta, own), new_run=self.start == 0, seq=decoder.seq)
            dist.send(torch.tensor([int(ok)], dtype=torch.uint8), dst=r, tag=TAG_MIRROR_ACK, group=self.group)
            self.bytes_out += 1

    def wait_sends(self) -> None:
        for keep in self._pending:
            for w in keep[0]:
                w.wait()
        self._pending = []

    def _receive_checkpoint(self, s: int) -> None:
        theta: Dict[str, torch.Tensor] = {}
        exact: Dict[str, torch.Tensor] = {}
        lost = False
        for i, (r, meta, decoder) in enumerate(zip(self.stage_ranks, self.stage_meta, self.decoders)):
            flat, n = receive_shipment(decoder, r, self.group, f"stage {i}'s shipment of theta({s})")
            self.bytes_in += n
            lost = lost or flat is None
            if flat is not None:
                put_flat(theta, meta, flat)
            if self.exact_ring is not None:
                true = torch.empty(decoder.numel, dtype=torch.float32)
                recv_tensor(true, r, TAG_PARAMS_EXACT, self.group)
                put_flat(exact, meta, true)
        if lost:  # a refused shipment: theta(s) is not kept; the fires replay older checkpoints
            return
        missing = set(self.params) - set(theta)
        assert not missing, f"checkpoint lacks {sorted(missing)[:4]}"
        self._score_forecast(s, theta)
        self.ring.put(s, theta)
        if self.exact_ring is not None:
            self.exact_ring.put(s, exact)

    def _score_forecast(self, s: int, theta: Dict[str, torch.Tensor]) -> None:
        """``anchor/forecast_error`` of the fire at ``s`` (``anchor/forecast.py:forecast_error``), now
        that its true weights theta(s) have arrived: the fire's forecast is computed again (the ring
        holds what it held at that fire: nothing is put between a fire and the next shipment, and a
        resumed anchor restores the ring), and the ratio waits in ``forecast_errors`` for the fire
        at s + K, the first whose no-peek horizon covers theta(s). Only forecasts proper are scored
        (the fallback and matching replays are theta(s1) itself: 1.0 by definition)."""
        c, K = self.a.anchor_interval, self.a.anchor_delay
        if s < c or not is_fire_step(s, c) or self.a.anchor_replay != "forecast":
            return
        res = self.forecast(self.ring, s, K, c)
        if res is None or res.branch != "forecast":
            return
        err = forecast_error(res.weights, self.ring.read(max(res.source_steps), s), theta)
        if err is not None:
            self.forecast_errors[s] = err

    def _receive_batch(self, t: int) -> None:
        batch, n = recv_object(self.stage_ranks[0], TAG_BATCH, self.group)
        self.bytes_in += n
        self.batches[t] = batch

    # ------------------------------------------------------------------ fire
    def _fire(self, t: int) -> None:
        t0 = time.perf_counter()
        K, c = self.a.anchor_delay, self.a.anchor_interval
        res = self.forecast(self.ring, t, K, c)
        stats = {"anchor/fire": 1, "anchor/branch": "skipped", "anchor/staleness": None}
        grads = None
        if res is not None:
            # forecast replays the newest batch (t); matching replays the batch theta(s1) generated (s1 + 1)
            batch_t = t if res.branch == "forecast" else res.batch_step + 1
            batch = self.batches[batch_t]
            with self.basis.capture() if self.basis is not None else contextlib.nullcontext():
                grads = self._dense_gradient(res.weights, batch)
            self.memory.update(grads)
            if self.exact_ring is not None:
                stats["anchor/ship_sign_agreement"] = self._ship_sign_agreement(t, batch, grads, res)
            if self.basis is not None:
                self.basis.refresh()
            stats.update({"anchor/branch": res.branch, "anchor/staleness": t - max(res.source_steps),
                          "anchor/source_steps": list(res.source_steps), "anchor/replay_batch": batch_t})
            if self.dump_dir:
                torch.save({"t": t, "weights": res.weights, "batch": batch, "grads": grads,
                            "signs": self.memory.signs(), "branch": res.branch},
                           os.path.join(self.dump_dir, f"anchor_fire_{t:05d}.pt"))
        scored = sorted(s for s in self.forecast_errors if s <= t - K)
        if scored:  # the newest forecast whose true weights the anchor may read now (s = t - K on schedule)
            stats.update({"anchor/forecast_error": self.forecast_errors[scored[-1]],
                          "anchor/forecast_error_step": scored[-1]})
            for s in scored:
                del self.forecast_errors[s]
        has = self.memory.is_set
        stats.update({
            "anchor/m_norm": self.memory.norm() if has else 0.0,
            "anchor/m_zero_frac": self.memory.zero_fraction(),
            "anchor/no_peek_violations": self.ring.num_no_peek_violations,
            "timing_s/anchor_compute": time.perf_counter() - t0,
            "anchor/received_bytes_total": self.bytes_in,
            "anchor/ship_rejected": sum(d.num_rejected for d in self.decoders),
            "anchor/num_replayed_sequences": self.num_replayed_sequences,
        })
        self.last_stats = stats
        self._send_signs(stats, range(len(self.stage_ranks)))

    def _ship_sign_agreement(self, t: int, batch: dict, grads: Dict[str, torch.Tensor], shipped) -> float:
        """``--anchor-ship-check``: the fraction of parameters where sign(M), just updated from the
        shipped weights' gradient ``grads``, equals the sign M would have from the exact weights'
        gradient on the same batch (the same forecast over the exact ring):
        ``M_exact = M + (1 - a)(G_exact - G)``, a the EMA decay (``anchor/memory.py``). NaN when
        the exact ring cannot make the same forecast as ``shipped`` (the forecast over the shipped
        ring): the exact copies are not checkpointed, so after a resume the ring refills first."""
        res = self.forecast(self.exact_ring, t, self.a.anchor_delay, self.a.anchor_interval)
        if res is None or res.branch != shipped.branch or list(res.source_steps) != list(shipped.source_steps):
            return float("nan")
        replayed = self.num_replayed_sequences
        exact = self._dense_gradient(res.weights, batch)
        self.num_replayed_sequences = replayed  # a measurement, not part of the run's work
        return sign_agreement_with(self.memory, grads, exact)

    def _send_signs(self, stats: dict, stages) -> None:
        """sign(M) to each stage in ``stages``, the stage's boundary bases after them, ``stats`` to
        the driver. Header (int64) bits: 0 signs follow (unset while M is unset, or when M is 0 on
        every tensor of the stage); 1 an anchor-owned lowrank basis has been refreshed at a fire
        and follows; 2 a per-tensor "informative" bitmap (``anchor/signs.py`` packing, bit = 1
        where the tensor's M is non-zero) precedes the signs, sent only when some tensor's M is
        all 0 (memory.py: such a tensor gets no correction), so a stage whose M is non-zero
        everywhere gets the same bytes as before."""
        has = self.memory.is_set
        bases = self.basis is not None and self.basis.num_refreshes > 0
        self.wait_sends()
        for i in stages:
            r, meta = self.stage_ranks[i], self.stage_meta[i]
            names = [global_param_name(n, meta["layer_offset"], meta["tied_output"]) for n, _ in meta["params"]]
            info = self.memory.informative(names) if has else []
            signs, flagged = has and any(info), has and not all(info)
            resend = 8 if self.decoders[i].want_keyframe else 0  # a refused shipment: a keyframe next
            hdr = torch.tensor([(1 if signs else 0) | (2 if bases else 0) | (4 if flagged else 0) | resend],
                               dtype=torch.int64)
            self._pending.append([[torch.distributed.isend(hdr, dst=r, tag=TAG_SIGN_HDR, group=self.group)], hdr])
            self.bytes_out += 8
            if flagged:
                bitmap = pack_bits(torch.tensor(info, dtype=torch.bool))
                self._pending.append([[torch.distributed.isend(bitmap, dst=r, tag=TAG_SIGN_INFO, group=self.group)],
                                      bitmap])
                self.bytes_out += bitmap.numel()
            if signs:
                packed, _ = self.memory.packed_signs(names)
                self._pending.append([[torch.distributed.isend(packed, dst=r, tag=TAG_SIGNS, group=self.group)],
                                      packed])
                self.bytes_out += packed.numel()
            for q in self.basis.for_stage(i, len(self.stage_ranks)) if bases else []:
                self._pending.append([[torch.distributed.isend(q, dst=r, tag=TAG_BASIS, group=self.group)], q])
                self.bytes_out += q.numel() * q.element_size()
            if i == 0:
                keep, n = isend_object(stats, r, TAG_STATS, self.group)
                self._pending.append(keep)
                self.bytes_out += n

    def _dense_gradient(self, weights: Dict[str, torch.Tensor], batch: dict) -> Dict[str, torch.Tensor]:
        """G_anc: one dense forward + backward of the GRPO objective at ``weights``.

        Ratio against the anchor's own detached log-probs (so the clipped term's gradient
        is -A grad log pi), k3 KL to its frozen reference, token-mean over the batch; no
        optimizer step. Returns fp32 gradients by parameter name.
        """
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(weights[n].to(p.dtype))
        self.model.zero_grad(set_to_none=True)
        temp = float(self.cfg.rollout.temperature)
        with compute_precision(self.model, self.ref_model):  # --bf16: bf16 replay, fp32 gradients
            self._replay(batch, temp)
        self.num_replayed_sequences += int(batch["tokens"].shape[0])
        return {n: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                for n, p in self.params.items()}

    def _replay(self, batch: dict, temp: float) -> None:
        """The forward + backward of :meth:`_dense_gradient` (``anchor/replay.py``), each group's
        prompt once under ``--shared-prefix``. A batch received before a resume that switched
        ``--shared-prefix`` on (checkpointed without the lengths) replays unshared: the same
        gradient within fp32 reduction order."""
        shared = self.cfg.parallel.shared_prefix and all(k in batch for k in SHARED_PREFIX_KEYS)
        group = self.cfg.grpo.num_generations if shared else 0
        replay_backward(self.model, self.ref_model, batch, micro_batch_size=self.cfg.parallel.micro_batch_size,
                        grpo=self.cfg.grpo, temperature=temp, shared_prefix_group=group)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"ring": self.ring.state_dict(), "memory": self.memory.state_dict(),
                "batches": self.batches, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "last_stats": self.last_stats, "num_replayed_sequences": self.num_replayed_sequences,
                "forecast_errors": dict(self.forecast_errors),
                "basis": self.basis.state_dict() if self.basis is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.ring.load_state_dict(state["ring"])
        self.memory.load_state_dict(state["memory"])
        self.batches = dict(state["batches"])
        self.bytes_in, self.bytes_out = state["bytes_in"], state["bytes_out"]
        self.last_stats = state.get("last_stats")  # absent in checkpoints written before it existed
        self.num_replayed_sequences = state.get("num_replayed_sequences", 0)
        self.forecast_errors = {int(s): float(e) for s, e in state.get("forecast_errors", {}).items()}
        if self.basis is not None and state.get("basis") is not None:
            self.basis.load_state_dict(state["basis"])


def ring_capacity(a) -> int:
    """Checkpoints the anchor keeps: enough for the forecast's points when only those written at
    or before t - K are readable (``n_points + K / c``), and never fewer than the 4 (or
    lsq points + 1) of earlier versions, so that their checkpoints still load.

    Args:
        a: the AnchorConfig (``anchor_interval`` c, ``anchor_delay`` K, a positive multiple of c).
    """
    points = {"matching": 1, "secant": 2, "lsq": a.anchor_forecast_points}
    n = 1 if a.anchor_replay == "matching" else points[a.anchor_forecast]
    return max(4, a.anchor_forecast_points + 1, n + a.anchor_delay // a.anchor_interval)
