"""bench_link's transfers outside the pipeline boundaries: the whole step (issue 12 item 5).

Three variants of one GRPO step (``--codecs`` of bench_link):

=========  ==========  =============================  ==============================  ==========================
variant    boundaries  tied embedding                 sampler weight sync             anchor shipments
=========  ==========  =============================  ==============================  ==========================
dense      dense       dense fp32 all-reduce          fp32 copy of stages 1..          fp32 every c steps
mask       mask        dense fp32 all-reduce          fp32 copy of stages 1..          fp32 every c steps
after      mask        rows of the batch's tokens     bf16 deltas, modelled            bf16 deltas every c steps
=========  ==========  =============================  ==============================  ==========================

``mask`` is today's trainer; ``dense`` is dense-everything; ``after`` is this issue's state.
What runs for real, through the same link (loopback, veth + tbf) and metered from the payloads:
the rollout batch broadcast (``pipeline/broadcast.py``), the all-reduce, the fp32 weight
gather (``StageWeightGatherer``, the trainer's own), and the embedding rows: the first stage
sends its gradient rows ``G[ids]`` to the last stage, which adds them, and the last stage
sends the current rows ``W[ids]`` back (``ids = unique(tokens)``, known to both ends: the
exchange of the sparse embedding sync, issue 12 item 2, whose code lives on its own branch).

Modelled, and said so in the report: the sampler's bf16 delta sync sends a buffer of
``--sync-fraction`` x a dense bf16 copy of each non-driver stage (default 0.022: 2.2 % of a
dense bf16 copy, the sampler-sync branch's measured first-step size on SmolLM2-135M at lr
2e-6), and the anchor shipments, which have no anchor rank here: their bytes are the real
``ShipmentEncoder`` payload sizes (fp32, or the bf16 delta after the keyframe) plus the 1-bit
signs, every ``--anchor-interval`` steps, amortised per step and billed on rank 0 as the
anchor host's link occupancy (8 B / bandwidth; the shipments are non-blocking ``isend``).

Link billing in ``sim`` (nothing here passes the boundary link model): each one-way
transfer costs latency + 8 B / bandwidth on the receiving side; ``tbf`` throttles the real
transfers and adds the latency the kernel lacks (no netem); ``off`` bills nothing.
"""

from __future__ import annotations

import math
import time
from typing import Dict

import torch
import torch.distributed as dist

from megatron_cegrpo.anchor.shipment import ShipmentEncoder
from megatron_cegrpo.models import allreduce_tied_embedding_grads
from megatron_cegrpo.pipeline.broadcast import broadcast_metered
from megatron_cegrpo.pipeline.weight_sync import StageWeightGatherer, flatten_params

__all__ = ["VARIANTS", "WholeStep"]

#: variant -> (boundary codec, embedding exchange, sampler sync, anchor shipment mode)
VARIANTS = {"dense": ("dense", "allreduce", "fp32", "fp32"),
            "mask": ("mask", "allreduce", "fp32", "fp32"),
            "after": ("mask", "rows", "delta", "bf16-delta")}


