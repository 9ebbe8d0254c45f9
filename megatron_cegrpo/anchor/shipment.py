"""How a stage's weights travel to the anchor: fp32, or deltas against a shared mirror (issues 12, 30).

``--anchor-ship fp32`` sends theta(s) as one flat fp32 buffer (4 bytes a parameter). The delta
modes send only the change against a *mirror* both ends keep and advance by the same operation:

    delta      = theta(s) - mirror                           # fp32, on the stage
    payload    = encode(delta)                               # what crosses the wire
    mirror     = mirror + decode(payload)                    # on both ends, bit-identical
    theta_hat(s) = mirror                                    # what the anchor's ring holds

- ``bf16-delta``: ``decode(encode(x)) = bf16(x)``, 2 bytes a parameter;
- ``int8-delta`` / ``int4-delta``: blocks of :data:`BLOCK` values, each sent as its largest
  magnitude ``a`` (fp32) and ``round(x / (a / q))`` in ``[-q, q]`` (``q`` = 127 / 7; 1 byte / half
  a byte a value), ``decode = round(x q / a) (a / q)``: 1.016 / 0.516 bytes a parameter.

Because the mirror is advanced by what was decoded, what one payload leaves out is part of the
next delta (error feedback, closed loop): ``|theta_hat(s) - theta(s)|`` is at most one payload's
rounding of one shipment's movement (``2^-9 |d|`` elementwise for bf16, ``a / 2q`` per block for
the integer codes), never an accumulation over the run. Why not plain bf16 weights: the
forecasts difference checkpoints (``theta(s1) - theta(s0)``) that move by ~0.1 % over the
seeds' 20-step horizon, below bf16's resolution of a weight (2^-9 ~ 0.2 %), so a bf16 copy
would erase the secant; the delta keeps a small fraction of the secant itself.

**No keyframe to an anchor that holds the weights** (issue 30). At start-up the stage seeds its
mirror (:meth:`ShipmentEncoder.start`: on a new run theta(0) as loaded; after a resume the mirror of
its checkpoint) and sends the mirror's :func:`mirror_digest`; the anchor compares it with what it
can load itself (its own copy of the base model on a new run, the newest checkpoint of its
restored ring after a resume) and answers agreed or not (``anchor/worker.py``). Agreed: the
anchor seeds its decoder with that copy, and on a new run the first shipment (theta(0), which both
hold) is not sent at all. Not agreed (a different base file, an anchor that lost its state): the
first shipment is the fp32 keyframe, as before: on a new run theta(0); after a resume the restored
mirror advanced by the delta, the values the uninterrupted run's anchor would hold, so a resume
stays bit-identical either way.

**Every shipment is checked** (issue 30): a header (int64 [:data:`HEADER_LEN`]: sequence number,
kind, payload bytes, CRC-32 of the payload, BLAKE2b-128 of the mirror it leads to, a check word)
goes ahead of the payload (:meth:`ShipmentEncoder.header`); the anchor's
:meth:`ShipmentDecoder.accept` refuses a shipment out of sequence (missing, repeated, reordered), a
corrupt payload, a delta it has no mirror for, or one whose result differs from the stage's
mirror, raising :class:`ShipmentRejected`; the decoder then drops its mirror and wants a keyframe,
which the anchor asks for in its next answer to the stage (``anchor/worker.py``; the stage's
:meth:`ShipmentEncoder.resync`), and theta(s) of a refused shipment never enters the ring.

Pure tensor code, no torch.distributed.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from ..pipeline.link_check import check_word, crc32, digest_hex, digest_words

__all__ = ["SHIP_MODES", "BLOCK", "HEADER_LEN", "ShipmentEncoder", "ShipmentDecoder", "ShipmentRejected",
           "shipment_nbytes", "mirror_digest"]

SHIP_MODES = ("fp32", "bf16-delta", "int8-delta", "int4-delta")
#: values per scale of the integer delta codes
BLOCK = 256
_QMAX = {"int8-delta": 127, "int4-delta": 7}


def shipment_nbytes(numel: int, mode: str, keyframe: bool) -> int:
    """Bytes of one stage's shipment of ``numel`` parameters: 4 a parameter in fp32 or for a
    keyframe; 2 for a bf16 delta; for an int8 / int4 delta one fp32 scale per :data:`BLOCK`
    values plus 1 / half a byte a value (the last block padded).

    Raises ValueError for an unknown ``mode``.
    """
    if mode not in SHIP_MODES:
        raise ValueError(f"unknown anchor shipment mode {mode!r}; one of {', '.join(SHIP_MODES)}")
    if mode == "fp32" or keyframe:
        return numel * 4
    if mode == "bf16-delta":
        return numel * 2
    blocks = math.ceil(numel / BLOCK)
    return blocks * 4 + (blocks * BLOCK if mode == "int8-delta" else blocks * BLOCK // 2)


HEADER_LEN = 7  # seq, kind, payload bytes, CRC-32, mirror digest (two int64), a check word
KIND_DELTA, KIND_KEYFRAME = 0, 1


class ShipmentRejected(ValueError):
    """A shipment the anchor cannot use (out of sequence, corrupt, no mirror, a diverged mirror)."""


def mirror_digest(flat: torch.Tensor) -> str:
    """BLAKE2b-128 (hex) of a flat fp32 buffer's bytes: what the two ends compare at start-up; the
    header carries the same digest as two int64 (``pipeline/link_check.py``)."""
    return digest_hex(flat)


def _encode_int(delta: torch.Tensor, mode: str):
    """(payload uint8 [shipment_nbytes], decoded fp32 [numel]) of the fp32 delta ``delta`` [numel]."""
    q, n = _QMAX[mode], delta.numel()
    blocks = math.ceil(n / BLOCK)
    x = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    x[:n] = delta
    x = x.view(blocks, BLOCK)
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, q / amax.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(amax))
    codes = torch.round(x * inv[:, None]).clamp_(-q, q).to(torch.int8)
    if mode == "int8-delta":
        body = codes.view(-1).view(torch.uint8)
    else:
        u = (codes.view(-1) + 8).to(torch.uint8)  # 1 .. 15
        body = u[0::2] | (u[1::2] << 4)
    payload = torch.cat([amax.view(torch.uint8), body])
    return payload, _decode_int(payload, mode, n)


def _decode_int(payload: torch.Tensor, mode: str, n: int) -> torch.Tensor:
    """The fp32 values [n] an integer-coded payload stands for (the same operations on both ends)."""
    q = _QMAX[mode]
    blocks = math.ceil(n / BLOCK)
    amax = payload[:blocks * 4].view(torch.float32)
    body = payload[blocks * 4:]
    if mode == "int8-delta":
        codes = body.view(torch.int8)
    else:
        codes = torch.stack([(body & 15).to(torch.int8) - 8, (body >> 4).to(torch.int8) - 8], dim=1).view(-1)
    return (codes.view(blocks, BLOCK).float() * (amax / q)[:, None]).view(-1)[:n]


class ShipmentEncoder:
    """The stage's end: what to send for theta(s).

    Args:
        mode: one of ``SHIP_MODES``.
    """

    def __init__(self, mode: str):
        shipment_nbytes(0, mode, False)  # validates the mode
        self.mode = mode
        self.mirror: Optional[torch.Tensor] = None  # fp32 [numel]: what the anchor holds
        self._sent_keyframe = False  # in this process lifetime (or the anchor agreed on the mirror)
        self._seeded = False  # start() set a new run's mirror to theta(0)
        self.skip_next = False  # the next shipment is theta(0), which the anchor holds: not sent
        self.seq = 0  # shipments sent (headers numbered 1, 2, ...)
        self._last_kind = KIND_KEYFRAME

    @torch.no_grad()
    def start(self, flat: torch.Tensor) -> Optional[str]:
        """At start-up, before the first shipment: the digest of the mirror the deltas would start
        from (``None`` in fp32 mode: nothing to agree on). ``flat`` [numel] fp32: the stage's
        parameters now (theta(0) on a new run; ignored when a checkpoint restored the mirror)."""
        if self.mode == "fp32":
            return None
        if self.mirror is None:
            self.mirror, self._seeded = flat.detach().float().clone(), True
        return mirror_digest(self.mirror)

    def agreed(self, ok: bool) -> None:
        """The anchor's answer to :meth:`start`'s digest: agreed, deltas from the first shipment
        (on a new run the first, theta(0), is skipped); not agreed, an fp32 keyframe first."""
        if self.mode == "fp32":
            return
        self._sent_keyframe = ok
        self.skip_next = ok and self._seeded
        if not ok and self._seeded:
            self.mirror = None  # a new run's keyframe is theta(0) itself
        self._seeded = False

    @torch.no_grad()
    def encode(self, flat: torch.Tensor) -> Optional[torch.Tensor]:
        """The payload for the flat fp32 parameters ``flat`` [numel].

        Returns a new fp32 [numel] tensor (fp32 mode, or the keyframe), a bf16 [numel] delta, a
        uint8 [``shipment_nbytes``] integer-coded delta, or None when the shipment is skipped
        (:attr:`skip_next`); the mirror advances to what the anchor will hold.
        Raises ValueError for a non-fp32 or non-1-D ``flat`` or a size that changed, and
        RuntimeError when a skipped shipment's ``flat`` is not the agreed mirror.
        """
        if flat.dtype != torch.float32 or flat.dim() != 1:
            raise ValueError(f"shipments take a flat fp32 buffer, got {flat.dtype} {tuple(flat.shape)}")
        if self.mode == "fp32":
            self.seq += 1
            self._last_kind = KIND_KEYFRAME
            return flat
        if self.mirror is not None and self.mirror.numel() != flat.numel():
            raise ValueError(f"shipment of {flat.numel()} parameters against a mirror of {self.mirror.numel()}")
        if self.skip_next:
            self.skip_next = False
            if not torch.equal(flat, self.mirror):
                raise RuntimeError("anchor shipment: theta(0) changed between start-up and the first shipment; "
                                   "the anchor's copy would be wrong")
            return None
        self.seq += 1
        self._last_kind = KIND_DELTA
        if self.mirror is None:
            self.mirror = flat.clone()
        else:
            delta = flat - self.mirror
            if self.mode == "bf16-delta":
                payload = delta.to(torch.bfloat16)
                self.mirror.add_(payload.float())
            else:
                payload, decoded = _encode_int(delta, self.mode)
                self.mirror.add_(decoded)
            if self._sent_keyframe:
                return payload
        self._sent_keyframe = True
        self._last_kind = KIND_KEYFRAME
        return self.mirror.clone()

    def header(self, payload: torch.Tensor) -> torch.Tensor:
        """The check header (int64 [HEADER_LEN]) of the payload :meth:`encode` just returned (delta
        modes; the module docstring): sequence number, kind, bytes, CRC-32, the mirror's digest."""
        d0, d1 = digest_words(payload if self.mode == "fp32" else self.mirror)
        fields = [self.seq, self._last_kind, payload.numel() * payload.element_size(), crc32(payload), d0, d1]
        return torch.tensor(fields + [check_word(fields)], dtype=torch.int64)

    def resync(self) -> None:
        """The anchor lost the mirror (a refused shipment): the next shipment is an fp32 keyframe."""
        self.mirror, self._sent_keyframe, self.skip_next = None, False, False

    def state_dict(self) -> Dict:
        """The mirror (fp32 [numel] or None) and the sequence number: a resumed stage continues the
        same deltas."""
        return {"mode": self.mode, "mirror": self.mirror, "seq": self.seq}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        """Restore :meth:`state_dict` (None or another mode: start without a mirror)."""
        ok = state is not None and state.get("mode") == self.mode and self.mode != "fp32"
        self.mirror = state["mirror"].clone() if ok and state["mirror"] is not None else None
        self.seq = int(state.get("seq", 0)) if ok else 0
        self._sent_keyframe = self._seeded = self.skip_next = False


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
        self.skip_next = False  # the next shipment is theta(0), agreed at start-up: nothing to receive
        self.seq = 0  # the last shipment's sequence number
        self.want_keyframe = False  # a shipment was refused: the mirror is gone until a keyframe
        self.num_rejected = 0

    def agree(self, digest: Optional[str], candidate: Optional[torch.Tensor], new_run: bool,
              seq: int = 0) -> bool:
        """Start-up: whether the stage's mirror (its ``digest``) equals ``candidate`` (fp32 [numel]:
        the anchor's own copy of the stage, None when it has none). Agreed: the decoder is seeded
        with it and, on a new run, skips the first shipment. Returns the answer for the stage.
        ``seq``: the stage's shipments so far (its checkpoint's)."""
        self.seq = int(seq)
        ok = (digest is not None and candidate is not None and candidate.numel() == self.numel
              and mirror_digest(candidate) == digest)
        if ok:
            self.mirror = candidate.detach().float().clone()
            self.skip_next = new_run
        return ok

    def buffer(self) -> torch.Tensor:
        """An empty receive buffer of the next payload's dtype and size."""
        keyframe = self.mode == "fp32" or self.mirror is None
        if keyframe:
            return torch.empty(self.numel, dtype=torch.float32)
        if self.mode == "bf16-delta":
            return torch.empty(self.numel, dtype=torch.bfloat16)
        return torch.empty(shipment_nbytes(self.numel, self.mode, False), dtype=torch.uint8)

    @torch.no_grad()
    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """theta_hat(s) (fp32 [numel], the decoder's own storage: clone before keeping it).

        Raises ValueError when ``payload``'s dtype or size is not the expected one.
        """
        want = self.buffer()
        if payload.dtype != want.dtype or payload.numel() != want.numel():
            raise ValueError(f"anchor shipment of {payload.numel()} {payload.dtype}, expected "
                             f"{want.numel()} {want.dtype}")
        if self.mode == "fp32":
            return payload
        if self.mirror is None:
            self.mirror = payload.clone()
        elif self.mode == "bf16-delta":
            self.mirror.add_(payload.float())
        else:
            self.mirror.add_(_decode_int(payload, self.mode, self.numel))
        return self.mirror

    def payload_nbytes(self, header: torch.Tensor) -> int:
        """The payload size a header announces, checked against the two sizes this mode sends.

        Raises RuntimeError for a corrupt header (its size unknown, the link cannot go on)."""
        f = [int(x) for x in header.tolist()]
        sizes = {KIND_KEYFRAME: shipment_nbytes(self.numel, self.mode, True),
                 KIND_DELTA: shipment_nbytes(self.numel, self.mode, False)}
        if len(f) != HEADER_LEN or f[6] != check_word(f[:6]) or sizes.get(f[1]) != f[2]:
            raise RuntimeError(f"anchor shipment header is corrupt (fields {f}); expected sizes {sizes}")
        return f[2]

    @torch.no_grad()
    def accept(self, header: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """Check and decode one shipment: ``header`` from :meth:`ShipmentEncoder.header`, ``payload``
        its bytes (uint8 [payload_nbytes]). Returns theta_hat(s) (fp32 [numel], the decoder's storage).

        Raises:
            ShipmentRejected: out of sequence, a CRC mismatch, a delta without a mirror, or a mirror
                that is not the stage's; the decoder then has no mirror and :attr:`want_keyframe`.
        """
        f = [int(x) for x in header.tolist()]
        seq, kind, crc, digest = f[0], f[1], f[3], (f[4], f[5])
        expected, self.seq = self.seq + 1, max(self.seq, seq)
        try:  # a keyframe stands alone: any newer one is good; a delta must be the very next
            if seq != expected and not (kind == KIND_KEYFRAME and seq > expected):
                raise ShipmentRejected(f"shipment {seq} where {expected} was due (missing or reordered)")
            if crc32(payload) != crc:
                raise ShipmentRejected(f"shipment {seq}'s payload fails its CRC-32")
            if kind == KIND_DELTA and self.mirror is None:
                raise ShipmentRejected(f"shipment {seq} is a delta, but the mirror is gone (a keyframe is due)")
            if kind == KIND_KEYFRAME:
                self.mirror = None
            dtype = (torch.float32 if kind == KIND_KEYFRAME else
                     torch.bfloat16 if self.mode == "bf16-delta" else torch.uint8)
            out = self.decode(payload.view(dtype))
            if digest_words(out) != digest:
                raise ShipmentRejected(f"shipment {seq} leads to weights that are not the stage's (digest)")
        except ShipmentRejected:
            self.mirror, self.want_keyframe = None, True
            self.num_rejected += 1
            raise
        if kind == KIND_KEYFRAME:
            self.want_keyframe = False
        return out

    def skip(self) -> torch.Tensor:
        """theta(0) of a new run agreed at start-up (nothing was sent): the seeded mirror."""
        self.skip_next = False
        return self.mirror
