"""Which rows of a subspace-coded message are coded how, and the common prefix coded once
(``pcaq/prefix=1``; issue 32 item 1, done inside the codec).

The b sequences of a forward boundary message are, in the main job, G / b responses to ONE
prompt (``grpo/batch.py``: right-padded, the prompt at positions 0..P-1). Under causal attention
their boundary states at the prompt's positions are the same vectors, bit for bit, yet an
unshared pass sends them b times. With ``prefix`` = 1 the sender finds p, the number of leading
positions at which every sequence's row equals sequence 0's (checked with ``==``, not assumed:
0 when position 0 already differs), sends p (int32, 4 bytes) and codes those positions for
sequence 0 only; the receiver copies them into the other b - 1 sequences, so they decode exactly
alike. The message's bytes do not change (the header is paid from the coefficient bits:
``coef_bits`` subtracts it): its coefficient bytes are shared by the

    N' = p + (s - p) b        coded rows instead of s b,

each at B' = min(max_bits r, floor(8 ceil(s b B / 8) / N')) bits (the unused tail of the fixed
payload is zero). At the main job's shape (prompts of ~67 tokens in rows of ~136, b = 4) that is
~1.6x the bits a coded row. ``--shared-prefix`` (``grpo/shared_prefix.py``) computes the prompt
once as well and shrinks the dense message itself; ``prefix`` = 1 keeps the dense layout and
the 5 % of each message the start-up check and the study budget, and gives the saving to the
coefficients. Position 0 (the attention sink) is part of any common prefix, so it subsumes
``sink`` = 1 (the two are not combined).

Measured on SmolLM2-135M's PP = 2 boundary (bf16 wire, ``docs/codecs.md``, "The prompt once
inside the codec").
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .codecs import _check_shape
from .quant import dequantize_coefficients, quantize_coefficients
from .wire import ByteReader, packed_nbytes

__all__ = ["PrefixRows", "common_prefix"]


def common_prefix(x: torch.Tensor) -> int:
    """p, the number of leading positions of ``x`` [s, b, d] at which every sequence's row equals
    sequence 0's under ``==`` (bit-identical but for +0.0 / -0.0, which decode alike; s when all
    are; 0 when position 0 already differs)."""
    same = (x == x[:, :1]).flatten(1).all(dim=1)  # [s]
    differs = (~same).nonzero()
    return int(differs[0, 0]) if differs.numel() else int(x.shape[0])


def _prefix_rows(p: int, b: int, device) -> torch.Tensor:
    """int64 rows of the s-major [s b, d] view at positions 0..p-1 of sequences 1..b-1 (ascending)."""
    pos = torch.arange(int(p), device=device)[:, None] * b
    return (pos + torch.arange(1, b, device=device)[None, :]).reshape(-1)


def _kept_rows(p: int, s: int, b: int, device) -> torch.Tensor:
    """bool [s b]: the rows a ``prefix`` = 1 message codes (every row but :func:`_prefix_rows`)."""
    keep = torch.ones(s * b, dtype=torch.bool, device=device)
    keep[_prefix_rows(p, b, device)] = False
    return keep


class PrefixRows:
    """Mixin of :class:`~megatron_cegrpo.compression.subspace.SubspaceQuantHalf`: the row
    selection (outliers, a shared sink, the common prefix) and the coefficient payload over the
    coded rows (module docstring). ``prefix`` = 0 keeps every method to the layout without it."""

    prefix: int

    def _init_prefix(self, prefix: int) -> None:
        """Validate and set ``prefix``. Raises ValueError: not 0 or 1, or 1 on a half without a
        per-step basis (``lrq``, ``rpq``) or with ``sink`` = 1 (a pcaq backward half is refused by
        ``BoundaryCodec``: gradients differ per sequence)."""
        if int(prefix) not in (0, 1) or (int(prefix) and (self.refresh != "step" or self.sink)):
            raise ValueError(f"{self.name}/prefix={prefix}: prefix=1 codes the sequences' common prefix once (the "
                             f"forward half pcaq; it sends position 0 once already, so not with sink=1); "
                             f"fix: pcaq/prefix=1 (or prefix=0)")
        self.prefix = int(prefix)

    def prefix_coef_bits(self, shape, elem: int, p: int) -> Tuple[int, int]:
        """(N', B') for a message of ``shape`` whose first ``p`` positions are coded once: N' =
        p + (s - p) b coded rows sharing the coefficient bytes of s b rows at ``coef_bits``, B' =
        min(max_bits r, floor(8 ceil(s b B / 8) / N')) bits a row (p = 0: N' = s b and B' = B when
        s b >= 8)."""
        s, b, d = _check_shape(shape)
        bits = self.coef_bits(shape, elem)
        n = int(p) + (s - int(p)) * b
        cap = 8 * packed_nbytes(s * b, bits)
        return n, min(self.max_bits * self.basis_rows(shape, elem), cap // max(n, 1))

    def _select_rows(self, x: torch.Tensor, shape) -> Tuple[int, bool, torch.Tensor, torch.Tensor]:
        """Which rows of a message ``x`` [s b, d] (fp32, s-major) are coded how: (p, the common
        prefix with ``prefix`` = 1, else 0; whether position 0 is one shared row with ``sink`` = 1;
        the outlier rows sent whole, int64 ascending; every row that leaves the basis fit and the
        coefficients: outliers, a shared sink's b rows, the prefix copies of sequences 1..b-1)."""
        s, b, d = _check_shape(shape)
        norms, zero = x.norm(dim=-1), [torch.zeros(0, dtype=torch.long, device=x.device)]
        p, shared = 0, False
        if self.prefix:  # positions 0..p-1 of sequences 1..b-1 are sequence 0's rows: not coded
            p = common_prefix(x.view(s, b, d))
            zero.append(_prefix_rows(p, b, x.device))
        if self.sink:  # rows 0..b-1 of the s-major [N, d] view: position 0 of each sequence
            shared = bool((x[:b] == x[0]).all())  # checked, not assumed
            if shared:
                zero.append(torch.arange(b, device=x.device))
        zero = torch.cat(zero)
        norms = norms.index_fill(0, zero, -1.0)  # neither is an outlier
        out_idx = torch.sort(torch.topk(norms, self.outlier_count(shape)).indices).values
        # outliers (and a shared sink) leave the basis and the column scales: the basis is fit with
        # their rows zeroed and their coefficient rows are zero (rows of x v^T are independent)
        return p, shared, out_idx, torch.cat([zero, out_idx])

    def _quantize_rows(self, coef: torch.Tensor, lam: List[float], shape, elem: int, p: int) -> List[torch.Tensor]:
        """The coefficient fields of a message: ``coef`` fp32 [s b, r] quantised at ``coef_bits``
        (``prefix`` = 0), or its coded rows at :meth:`prefix_coef_bits` and zero bytes up to the
        fixed size; uint8 tensors."""
        s, b, d = _check_shape(shape)
        if not self.prefix:
            return [quantize_coefficients(coef, lam, self.coef_bits(shape, elem), self.max_bits, self.rd)]
        _, bits = self.prefix_coef_bits(shape, elem, p)
        payload = quantize_coefficients(coef[_kept_rows(p, s, b, coef.device)], lam, bits, self.max_bits, self.rd)
        room = 4 * len(lam) + packed_nbytes(s * b, self.coef_bits(shape, elem)) - payload.numel()
        return [payload, torch.zeros(room, dtype=torch.uint8, device=coef.device)]

    def _read_prefix(self, reader: ByteReader, s: int) -> int:
        """p from a ``prefix`` = 1 payload's header (0 without ``prefix``). Raises ValueError if it
        is not within the message's s positions (a corrupt or mismatched payload)."""
        if not self.prefix:
            return 0
        p = int(reader.take_as((1,), torch.int32)[0])
        if not 0 <= p <= s:
            raise ValueError(f"{self.name}/prefix=1: the payload's common prefix {p} is not within the message's "
                             f"{s} positions (a corrupt or mismatched payload)")
        return p

    def _dequantize_rows(self, reader: ByteReader, lam: List[float], v: torch.Tensor, shape, elem: int,
                         p: int) -> torch.Tensor:
        """fp32 [s b, d]: the decoded coefficients times the basis ``v`` fp32 [r, d] at the coded
        rows, zero at the prefix copies (the caller copies sequence 0's rows there)."""
        s, b, d = _check_shape(shape)
        if not self.prefix:
            return dequantize_coefficients(reader, s * b, lam, self.coef_bits(shape, elem), self.max_bits, self.rd,
                                           device=v.device) @ v
        n, bits = self.prefix_coef_bits(shape, elem, p)
        c_hat = dequantize_coefficients(reader, n, lam, bits, self.max_bits, self.rd, device=v.device)
        out = torch.zeros((s * b, d), dtype=torch.float32, device=v.device)
        out[_kept_rows(p, s, b, v.device)] = c_hat @ v
        return out
