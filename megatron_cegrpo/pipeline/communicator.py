"""CompressedP2PCommunicator: megatron-core's P2PCommunicator, moving codec payloads only.

megatron-core's 1F1B schedule (``forward_backward_pipelining_without_interleaving``)
calls ``send_forward / recv_forward / send_backward / recv_backward`` and their
combined variants, all of which end in ``P2PCommunicator._communicate``. This
subclass overrides that one method: it encodes each outgoing tensor with the
boundary codec, lets the parent move the *payload* (the only thing on the
wire), and decodes what arrives. The schedule itself is untouched.

Which micro-batch a tensor belongs to is not passed to ``_communicate``; the
non-interleaved 1F1B schedule sends and receives each direction in
micro-batch order (forwards 0..M-1, backwards 0..M-1, FIFO), so one counter
per direction identifies it. ``begin_pass`` gives the communicator the
iteration ``step`` and the global sample ids of every micro-batch; the mask
context of a boundary tensor is then (seed, boundary, step, sample ids,
positions), identical at both ends and for every pass of one iteration
(old-logprob, reference, update): DESIGN.md sections 2 and 3.

Since the contexts of a pass are known before it starts, ``prefetch`` (called by the
trainer as soon as the iteration's batch is known, and by ``begin_pass`` for anything not
announced yet) hands every crossing this rank will encode or decode to a
:class:`~megatron_cegrpo.pipeline.prefetch.CodecPrefetcher`: the codec's per-crossing work
(the mask's PRF indices) runs on a background thread, off the critical path (issue 10
item 6), and ``_communicate`` only waits for it (normally already done).
A codec that shares a basis between the ends (``lowrank`` with a fast-owned basis) hands the
communicator a tensor after encoding a payload (``basis_to_send``); it goes to the next rank
before the payload (tag ``BASIS_TAG``, metered by ``ByteMeter.add_basis``), and the receiver
installs it before decoding (``basis_to_receive`` / ``accept_basis``).

Boundary ``i`` is the link between pipeline rank ``i`` and ``i + 1``; forward
payloads are metered on the sender (rank i), backward payloads on the sender
of the gradient (rank i + 1).

Tensor parallelism (``tp_group`` of size T > 1, docs/parallelism.md): with sequence parallelism
off every TP rank of a stage holds the same full boundary tensor and encodes the same payload
(the masks are keyed by boundary, step and sample ids, never by the TP rank). Each TP rank puts
only its 1/T of the flattened payload on the wire, to the same TP rank of the next (previous)
stage (megatron's pipeline group joins equal TP ranks), zero-padded to a multiple of T; the
receiving TP ranks all-gather the pieces inside their stage (megatron-core's
``split_tensor_into_1d_equal_chunks`` / ``gather_split_1d_tensor``, the scatter-gather of
Megatron-LM's pipeline) and decode the whole payload. A boundary thus carries the TP = 1 bytes
(plus at most T - 1 padding elements per message), and each TP rank's meter counts its piece
against ``ceil(numel / T)`` dense elements. A codec's separate basis message (``lowrank``,
fast-owned) is split the same way: each TP rank sends 1/T of the basis, the receivers all-gather
it, so the basis too crosses once in total. This needs every TP rank to encode bit-identical
payloads and bases from its identical tensor (``BoundaryCodec.tp_splittable``; the start-up check
refuses the codecs where that does not hold).
"""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor

from megatron_cegrpo.compression import BoundaryCodec, BoundaryContext, ByteMeter
from megatron_cegrpo.pipeline.prefetch import CodecPrefetcher

__all__ = ["CompressedP2PCommunicator", "tp_payload_piece", "tp_payload_whole"]


