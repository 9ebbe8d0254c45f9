"""Dense steps: every ``--dense-step-interval``-th iteration, and each iteration the drift
controller schedules (``--drift-controller``, drift_controller.py), runs with uncompressed
boundaries (issue 31 items 2 and 3; docs/dense_steps.md, docs/training_health.md).

Source: the seeds' status report (issue 31): the 5 % boundary mask with their anchor but no
dense steps did not learn; "the clean step is the only lever that worked": a dense step every
4 iterations gave 0.696, every 20 gave 0.7354, against 0.7415 for dense training (GSM8K,
Qwen2.5-1.5B).

On a dense step t (``t % N == 0``, or scheduled) every pass of the iteration (old-logprob,
reference, update, and the drift and fidelity probes, which are dense anyway) moves its boundary
tensors with the ``dense`` codec through the stage's own communicator and byte meter
(``CompressedP2PCommunicator.using``), so:

- the bytes are billed as real wire bytes of that iteration: ``comm/fwd_bytes`` and
  ``comm/bwd_bytes`` equal ``comm/dense_equiv_bytes``, ``comm/bytes_ratio`` is 1, and the run's
  ``comm/avg_boundary_ratio`` (cumulative wire / cumulative dense-equivalent boundary bytes,
  ``ByteMeter`` totals, checkpointed) includes them;
- the gradient is the dense codec's on the same batch (the masks keyed by t are never derived:
  the trainer does not prefetch them, and the dense codec has no per-crossing work);
- no correction circuit's pre-step hook runs (``StageWorker.dense_step``): the anchor's sign
  blend exists to fix the compressed gradient, and this one is not compressed. The anchor's
  bookkeeping goes on unchanged: shipments, batches, fires, M and the ring, and the signs a
  fire sends are received and held (``--sign-fold every-step`` applies them from the next
  compressed step; ``anchor/correction_applied`` is 0 on the dense step);
- no boundary error is recorded (``codec/error_persistence``: a dense step has none, so the
  persistence is next logged two compressed iterations later);
- the codec's own state does not advance (a fast-owned lowrank basis is refreshed at the next
  compressed step, an anchor-owned one staged for t is installed then).
"""

from __future__ import annotations

import contextlib

from megatron_cegrpo.compression import build_codec

__all__ = ["DenseSteps"]


class DenseSteps:
    """Which iterations are dense, and the context that makes one so.

    Args:
        interval: N of ``--dense-step-interval`` (0: never).
        stage: the rank's :class:`~megatron_cegrpo.training.stage.StageWorker` (its ``comm`` is
            None at PP = 1, where nothing is ever dense).
        controller: the run's :class:`~megatron_cegrpo.training.drift_controller.DriftController`
            (``--drift-controller``), whose scheduled iterations are dense steps too; None: none.
    """

    def __init__(self, interval: int, stage, controller=None):
        self.interval = int(interval)
        self.stage, self.controller = stage, controller
        self.dense = build_codec("dense")

    def on_interval(self, t: int) -> bool:
        """Whether ``--dense-step-interval`` makes iteration ``t`` dense (``t % N == 0``; never at N = 0)."""
        return bool(self.interval and t % self.interval == 0)

    def is_dense(self, t: int) -> bool:
        """Whether iteration ``t`` is a dense step: on the interval, or scheduled by the drift
        controller (never at PP = 1)."""
        scheduled = self.controller is not None and self.controller.is_dense(t)
        return bool((self.on_interval(t) or scheduled) and self.stage.comm is not None)

    @contextlib.contextmanager
    def iteration(self, t: int):
        """Around iteration ``t``'s passes and optimizer steps: on a dense step the communicator
        moves dense payloads billed to the stage's meter and the stage skips its corrections and
        boundary-error tracking; otherwise nothing changes. Yields whether ``t`` is dense."""
        if not self.is_dense(t):
            yield False
            return
        st = self.stage
        st.dense_step = True
        try:
            with st.comm.using(self.dense, st.meter):
                yield True
        finally:
            st.dense_step = False
