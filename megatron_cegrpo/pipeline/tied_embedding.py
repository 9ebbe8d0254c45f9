"""The tied embedding / output weight W [V, d] between the first and the last pipeline stage.

Issue 12, item 2. With tied embeddings and PP > 1 the first stage (input embedding) and the
last stage (output layer) each hold W. Two exchanges keep them one weight
(``--tied-embedding-sync``):

``allreduce`` (megatron's way, :func:`megatron_cegrpo.models.allreduce_tied_embedding_grads`):
    both stages all-reduce W's full gradient every optimizer step (dense, 2 x V x d x 4 bytes
    for a 2-rank ring) and both step their copy.

``sparse`` (the default): the last stage owns W and its optimizer state; the first stage's W is
    a row cache. The input-embedding gradient is non-zero only on rows of tokens in the batch,
    and the first stage only reads rows of tokens it embeds, so

    * before the first stage embeds a batch with a W it has not fetched since the last optimizer
      step, the last stage sends the current rows ``W[ids]`` (``ids = unique(tokens)``);
    * after the backward pass the first stage sends its gradient rows ``G_first[ids]`` and the
      last stage adds them: ``G = G_last + scatter(ids, G_first[ids])``, elementwise the same
      ``G_last + G_first`` the 2-rank all-reduce computes (IEEE addition is commutative, every
      element takes exactly one addition, and the rows outside ``ids`` add an exact +0 as the
      all-reduce does), so the sum is bit-identical;
    * the first stage takes no step on W (its gradient is dropped after the send: no Adam, no
      weight decay); the grad-norm term of W (``||G||^2`` after the corrections, fp64) and the
      weight-change terms of ``actor/weight_rel_change`` come from the last stage (8 and 16
      bytes), summed at the first stage's place for W, so the norm and the metric are the
      all-reduce run's to the bit;
    * whatever reads the first stage's full W takes the last stage's copy instead: the sampler
      (:meth:`TiedEmbeddingSync.patch_gathered`), the anchor's shipments and signs (the first
      stage leaves W out, :meth:`TiedEmbeddingSync.owns`), and checkpoints (the last stage
      sends the whole W before a save, :meth:`TiedEmbeddingSync.full_sync`: the only dense
      copy left, metered).

    ``ids`` never cross the wire: both ends compute them from the rollout batch every stage
    already holds (the driver's broadcast). The row messages are sized by ``len(ids)`` on
    both sides, so ends that disagree fail in the receive instead of mixing rows.

Tensor parallelism (``--tensor-model-parallel-size`` T > 1): W is vocabulary-parallel on both
stages (``VocabParallelEmbedding`` / the ``ColumnParallelLinear`` output layer): TP rank t holds
rows ``t V/T .. (t+1) V/T`` of W on the first and on the last stage, and megatron's embedding group
joins the two TP-rank-t copies. Each TP rank runs the exchange above on its own rows: ``ids`` are
the batch's tokens inside its vocabulary slice, shifted to local rows (:meth:`TiedEmbeddingSync._ids`),
so the TP ranks' row messages together are the TP = 1 rows, each sent once, and the norm and
weight terms are its shard's (summed over the TP ranks with the other TP-split parameters).

Metering (bytes this rank sent, summed over the stages by the metrics reducer):
``comm/embd_sync_bytes`` (everything sent for W: rows both ways, the 8- and 16-byte terms,
full syncs), ``comm/embd_sync_dense_bytes`` (what the dense all-reduce sends in the same
steps: V x d x 4 bytes per member rank per optimizer step, the ``allreduce`` meter) and
``comm/embd_full_sync_bytes`` (the part of ``comm/embd_sync_bytes`` that was a whole-W copy).

Exactness assumes both ends run the same torch build and intra-op thread count (the fp64
norm term is a reduction over W; every rank of a launch gets the same ``--num-threads``).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_cegrpo.arguments import TIED_EMBEDDING_SYNC_MODES as SYNC_MODES
from megatron_cegrpo.models import allreduce_tied_embedding_grads

__all__ = ["SYNC_MODES", "TiedEmbeddingSync"]

_OUTPUT_NAME = "output_layer.weight"  # the last stage's copy of W in megatron's GPTModel
_F64 = torch.float64


class TiedEmbeddingSync:
    """One trainer rank's part of the tied-weight exchange (see the module doc).

    Args:
        model: this rank's GPTModel stage.
        ctx: the DistContext (pipeline rank and size, ``embd_group`` = {first, last}).
        mode: ``"sparse"`` or ``"allreduce"`` (``--tied-embedding-sync``).
    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, model, ctx, mode: str = "sparse"):
        if mode not in SYNC_MODES:
            raise ValueError(f"tied embedding sync mode must be one of {SYNC_MODES}, got {mode!r}")
        self.mode, self.model, self.group = mode, model, ctx.embd_group
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        tied = ctx.pp_size > 1 and bool(getattr(model, "share_embeddings_and_output_weights", False))
        self.role = None if not tied else "first" if ctx.is_first_stage else "last" if ctx.is_last_stage else None
        self.weight: Optional[torch.nn.Parameter] = model.shared_embedding_or_output_weight() if self.role else None
        if self.role is not None:
            other = ctx.pp_size - 1 if self.role == "first" else 0
            self.peer = dist.get_global_rank(ctx.pp_group, other)
            self.name = next(n for n, p in model.named_parameters() if p is self.weight)
            self.weight_bytes = self.weight.numel() * self.weight.element_size()
        self._fresh: Optional[torch.Tensor] = None  # ids whose rows are current on the first stage
        self.sent_bytes = self.dense_bytes = self.full_sync_bytes = 0

    # ------------------------------------------------------------------ structure
    @property
    def sparse(self) -> bool:
        """True on the first and last stage of a tied model with PP > 1 in ``sparse`` mode."""
        return self.mode == "sparse" and self.role is not None

    def owns(self, p: torch.nn.Parameter) -> bool:
        """False only for the first stage's W in ``sparse`` mode (a row cache: not stepped,
        not shipped to the anchor, not counted in the stage's norms and metrics)."""
        return not (self.sparse and self.role == "first" and p is self.weight)

    # ------------------------------------------------------------------ p2p
    def _send(self, t: torch.Tensor) -> None:
        if t.numel() == 0:  # both ends size their messages alike (e.g. no token in a TP rank's slice)
            return
        t = t.contiguous()
        dist.send(t, dst=self.peer, group=self.group)
        self.sent_bytes += t.numel() * t.element_size()

    def _recv(self, shape, dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        if buf.numel():
            dist.recv(buf, src=self.peer, group=self.group)
        return buf

    # ------------------------------------------------------------------ rows
    def _ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's W that ``tokens`` use: ``unique(tokens)`` (int64, sorted); at
        TP > 1 those inside this TP rank's vocabulary slice, as local row indices."""
        ids = torch.unique(tokens)
        if self.tp_size == 1:
            return ids
        rows = self.weight.shape[0]
        lo = self.tp_rank * rows
        return ids[(ids >= lo) & (ids < lo + rows)] - lo

    @torch.no_grad()
    def refresh_rows(self, tokens: torch.Tensor) -> None:
        """Before the policy's forward on ``tokens`` [N, S] int64: the first stage's rows
        ``W[unique(tokens)]`` become the last stage's (fp32, ``len(ids) x d x 4`` bytes, last ->
        first). Skipped when those rows were fetched since the last optimizer step. Call on the
        first and the last stage with the same ``tokens`` (a no-op elsewhere)."""
        if not self.sparse:
            return
        ids = self._ids(tokens)
        if self._fresh is not None and bool(torch.isin(ids, self._fresh).all()):
            return
        w = self.weight
        if self.role == "last":
            self._send(w.detach().index_select(0, ids))
        else:
            w.data.index_copy_(0, ids, self._recv((ids.numel(), w.shape[1]), w.dtype))
        self._fresh = ids

    @torch.no_grad()
    def reduce_grads(self, tokens: torch.Tensor) -> None:
        """After the backward pass over ``tokens`` [N, S] (one optimizer step's sequences):
        the summed gradient lands on the last stage (``sparse``; the first stage's W.grad is
        dropped) or on both (``allreduce``). Meters ``comm/embd_sync_dense_bytes`` either way.

        Raises:
            RuntimeError: (sparse) the first stage's W has gradient outside ``unique(tokens)``
                (the rows it sends would not be its whole gradient).
        """
        if self.role is None:
            return
        self.dense_bytes += self.weight_bytes
        if not self.sparse:
            allreduce_tied_embedding_grads(self.model, self.group)
            self.sent_bytes += self.weight_bytes
            return
        w, ids = self.weight, self._ids(tokens)
        if self.role == "first":
            g = w.grad if w.grad is not None else torch.zeros_like(w)
            rows = g.index_select(0, ids)
            if int(torch.count_nonzero(g).item()) != int(torch.count_nonzero(rows).item()):
                raise RuntimeError("the first stage's embedding gradient has rows outside the batch's tokens")
            self._send(rows)
            w.grad = None
        else:
            rows = self._recv((ids.numel(), w.shape[1]), w.dtype)
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            first = torch.zeros_like(w.grad)  # the first stage's dense gradient, as the all-reduce has it
            first.index_copy_(0, ids, rows.to(w.grad.dtype))
            w.grad.add_(first)

    def after_step(self) -> None:
        """Call after every optimizer step on every stage: the last stage's W has changed."""
        self._fresh = None

    # ------------------------------------------------------------------ terms kept exact
    @torch.no_grad()
    def norm_terms(self) -> Dict[int, torch.Tensor]:
        """Inside the clip hook, before the global norm: ``{id(W): ||G_W||^2}`` (fp64 0-dim) on
        the first stage, received from the last stage, which computes it from its summed,
        corrected gradient exactly as the first stage does in ``allreduce`` mode (8 bytes);
        ``{}`` elsewhere (the last stage's W is the duplicate the norm leaves out)."""
        if not self.sparse:
            return {}
        if self.role == "last":
            g = self.weight.grad
            self._send((g.detach().double().square().sum() if g is not None else torch.zeros((), dtype=_F64))
                       .reshape(1))
            return {}
        return {id(self.weight): self._recv((1,), _F64)[0]}

    def weight_terms(self, params: Sequence[torch.nn.Parameter], theta0: Sequence[torch.Tensor],
                     term: Callable[[torch.Tensor, torch.Tensor], Tuple[float, float]]) -> Dict[int, Tuple[float, float]]:
        """``actor/weight_rel_change``'s fp64 terms ``(||W - W_0||^2, ||W_0||^2)`` of W, computed
        by ``term(p, p0)`` on the last stage and sent to the first (16 bytes): ``{id(W): terms}``
        on both of them (``sparse``), ``{}`` otherwise."""
        if not self.sparse:
            return {}
        w = self.weight
        if self.role == "last":
            d, b = term(w, next(p0 for p, p0 in zip(params, theta0) if p is w))
            self._send(torch.tensor([d, b], dtype=_F64))
            return {id(w): (d, b)}
        d, b = self._recv((2,), _F64).tolist()
        return {id(w): (d, b)}

    # ------------------------------------------------------------------ whole copies
    @torch.no_grad()
    def full_sync(self) -> None:
        """The last stage sends the whole W to the first (before a checkpoint is written, so
        that the first stage's file holds the true W): V x d x 4 bytes, metered in
        ``comm/embd_sync_bytes`` and ``comm/embd_full_sync_bytes``. A no-op unless ``sparse``."""
        if not self.sparse:
            return
        before = self.sent_bytes
        if self.role == "last":
            self._send(self.weight.detach())
        else:
            self.weight.data.copy_(self._recv(tuple(self.weight.shape), self.weight.dtype))
        self.full_sync_bytes += self.sent_bytes - before

    def patch_gathered(self, stage_sds: Optional[List[Dict[str, torch.Tensor]]]) -> None:
        """On the driver (the first stage), after the weight gather: the first stage's W entry
        becomes the last stage's copy (``output_layer.weight``), which the gather carries anyway,
        so the sampler, and whatever converts these dicts, get the true W. Free: no bytes."""
        if stage_sds is not None and self.sparse and self.role == "first":
            stage_sds[0][self.name] = stage_sds[-1][_OUTPUT_NAME]

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> Dict[str, int]:
        """This rank's bytes since the last call (reset on read)."""
        out = {"comm/embd_sync_bytes": self.sent_bytes, "comm/embd_sync_dense_bytes": self.dense_bytes,
               "comm/embd_full_sync_bytes": self.full_sync_bytes}
        self.sent_bytes = self.dense_bytes = self.full_sync_bytes = 0
        return out