class WholeStep:
    """The transfers of one step outside the boundaries, for one rank.

    Args:
        model: this rank's stage; ctx: the DistContext; link: the LinkModel (for its mode,
        bandwidth and latency); sync_fraction, anchor_interval: see the module docstring.
    """

    def __init__(self, model, ctx, link, sync_fraction: float, anchor_interval: int):
        self.model, self.ctx, self.link = model, ctx, link
        self.sync_fraction, self.c = sync_fraction, anchor_interval
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False)) and ctx.pp_size > 1
        self.embd = model.shared_embedding_or_output_weight() if tied and (model.pre_process or model.post_process) \
            else None
        self.gatherer = StageWeightGatherer(model, ctx.pp_group)
        numel = sum(p.numel() for p in model.parameters())
        self.numels = [None] * ctx.pp_size
        dist.all_gather_object(self.numels, numel, group=ctx.pp_group)
        # the anchor's steady-state payload of every stage (after the keyframe), from the real encoder
        flat = flatten_params(list(model.parameters()))
        per_mode = {}
        for mode in ("fp32", "bf16-delta"):
            enc = ShipmentEncoder(mode)
            enc.encode(flat)
            p = enc.encode(flat)
            per_mode[mode] = p.numel() * p.element_size()
        gathered = [None] * ctx.pp_size
        dist.all_gather_object(gathered, per_mode, group=ctx.pp_group)
        signs = sum(math.ceil(n / 8) for n in self.numels)
        self.anchor_bytes = {m: (sum(g[m] for g in gathered) + signs) / self.c for m in per_mode}

    # ------------------------------------------------------------------ link billing
    def _bill(self, nbytes: float, transfers: int = 1) -> None:
        """Receive-side cost of ``transfers`` one-way transfers carrying ``nbytes`` in all."""
        lk = self.link
        if lk.mode == "sim":
            lk.wait_until(time.monotonic() + transfers * lk.latency_s + 8 * nbytes / lk.bandwidth_bps)
        elif lk.mode == "latency":
            lk.wait_until(time.monotonic() + transfers * lk.latency_s)

    # ------------------------------------------------------------------ the transfers
    def batch(self, batch: Dict) -> int:
        """The driver's rollout batch to every stage (real, metered); returns its bytes."""
        _, n = broadcast_metered(batch if self.ctx.pp_rank == 0 else None, self.ctx.pp_group)
        if self.ctx.pp_rank != 0:
            self._bill(n / max(self.ctx.pp_size - 1, 1))
        return n

    def embedding(self, variant: str, tokens: torch.Tensor) -> int:
        """The tied embedding's exchange after the backward pass; returns the bytes sent by all ranks."""
        if self.embd is None:
            return 0
        nbytes = self.embd.numel() * self.embd.element_size()
        if VARIANTS[variant][1] == "allreduce":
            allreduce_tied_embedding_grads(self.model, self.ctx.embd_group)
            self.link.wait_until(time.monotonic() + self.link.collective_delay(nbytes))
            return 2 * nbytes
        ids = torch.unique(tokens)
        first, last = 0, self.ctx.pp_size - 1
        rows = torch.empty(ids.numel(), self.embd.shape[1], dtype=self.embd.dtype)
        if self.ctx.pp_rank == first:
            dist.send(self._grad()[ids].contiguous(), dst=dist.get_global_rank(self.ctx.pp_group, last),
                      group=self.ctx.pp_group)
            dist.recv(rows, src=dist.get_global_rank(self.ctx.pp_group, last), group=self.ctx.pp_group)
            with torch.no_grad():
                self.embd.index_copy_(0, ids, rows)
            self._bill(rows.numel() * rows.element_size())  # W[ids] arrives here
        else:
            dist.recv(rows, src=dist.get_global_rank(self.ctx.pp_group, first), group=self.ctx.pp_group)
            self._bill(rows.numel() * rows.element_size())  # G[ids] arrives here
            grad = self._grad()
            grad.index_add_(0, ids, rows.to(grad.dtype))
            dist.send(self.embd.detach()[ids].contiguous(), dst=dist.get_global_rank(self.ctx.pp_group, first),
                      group=self.ctx.pp_group)
        return 2 * rows.numel() * rows.element_size()

    def _grad(self) -> torch.Tensor:
        g = getattr(self.embd, "main_grad", None)
        if g is None:
            if self.embd.grad is None:
                self.embd.grad = torch.zeros_like(self.embd)
            g = self.embd.grad
        return g

    def sampler_sync(self, variant: str) -> int:
        """Stage weights to the driver (rank 0); returns the bytes received there (0 elsewhere)."""
        if VARIANTS[variant][2] == "fp32":
            self.gatherer.gather()  # the trainer's own gather
            n = self.gatherer.last_bytes if self.ctx.pp_rank == 0 else 0
        else:
            sizes = [math.ceil(self.sync_fraction * 2 * k) for k in self.numels]
            if self.ctx.pp_rank == 0:
                for r in range(1, self.ctx.pp_size):
                    dist.recv(torch.empty(sizes[r], dtype=torch.uint8),
                              src=dist.get_global_rank(self.ctx.pp_group, r), group=self.ctx.pp_group)
                n = sum(sizes[1:])
            else:
                dist.send(torch.zeros(sizes[self.ctx.pp_rank], dtype=torch.uint8),
                          dst=dist.get_global_rank(self.ctx.pp_group, 0), group=self.ctx.pp_group)
                n = 0
        if self.ctx.pp_rank == 0 and self.ctx.pp_size > 1:
            self._bill(n)  # everything comes in through the driver host's link
        return n

    def anchor(self, variant: str) -> float:
        """The anchor's shipments and signs per step (modelled, see the module docstring); rank 0
        waits the anchor host's link time for them. Returns the bytes per step."""
        n = self.anchor_bytes[VARIANTS[variant][3]]
        if self.ctx.pp_rank == 0 and self.link.mode in ("sim", "latency"):
            self.link.wait_until(time.monotonic() + 8 * n / self.link.bandwidth_bps)
        return n
