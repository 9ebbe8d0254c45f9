"""CodecPrefetcher: a boundary codec's per-crossing work, done off the critical path.

Source: issue 10 item 6 ("masks (and bases) of an iteration depend only on seed, boundary,
step, sample ids and positions; compute them off the critical path"). A crossing's
context (``BoundaryContext``: seed, boundary, step, sample ids) and its dense shape
``(s, b, d)`` are known as soon as the iteration's batch is packed, long before the
schedule reaches that crossing. The prefetcher hands each such crossing to the codec's
``precompute`` on one background thread, in the order the schedule will need them; the
communicator calls :meth:`CodecPrefetcher.wait` right before encoding or decoding a
crossing, which returns at once when the work is done (the usual case: the first
crossing of a pass comes after a whole stage's forward) and otherwise blocks until the
worker has finished it, so no mask is derived twice and none on the critical path.

torch kernels release the GIL, so the worker runs beside the stage's compute: on a GPU
the mask work is a few small kernels; on a CPU it uses a second core for a few ms per
micro-batch (``bench_codec`` reports it as the off-path cost). Codecs whose
``precompute`` is the base class's no-op are never submitted.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Iterable, Optional, Tuple

import torch

from megatron_cegrpo.compression import BoundaryCodec, BoundaryContext

__all__ = ["CodecPrefetcher"]


def _crossing_key(codec: BoundaryCodec, ctx: BoundaryContext, shape: Tuple[int, int, int]) -> tuple:
    return (id(codec), ctx.seed, ctx.boundary, ctx.step, tuple(ctx.sample_ids.tolist()), tuple(shape))


class CodecPrefetcher:
    """One background thread running ``codec.precompute`` for announced crossings.

    Args:
        device: where the codec's state must live (the device of the p2p tensors).

    Futures are kept per step: submitting a crossing of a new step forgets the older
    step's futures (cancelling those not started). An exception raised by ``precompute``
    is re-raised by the :meth:`wait` of that crossing.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._futures: Dict[tuple, Tuple[Future, BoundaryCodec]] = {}
        self._step: Optional[int] = None
        self._lock = threading.Lock()

    def submit(self, codec: BoundaryCodec, crossings: Iterable[Tuple[BoundaryContext, Tuple[int, int, int]]]) -> int:
        """Queue ``codec.precompute(ctx, shape, device)`` for each (ctx, shape), in order;
        crossings already queued (same codec, context and shape) are skipped.

        Returns:
            the number of crossings newly queued (0 for codecs without precompute).
        """
        if not codec.precomputes:
            return 0
        queued = 0
        with self._lock:
            for ctx, shape in crossings:
                if self._step != ctx.step:
                    self._forget_locked()
                    self._step = ctx.step
                key = _crossing_key(codec, ctx, shape)
                if key in self._futures:
                    continue
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cegrpo-codec-prefetch")
                fut = self._executor.submit(codec.precompute, ctx, tuple(shape), self.device)
                self._futures[key] = (fut, codec)  # the codec ref keeps id(codec) unique
                queued += 1
        return queued

    def wait(self, codec: BoundaryCodec, ctx: BoundaryContext, shape: Tuple[int, int, int]) -> bool:
        """Block until the crossing's precompute (if one was queued) has finished.

        Returns:
            True if a queued precompute existed for this crossing.

        Raises:
            whatever ``codec.precompute`` raised for it.
        """
        if not self._futures:
            return False
        with self._lock:
            entry = self._futures.get(_crossing_key(codec, ctx, shape))
        if entry is None:
            return False
        entry[0].result()
        return True

    def _forget_locked(self) -> None:
        for fut, _ in self._futures.values():
            fut.cancel()
        self._futures.clear()

    def close(self) -> None:
        """Cancel what has not started, wait for the running task, stop the thread."""
        with self._lock:
            self._forget_locked()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
