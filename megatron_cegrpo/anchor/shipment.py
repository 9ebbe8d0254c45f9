"""How a stage's weights travel to the anchor: fp32, or bf16 deltas against a shared mirror (issue 12 item 4).

``--anchor-ship fp32`` sends theta(s) as one flat fp32 buffer (4 bytes a parameter), as
before. ``--anchor-ship bf16-delta`` (the default) sends, after one fp32 keyframe,
only ``bf16(theta(s) - mirror)``: 2 bytes a parameter, half of fp32. Both ends keep the
same fp32 *mirror* (the anchor's reconstruction) and advance it by the same operation,

    delta      = (theta(s) - mirror).to(bfloat16)            # what crosses the wire
    mirror     = mirror + delta.float()                      # on both ends, bit-identical
    theta_hat(s) = mirror                                    # what the anchor's ring holds

so the rounding error does not accumulate (closed loop): ``|theta_hat(s) - theta(s)|`` is
about ``2^-9 |theta(s) - theta_hat(s - c)|`` elementwise (bf16 keeps 8 significand bits;
plus fp32's own rounding of the sum), i.e. relative to one shipment's movement, not to
the weights. Why not plain bf16 weights: the
forecasts difference checkpoints (``theta(s1) - theta(s0)``) that move by ~0.1 % over the
seeds' 20-step horizon, below bf16's resolution of a weight (2^-9 ~ 0.2 %), so a bf16 copy
would erase the secant; the delta keeps ~0.2 % of the secant itself.

The first shipment of each process lifetime (a new run, and after a resume) is the fp32
keyframe: on a new run theta(0) itself; after a resume the restored mirror advanced by the
delta, ``mirror + bf16(theta - mirror)``, which are the values the uninterrupted run's
anchor would hold, so a resume stays bit-identical. The stage's mirror is part of its
checkpoint (:meth:`ShipmentEncoder.state_dict`); the anchor's is rebuilt from the keyframe.

Pure tensor code, no torch.distributed.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

__all__ = ["SHIP_MODES", "ShipmentEncoder", "ShipmentDecoder", "shipment_nbytes"]

SHIP_MODES = ("fp32", "bf16-delta")


def shipment_nbytes(numel: int, mode: str, keyframe: bool) -> int:
    """Bytes of one stage's shipment of ``numel`` parameters: 4 a parameter in fp32 or for a
    keyframe, 2 a parameter for a bf16 delta.

    Raises ValueError for an unknown ``mode``.
    """
    if mode not in SHIP_MODES:
        raise ValueError(f"unknown anchor shipment mode {mode!r}; one of {', '.join(SHIP_MODES)}")
    return numel * (4 if mode == "fp32" or keyframe else 2)


class ShipmentEncoder:
    """The stage's end: what to send for theta(s).

    Args:
        mode: ``"fp32"`` or ``"bf16-delta"`` (``SHIP_MODES``).
    """

    def __init__(self, mode: str):
        shipment_nbytes(0, mode, False)  # validates the mode
        self.mode = mode
        self.mirror: Optional[torch.Tensor] = None  # fp32 [numel]: what the anchor holds
        self._sent_keyframe = False  # in this process lifetime

    @torch.no_grad()
    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The payload for the flat fp32 parameters ``flat`` [numel].

        Returns a new fp32 [numel] tensor (fp32 mode, or the keyframe) or a bf16 [numel]
        delta; the mirror advances to what the anchor will hold.
        Raises ValueError for a non-fp32 or non-1-D ``flat`` or a size that changed.
        """
        if flat.dtype != torch.float32 or flat.dim() != 1:
            raise ValueError(f"shipments take a flat fp32 buffer, got {flat.dtype} {tuple(flat.shape)}")
        if self.mode == "fp32":
            return flat
        if self.mirror is not None and self.mirror.numel() != flat.numel():
            raise ValueError(f"shipment of {flat.numel()} parameters against a mirror of {self.mirror.numel()}")
        if self.mirror is None:
            self.mirror = flat.clone()
        else:
            delta = (flat - self.mirror).to(torch.bfloat16)
            self.mirror.add_(delta.float())
            if self._sent_keyframe:
                return delta
        self._sent_keyframe = True
        return self.mirror.clone()

    def state_dict(self) -> Dict:
        """The mirror (fp32 [numel] or None): a resumed stage continues the same deltas."""
        return {"mode": self.mode, "mirror": self.mirror}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        """Restore :meth:`state_dict` (None or another mode: start without a mirror)."""
        ok = state is not None and state.get("mode") == self.mode and self.mode != "fp32"
        self.mirror = state["mirror"].clone() if ok and state["mirror"] is not None else None
        self._sent_keyframe = False


class ShipmentDecoder:
    """The anchor's end for one stage: the fp32 weights a payload stands for.

    Args:
        mode: the stages' ``--anchor-ship`` mode.
        numel: the stage's parameter count.
    """

    def __init__(self, mode: str, numel: int):
        shipment_nbytes(numel, mode, False)
        self.mode, self.numel = mode, numel
        self.mirror: Optional[torch.Tensor] = None

    def buffer(self) -> torch.Tensor:
        """An empty receive buffer of the next payload's dtype and size ([numel])."""
        keyframe = self.mode == "fp32" or self.mirror is None
        return torch.empty(self.numel, dtype=torch.float32 if keyframe else torch.bfloat16)

    @torch.no_grad()
    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """theta_hat(s) (fp32 [numel], the decoder's own storage: clone before keeping it).

        Raises ValueError when ``payload``'s dtype or size is not the expected one.
        """
        want = self.buffer()
        if payload.dtype != want.dtype or payload.numel() != self.numel:
            raise ValueError(f"anchor shipment of {payload.numel()} {payload.dtype}, expected "
                             f"{self.numel} {want.dtype}")
        if self.mode == "fp32":
            return payload
        if self.mirror is None:
            self.mirror = payload.clone()
        else:
            self.mirror.add_(payload.float())
        return self.mirror
