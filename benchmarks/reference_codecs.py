"""Reference boundary encodings a user would otherwise pick, for the byte / time comparison.

These are *benchmark baselines*, not library codecs: they are never registered and never
run inside the pipeline. Each one returns its wire payload as a tuple of tensors, so
``wire_bytes(payload)`` is what would cross the link (measured from the tensors, not
from a formula).

* :class:`TopKReference` - per token, the k largest-magnitude coordinates: values in the
  wire dtype plus their indices (int32 or int16). Backward: the sender kept the indices
  it chose, so the gradient comes back as k values only (no indices).
* :class:`Int8Reference` - symmetric per-token absmax int8 quantization: d int8 codes plus
  one scale per token in the wire dtype, both directions.

All operate on boundary tensors ``[s, b, d]``.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["wire_bytes", "TopKReference", "Int8Reference"]

Payload = Tuple[torch.Tensor, ...]


def wire_bytes(payload) -> int:
    """Bytes of a payload: a tensor or a tuple of tensors (numel * element_size, summed)."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return sum(t.numel() * t.element_size() for t in payload)


class TopKReference:
    """Top-k by magnitude per token, values + indices on the wire (forward), values only (backward).

    Args:
        k: coordinates kept per token.
        index_dtype: ``torch.int32`` or ``torch.int16`` (int16 addresses d <= 32767).
    """

    def __init__(self, k: int, index_dtype: torch.dtype = torch.int32):
        if index_dtype not in (torch.int32, torch.int16):
            raise ValueError(f"index_dtype must be torch.int32 or torch.int16, got {index_dtype}")
        self.k = int(k)
        self.index_dtype = index_dtype
        self.name = f"topk-{'i32' if index_dtype == torch.int32 else 'i16'}"

    def encode_forward(self, x: torch.Tensor) -> Payload:
        d = x.shape[-1]
        if self.index_dtype == torch.int16 and d > 32767:
            raise ValueError(f"int16 indices cannot address d={d}")
        idx = x.detach().abs().topk(self.k, dim=-1, sorted=False).indices
        return x.detach().gather(-1, idx), idx.to(self.index_dtype)

    def decode_forward(self, payload: Payload, shape) -> torch.Tensor:
        values, idx = payload
        return torch.zeros(shape, dtype=values.dtype).scatter(-1, idx.long(), values)

    def encode_backward(self, grad: torch.Tensor, fwd_payload: Payload) -> Payload:
        # the receiver got the indices in the forward payload; only values go back
        return (grad.detach().gather(-1, fwd_payload[1].long()),)

    def decode_backward(self, payload: Payload, fwd_payload: Payload, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=payload[0].dtype).scatter(-1, fwd_payload[1].long(), payload[0])


class Int8Reference:
    """Symmetric per-token absmax int8: q = round(127 x / max|x|), scale = max|x| / 127.

    Args:
        scale_dtype: dtype of the per-token scale on the wire (default: the tensor's dtype).
    """

    name = "int8"

    def __init__(self, scale_dtype: torch.dtype = None):
        self.scale_dtype = scale_dtype

    def _encode(self, x: torch.Tensor) -> Payload:
        x = x.detach()
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
        q = torch.round(x.float() * (127.0 / amax)).clamp_(-127, 127).to(torch.int8)
        return q, (amax / 127.0).to(self.scale_dtype or x.dtype)

    def _decode(self, payload: Payload, dtype) -> torch.Tensor:
        q, scale = payload
        return (q.float() * scale.float()).to(dtype)

    def encode_forward(self, x: torch.Tensor) -> Payload:
        return self._encode(x)

    def decode_forward(self, payload: Payload, shape, dtype=None) -> torch.Tensor:
        return self._decode(payload, dtype or payload[1].dtype).view(shape)

    def encode_backward(self, grad: torch.Tensor, fwd_payload: Payload = None) -> Payload:
        return self._encode(grad)

    def decode_backward(self, payload: Payload, fwd_payload: Payload = None, shape=None, dtype=None) -> torch.Tensor:
        out = self._decode(payload, dtype or payload[1].dtype)
        return out.view(shape) if shape is not None else out
