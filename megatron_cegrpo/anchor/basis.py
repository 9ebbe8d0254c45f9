"""The anchor's side of an anchor-owned ``lowrank`` basis (``--lowrank-q-owner anchor``).

Status 2026-07-31 section 3: "During each dense replay [the anchor] refreshes every basis with
one step of power iteration on the activations it just saw, and broadcasts the result alongside
sign(M): Q <- orth(X^T (X Q)) once per fire, frozen in between." The LA-WARMUP-V2 report
(section 7, C8a) rebuilds Q at the forecast weights. Here, during the fire's dense forward at
the forecast (or stale) weights, a forward hook on the last layer of each stage but the last
accumulates ``S_b = sum over micro-batches of X^T (X Q_b)`` in fp32 (X [s*mbs, d], the dense
boundary activation b); after the replay ``Q_b <- orth(S_b)`` (``compression.lowrank``), warm
started from the anchor's previous Q_b, which starts at the stages' ``initial_basis``.
The new bases go to both stages of each boundary with the signs (``anchor/worker.py``).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch

from megatron_cegrpo.compression.lowrank import initial_basis, orthonormalize

__all__ = ["AnchorBasis", "stage_boundaries"]


def stage_boundaries(stage: int, num_stages: int) -> List[int]:
    """The boundaries stage ``stage`` touches, ascending: ``stage - 1`` (it receives) and
    ``stage`` (it sends), those that exist."""
    return [b for b in (stage - 1, stage) if 0 <= b < num_stages - 1]


class AnchorBasis:
    """Per boundary a basis [d, r] the anchor refreshes at each fire.

    Args:
        layers: the dense model's ``decoder.layers`` (a ModuleList).
        boundary_layers: per boundary b, the global index of the last layer of stage b.
        seed: the run seed (``initial_basis``); d, r: hidden size and the codec's rank;
        dtype: the pipeline dtype the bases travel in.
    """

    def __init__(self, layers, boundary_layers: List[int], seed: int, d: int, r: int, dtype: torch.dtype):
        self.layers = layers
        self.boundary_layers = list(boundary_layers)
        self.dtype = dtype
        self.q: Dict[int, torch.Tensor] = {b: initial_basis(seed, b, d, r, dtype)
                                           for b in range(len(self.boundary_layers))}
        self.num_refreshes = 0
        self._acc: Dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def capture(self):
        """Accumulate ``X^T (X Q_b)`` for every boundary during the forwards inside the block."""
        self._acc = {}

        def hook(b):
            def fn(module, args, output):
                x = (output[0] if isinstance(output, tuple) else output).detach()
                x2 = x.reshape(-1, x.shape[-1]).float()
                s = x2.t() @ (x2 @ self.q[b].float())
                self._acc[b] = self._acc[b] + s if b in self._acc else s
            return fn

        handles = [self.layers[j].register_forward_hook(hook(b)) for b, j in enumerate(self.boundary_layers)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def refresh(self) -> bool:
        """``Q_b <- orth(S_b)`` for every boundary seen by :meth:`capture`; True if any."""
        if not self._acc:
            return False
        for b, s in self._acc.items():
            self.q[b] = orthonormalize(s).to(self.dtype)
        self._acc = {}
        self.num_refreshes += 1
        return True

    def for_stage(self, stage: int, num_stages: int) -> List[torch.Tensor]:
        """The bases stage ``stage`` receives, in :func:`stage_boundaries` order."""
        return [self.q[b].contiguous() for b in stage_boundaries(stage, num_stages)]

    def state_dict(self) -> dict:
        return {"q": {b: q.clone() for b, q in self.q.items()}, "num_refreshes": self.num_refreshes}

    def load_state_dict(self, state: dict) -> None:
        # in the dtype the stages receive (a --bf16 checkpoint of before 2026-12-05 holds fp32 bases)
        self.q = {int(b): q.to(self.dtype, copy=True) for b, q in state["q"].items()}
        self.num_refreshes = int(state["num_refreshes"])