def tp_payload_piece(payload: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s piece of a codec payload (any shape and dtype): the flattened payload
    zero-padded to a multiple of ``tp_size`` (at most ``tp_size - 1`` zeros at the end), then its
    ``tp_rank``-th of ``tp_size`` equal chunks (megatron-core's ``split_tensor_into_1d_equal_chunks``
    layout), a new 1-D tensor of ``ceil(payload.numel() / tp_size)`` elements, payload dtype.

    Raises:
        ValueError: ``tp_rank`` outside ``0 .. tp_size - 1``.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tensor-parallel size {tp_size}")
    flat = payload.reshape(-1)
    pad = -flat.numel() % tp_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    n = flat.numel() // tp_size
    return flat[tp_rank * n:(tp_rank + 1) * n].clone()


def tp_payload_whole(pieces: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of :func:`tp_payload_piece`: the TP ranks' pieces concatenated in TP rank order
    (1-D, what ``gather_split_1d_tensor`` returns) -> the payload of ``shape`` (the padding dropped).

    Raises:
        ValueError: fewer elements than ``shape`` holds.
    """
    n = math.prod(shape)
    if pieces.numel() < n:
        raise ValueError(f"TP payload pieces hold {pieces.numel()} elements, fewer than the {n} of shape {tuple(shape)}")
    return pieces[:n].reshape(shape)

BASIS_TAG = 23  # a codec's basis (lowrank), sent before the payload it decodes


class CompressedP2PCommunicator(P2PCommunicator):
    """P2P communicator that puts only codec payloads on the wire.

    Args:
        pp_group: the pipeline-parallel process group (gloo on CPU, nccl on GPU).
        config: the model's ``ModelParallelConfig``/``TransformerConfig``
            (``pipeline_dtype`` must be set; ``variable_seq_lengths`` must be False).
        codec: a :class:`BoundaryCodec` (``dense``, ``mask``, ...).
        meter: a :class:`ByteMeter` that records every payload this rank sends.
        seed: the run seed keying the PRF masks.
        tp_group: this stage's tensor-parallel group (None or size 1: no TP); each TP rank
            sends 1/T of every payload (module docstring).

    Raises:
        ValueError: if the config asks for variable sequence lengths or ring exchange
            (their shape handshakes would bypass the codec).
    """

    def __init__(self, pp_group: dist.ProcessGroup, config, codec: BoundaryCodec, meter: ByteMeter, seed: int,
                 tp_group: Optional[dist.ProcessGroup] = None):
        super().__init__(pp_group, config)
        self.tp_group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        if getattr(config, "variable_seq_lengths", False):
            raise ValueError("CompressedP2PCommunicator needs variable_seq_lengths=False (fixed shapes per pass)")
        if getattr(config, "use_ring_exchange_p2p", False):
            raise ValueError("CompressedP2PCommunicator does not support use_ring_exchange_p2p")
        self.codec = codec
        self.meter = meter
        self.seed = int(seed)
        self.pp_rank = pp_group.rank()
        self.pp_size = pp_group.size()
        self._step: Optional[int] = None
        self._mb_sample_ids: List[torch.Tensor] = []
        self._counters = {"send_next": 0, "recv_prev": 0, "send_prev": 0, "recv_next": 0}
        # where megatron's p2p allocates (the CPU under compat.cpu, else the current GPU)
        self.prefetcher = CodecPrefetcher(torch.device("cuda", torch.cuda.current_device())
                                          if torch.cuda.is_available() else torch.device("cpu"))
        self.error_tracker = None  # a BoundaryErrorTracker while tracking_error() is active

    @contextlib.contextmanager
    def using(self, codec: BoundaryCodec, meter: ByteMeter):
        """Temporarily move payloads with another codec and bill them to another meter
        (the compression-off drift probe runs dense passes without touching ``comm/*``);
        no boundary error is recorded meanwhile."""
        saved = self.codec, self.meter, self.error_tracker
        self.codec, self.meter, self.error_tracker = codec, meter, None
        try:
            yield self
        finally:
            self.codec, self.meter, self.error_tracker = saved

    @contextlib.contextmanager
    def tracking_error(self, tracker):
        """While active, every forward send adds ``(x, x_hat)`` to ``tracker``
        (:class:`~megatron_cegrpo.pipeline.boundary_error.BoundaryErrorTracker`): ``x_hat`` is
        the codec's ``decode_forward`` of the payload just encoded, recomputed at the sender."""
        saved = self.error_tracker
        self.error_tracker = tracker
        try:
            yield self
        finally:
            self.error_tracker = saved

    # ---- pass bookkeeping -------------------------------------------------
    def prefetch(self, step: int, microbatch_sample_ids: Sequence[torch.Tensor], seq_len: int) -> int:
        """Start the codec's work for every crossing of a pass at this rank, off the critical path.

        For each micro-batch (in schedule order) the received boundary ``pp_rank - 1`` (not on
        the first stage) and the sent boundary ``pp_rank`` (not on the last), dense shape
        ``[seq_len, micro_batch_size, hidden_size]``: exactly the crossings ``_communicate``
        will encode or decode, forward and backward. Crossings already queued are skipped, so
        calling it again for the next pass of the same iteration costs nothing.

        Args:
            step: the iteration t keying the masks.
            microbatch_sample_ids: one LongTensor [micro_batch_size] per micro-batch.
            seq_len: s, tokens per sequence of this pass.
        Returns:
            the number of crossings newly queued (0 for a codec without precompute).
        """
        boundaries = ([self.pp_rank - 1] if self.pp_rank > 0 else []) + (
            [self.pp_rank] if self.pp_rank < self.pp_size - 1 else [])
        crossings = []
        for sids in microbatch_sample_ids:
            sids = torch.as_tensor(sids, dtype=torch.long).cpu()
            shape = (int(seq_len), int(sids.numel()), int(self.config.hidden_size))
            for boundary in boundaries:
                ctx = BoundaryContext(seed=self.seed, boundary=boundary, step=int(step), sample_ids=sids)
                crossings.append((ctx, shape))
        return self.prefetcher.submit(self.codec, crossings)

    def close(self) -> None:
        """Stop the prefetch thread (queued work not started is dropped)."""
        self.prefetcher.close()

    def begin_pass(self, step: int, microbatch_sample_ids: Sequence[torch.Tensor],
                   seq_len: Optional[int] = None) -> None:
        """Start one schedule call.

        Args:
            step: the training iteration t keying the masks (all passes of t share it).
            microbatch_sample_ids: one LongTensor [micro_batch_size] per micro-batch,
                in schedule order, holding each sample's index in the iteration's batch.
            seq_len: tokens per sequence; when given, the crossings not yet prefetched are
                queued now (:meth:`prefetch`).
        """
        self._step = int(step)
        self._mb_sample_ids = [torch.as_tensor(s, dtype=torch.long).cpu() for s in microbatch_sample_ids]
        for k in self._counters:
            self._counters[k] = 0
        if seq_len is not None:
            self.prefetch(step, self._mb_sample_ids, seq_len)

    def end_pass(self, forward_only: bool) -> None:
        """Check that every micro-batch crossed each active boundary exactly once."""
        m = len(self._mb_sample_ids)
        first, last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        expected = {
            "send_next": 0 if last else m,
            "recv_prev": 0 if first else m,
            "send_prev": 0 if (first or forward_only) else m,
            "recv_next": 0 if (last or forward_only) else m,
        }
        assert self._counters == expected, f"p2p traffic {self._counters} != expected {expected}"
        self._step = None

    def _context(self, boundary: int, counter: str) -> BoundaryContext:
        if self._step is None:
            raise RuntimeError("CompressedP2PCommunicator used outside begin_pass()/end_pass()")
        idx = self._counters[counter]
        if idx >= len(self._mb_sample_ids):
            raise RuntimeError(f"more micro-batches crossed ({counter}) than begin_pass() announced")
        self._counters[counter] = idx + 1
        return BoundaryContext(
            seed=self.seed, boundary=boundary, step=self._step, sample_ids=self._mb_sample_ids[idx]
        )

    def _send_basis(self, ctx: BoundaryContext) -> list:
        """Ship the basis the codec refreshed for this payload (lowrank, fast-owned), metered. At
        TP > 1 every TP rank holds the same basis (``BoundaryCodec.tp_splittable``) and sends only
        its piece (:func:`tp_payload_piece`), so the basis crosses the boundary once in total."""
        basis = self.codec.basis_to_send(ctx)
        if basis is None:
            return []
        basis = self._piece(basis.contiguous())
        self.meter.add_basis(self.pp_rank, basis)
        self._basis_keep = basis
        return [dist.isend(basis, dst=self.next_rank, group=self.pp_group, tag=BASIS_TAG)]

    def _recv_basis(self, buf: torch.Tensor) -> torch.Tensor:
        """Receive the basis announced by ``basis_to_receive`` (``buf``: an empty tensor of its shape
        and dtype): whole without TP, else this TP rank's piece, all-gathered inside the stage."""
        piece = buf if self.tp_group is None else buf.new_empty(self._piece_shape(tuple(buf.shape)))
        dist.irecv(piece, src=self.prev_rank, group=self.pp_group, tag=BASIS_TAG).wait()
        return self._whole(piece, tuple(buf.shape))

    # ---- tensor parallelism: 1/T of each payload per TP rank ---------------
    def _tp(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1

    def _piece(self, payload: torch.Tensor) -> torch.Tensor:
        """This TP rank's share of ``payload`` on the wire: the whole payload without TP, else
        its chunk of the flattened payload zero-padded to a multiple of T."""
        if self.tp_group is None:
            return payload
        return tp_payload_piece(payload, self._tp(), self.tp_group.rank())

    def _piece_shape(self, shape):
        """The receive buffer of one TP rank's piece of a payload of ``shape``."""
        if self.tp_group is None or shape is None:
            return shape
        n = math.prod(shape)
        return (-(-n // self._tp()),)

    def _whole(self, piece: torch.Tensor, shape) -> torch.Tensor:
        """The payload of ``shape`` from the TP ranks' pieces (an all-gather inside the stage)."""
        if self.tp_group is None:
            return piece
        return tp_payload_whole(gather_split_1d_tensor(piece, tp_group=self.tp_group), shape)

    def _send_piece(self, direction: str, boundary: int, payload: torch.Tensor, dense_numel: int) -> torch.Tensor:
        """Record what this rank sends (its piece, against its share of the dense tensor); return the piece."""
        piece = self._piece(payload)
        self.meter.add(direction, boundary, piece, -(-dense_numel // self._tp()))
        return piece

    # ---- the one override ---------------------------------------------------
    def _communicate(
        self,
        *,
        tensor_send_next: Optional[torch.Tensor],
        tensor_send_prev: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        tensor_shape,
        wait_on_reqs: bool = True,
    ):
        shape = tuple(int(x) for x in tensor_shape) if tensor_shape is not None else None
        dtype = self.config.pipeline_dtype
        payload_next = payload_prev = piece_next = piece_prev = None
        basis_reqs = []
        with torch.no_grad():
            if tensor_send_next is not None:
                ctx_next_send = self._context(self.pp_rank, "send_next")
                self.prefetcher.wait(self.codec, ctx_next_send, tuple(tensor_send_next.shape))
                payload_next = self.codec.encode_forward(tensor_send_next.detach(), ctx_next_send).contiguous()
                piece_next = self._send_piece("fwd", self.pp_rank, payload_next, tensor_send_next.numel())
                shape = shape or tuple(tensor_send_next.shape)
                basis_reqs += self._send_basis(ctx_next_send)
                if self.error_tracker is not None:
                    x_hat = self.codec.decode_sent_forward(payload_next, ctx_next_send,
                                                          tuple(tensor_send_next.shape))
                    self.error_tracker.add(self.pp_rank, tensor_send_next, x_hat)
            if tensor_send_prev is not None:
                ctx_prev_send = self._context(self.pp_rank - 1, "send_prev")
                self.prefetcher.wait(self.codec, ctx_prev_send, tuple(tensor_send_prev.shape))
                payload_prev = self.codec.encode_backward(tensor_send_prev.detach(), ctx_prev_send).contiguous()
                piece_prev = self._send_piece("bwd", self.pp_rank - 1, payload_prev, tensor_send_prev.numel())
        # the receive contexts are taken before the bytes arrive: a codec's payload shape may
        # depend on the direction and the message (a per-step basis rides on the first one)
        ctx_prev = self._context(self.pp_rank - 1, "recv_prev") if recv_prev else None
        ctx_next = self._context(self.pp_rank, "recv_next") if recv_next else None
        recv_shapes = [self.codec.wire_shape(dr, shape, c, dtype, "recv")
                       for dr, c in (("fwd", ctx_prev), ("bwd", ctx_next)) if c is not None]
        if len(set(recv_shapes)) > 1:
            raise ValueError(f"one p2p call receives payloads of two shapes {recv_shapes} (interleaved "
                             "schedules are not supported with direction-dependent codecs)")
        payload_shape = recv_shapes[0] if recv_shapes else None
        recv_prev_t, recv_next_t, _ = super()._communicate(
            tensor_send_next=piece_next,
            tensor_send_prev=piece_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=self._piece_shape(payload_shape),
            wait_on_reqs=True,  # decoding needs the bytes
        )
        for req in basis_reqs:
            req.wait()
        x = g = None
        with torch.no_grad():
            if recv_prev:
                self.prefetcher.wait(self.codec, ctx_prev, shape)
                basis = self.codec.basis_to_receive(ctx_prev, shape, self.config.pipeline_dtype)
                if basis is not None:
                    self.codec.accept_basis(ctx_prev, self._recv_basis(basis))
                x = self.codec.decode_forward(self._whole(recv_prev_t.detach(), payload_shape), ctx_prev, shape)
            if recv_next:
                self.prefetcher.wait(self.codec, ctx_next, shape)
                g = self.codec.decode_backward(self._whole(recv_next_t.detach(), payload_shape), ctx_next, shape)
        if x is not None:
            x = x.to(self.config.pipeline_dtype).requires_grad_(True)
        if g is not None:
            g = g.to(self.config.pipeline_dtype)
        return x, g, None
