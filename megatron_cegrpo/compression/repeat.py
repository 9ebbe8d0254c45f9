"""``rpq``: a forward half that spends an iteration's bytes on the FIRST crossing of each micro-batch.

Issue 10, item 4 (a forward codec that beats ``pcaq`` at the same total bytes). Observation: a
GRPO iteration sends every micro-batch's boundary activations forward several times (the
old-logprob pass, the reference pass with ``--kl-coef > 0``, the update pass; ``train.py``
counts ``1 + [kl > 0] + ppo_epochs`` passes), and with one optimizer step per iteration the
update pass sends bit-for-bit the same tensor as the old-logprob pass (same weights, same
tokens). ``pcaq`` pays the full per-message budget every time. ``rpq`` keys each message on
(boundary, step, sample ids, shape), which both ends know before any byte arrives
(``BoundaryContext``), and codes

* the **first** crossing of a key in a step with ``pcaq``'s transform coder (per-step PCA
  basis sent once per (boundary, step) on its first message, the ``outliers`` largest-norm
  tokens per sequence whole in fp16, bit-allocated coefficients; ``subspace.py``) but with the
  budget of ALL the key's crossings, ``passes * keep_ratio`` less what the later crossings use;
* every **later** crossing of that key as the difference ``delta = x - x_first`` to the sender's
  raw tensor of the first crossing, coded on the same step basis with the small budget
  ``repeat`` (fraction of the dense bytes) and decoded as ``x_hat_first + delta_hat``. When the
  tensor is unchanged (the update pass of a one-step iteration) ``delta = 0``, every column
  scale is 0 and the receiver decodes exactly ``x_hat_first``: the update pass sees the
  old-logprob pass's boundary bit for bit (PPO ratio exactly 1). When it changed (the
  reference model, a later PPO epoch or mini-batch) the change is coded, coarsely.

Both ends keep ``x_hat_first`` per key (the receiver from its decode; the sender decodes its own
payload with the receiver's code only when ``decode_sent`` asks, i.e. the error tracker: off the
critical path otherwise), the sender also ``x_first``; only the latest step per boundary is kept
(about 2 x 15 MB per boundary at the 128-token rollout shape's 32 x 199 x 576 fp32).

Bytes of one message of N = s * b tokens (d channels, r basis rows, K = outliers * b outlier
tokens, dense bytes D = N * d * elem, everything padded once to whole wire elements)::

    later crossing (repeat)       4 r + ceil(N * B_rep / 8)
        B_rep = min(max_bits r, max(0, floor(8 * (floor(repeat * D) - 4 r) / N)))
    first crossing                K (2 d + 4) + 4 r + ceil(N * B_1 / 8)  [+ r (2 d + 4) basis,
                                  on the first message of the (boundary, step)]
        A   = floor(passes * keep_ratio * D) - (passes - 1) * (repeat bytes, unpadded)
        B_1 = min(max_bits r, floor(8 * (A * (1 - share) - 4 r - K (2 d + 4)) / N))

so a key's ``passes`` crossings take at most ``passes * keep_ratio * D`` bytes plus its share
of the basis, which is paid from the ``share`` reserved on the step's first crossings. The
start-up check (``spec.check_codec_budget`` via ``spec_bytes``) counts one first crossing per
micro-batch of the update pass and the rest as repeats, against the exact-k mask's bytes of
all forward messages: a run with fewer passes than ``passes`` (``--kl-coef 0``: 2) is rejected
until ``passes`` is lowered. If a step re-sends fewer times than planned the run simply uses
fewer bytes; if a key's shape changes, its crossing counts as a first one (the meter, measured
from the payloads, is the truth: ``comm/bytes_ratio``).

Not unbiased (truncation, deterministic rounding) and no chain rule; as the forward half of a
pair the backward is the backward half's compressed gradient, straight-through (``codecs.py``).

Pure tensor code: no torch.distributed.
"""

from __future__ import annotations

import math

import torch

from .codecs import _check_shape
from .halves import register_half
from .quant import allocate_bits, dequantize_columns, quantize_columns
from .subspace import SubspaceQuantHalf, _dtype_of
from .wire import ByteReader, bytes_to_wire, packed_nbytes, tensor_bytes, wire_numel, wire_to_bytes

__all__ = ["RepeatPcaHalf"]


class _Lazy:
    """A value computed on first use (the sender's own decode, wanted only by decode_sent)."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn):
        self._fn, self._value = fn, None

    def get(self):
        if self._fn is not None:
            self._value, self._fn = self._fn(), None
        return self._value


@register_half("rpq")
class RepeatPcaHalf(SubspaceQuantHalf):
    """``rpq`` (module docstring): first crossing of a micro-batch coded with the budget of all
    its crossings, later crossings as a coded difference to the first.

    Args:
        keep_ratio: byte budget per message, fraction of the dense bytes, in (0, 1].
        rank: basis rows r (>= 1; at most d).
        share: fraction of a first crossing's budget reserved for the per-step basis, [0, 1).
        max_bits: cap of bits per coefficient column, 1..16.
        outliers: tokens per sequence sent whole in fp16 on a first crossing, >= 0.
        passes: crossings per micro-batch and step the budget is planned for (>= 1; 3 = the
            demo: old-logprob, reference, update).
        repeat: budget of a later crossing, fraction of the dense bytes, [0, keep_ratio].
        own: 1 (default): every first crossing carries its own basis; 0: one basis per step.
        warm: subspace iterations of a warm-started basis (``SubspaceQuantHalf``; 0 = a fresh
            eigh per basis, the default; ``rpq/warm=1``: one x^T (x V_prev) product and a QR).
        lag: 1 sends the basis built off the critical path from the previous first crossing
            (``SubspaceQuantHalf``; needs warm >= 1; ``rpq/passes=2/warm=1/lag=1``).
    Raises:
        ValueError: parameters out of range; at encode/decode a shape whose first-crossing
        budget leaves no coefficient bits.
    """

    refresh = "step"

    PARAMS = {"rank": int, "share": float, "max_bits": int, "outliers": int, "passes": int, "repeat": float,
              "own": int, "warm": int, "lag": int}

    def __init__(self, keep_ratio: float = 0.05, rank: int = 144, share: float = 0.12, max_bits: int = 8,
                 outliers: int = 1, passes: int = 3, repeat: float = 0.002, own: int = 1, warm: int = 0,
                 lag: int = 0):
        super().__init__(keep_ratio=keep_ratio, rank=rank, share=share, max_bits=max_bits, outliers=outliers,
                         warm=warm, lag=lag)
        if int(passes) < 1 or not 0.0 <= float(repeat) <= float(keep_ratio) or int(own) not in (0, 1):
            raise ValueError(f"rpq: need passes >= 1, 0 <= repeat <= keep_ratio, own 0 or 1; got {passes}, "
                             f"{repeat}, {own}")
        self.passes, self.repeat, self.own = int(passes), float(repeat), int(own)
        if self.own:  # every first crossing carries its own basis: nothing reserved, nothing kept per step
            self.refresh, self.share = "microbatch", 0.0
        # per role: boundary -> (step, {key: (x_hat_first, x_first or None)})
        self._firsts = {"send": {}, "recv": {}}
        self._last_sent = None  # (payload, x_hat) of the latest encode, for decode_sent

    # ---- sizes ---------------------------------------------------------------------------
    #: with ``own``, the basis of a first crossing takes at most this fraction of its
    #: ``floor(passes * keep_ratio * D)`` bytes (r shrinks below ``rank`` on short micro-batches)
    BASIS_CAP = 0.75

    def basis_rows(self, shape, elem: int) -> int:
        """r for a message of ``shape``: ``min(rank, d)``; with ``own`` also at most
        ``floor(BASIS_CAP * floor(passes * keep_ratio * D) / (2 d + 4))`` (>= 1), so that a short
        micro-batch (few tokens N) keeps a quarter of its first crossing for coefficients instead
        of leaving none: at rank 144 and d = 576 that binds below N = 964 tokens with 2 passes (643 with 3) on an fp32 wire, e.g.
        the study's 4 x 144-token micro-batches get r = 86. Longer micro-batches are unaffected."""
        r = super().basis_rows(shape, elem)
        if not self.own:
            return r
        s, b, d = _check_shape(shape)
        cap = math.floor(self.BASIS_CAP * math.floor(self.passes * self.keep_ratio * s * b * d * elem) / (2 * d + 4))
        return max(1, min(r, cap))

    def repeat_bits(self, shape, elem: int) -> int:
        """B_rep, coefficient bits per token of a later crossing (>= 0)."""
        s, b, d = _check_shape(shape)
        r = self.basis_rows(shape, elem)
        avail = math.floor(self.repeat * s * b * d * elem) - 4 * r
        return max(0, min(self.max_bits * r, math.floor(8 * avail / max(s * b, 1))))

    def _repeat_raw(self, shape, elem: int) -> int:
        s, b, d = _check_shape(shape)
        return 4 * self.basis_rows(shape, elem) + packed_nbytes(s * b, self.repeat_bits(shape, elem))

    def budget(self, shape, elem: int) -> int:
        """A, bytes of a first crossing before the basis share: floor(passes * keep_ratio * D)
        less the (passes - 1) later crossings' unpadded bytes."""
        s, b, d = _check_shape(shape)
        return (math.floor(self.passes * self.keep_ratio * s * b * d * elem)
                - (self.passes - 1) * self._repeat_raw(shape, elem))

    def coef_bits(self, shape, elem: int) -> int:
        """B_1, coefficient bits per token of a first crossing (ValueError if < 1); with
        ``own`` the crossing's own basis r (2 d + 4) is paid from its budget."""
        if not self.own:
            return super().coef_bits(shape, elem)
        s, b, d = _check_shape(shape)
        r = self.basis_rows(shape, elem)
        avail = self.budget(shape, elem) - r * (2 * d + 4) - 4 * r - self.outlier_count(shape) * (2 * d + 4)
        bits = math.floor(8 * avail / max(s * b, 1))
        if bits < 1:
            raise ValueError(f"rpq: keep ratio {self.keep_ratio} x passes {self.passes} leaves no coefficient bits "
                             f"for shape {shape}")
        return min(bits, self.max_bits * r)

    def nbytes(self, shape, elem, first_of_step, repeat: bool = False):
        """Wire bytes of one message: a later crossing (``repeat``), else a first crossing,
        with the basis when ``first_of_step`` (module docstring)."""
        raw = self._repeat_raw(shape, elem) if repeat else None
        if raw is None:
            return super().nbytes(shape, elem, first_of_step)
        return wire_numel(raw, _dtype_of(elem)) * elem

    def step_nbytes(self, shape, elem: int, messages: int, keys: int) -> int:
        """Documented forward bytes of one step of ``messages`` crossings of ``keys`` distinct
        micro-batches of ``shape`` (the first crossing of the step carries the basis)."""
        messages, keys = int(messages), min(int(keys), int(messages))
        if messages <= 0:
            return 0
        return (self.nbytes(shape, elem, True) + (keys - 1) * self.nbytes(shape, elem, False)
                + (messages - keys) * self.nbytes(shape, elem, False, repeat=True))

    def wire_shape(self, shape, ctx, dtype, role):
        elem = torch.empty((), dtype=dtype).element_size()
        key, repeat = self._key(ctx, shape), False
        step_of, firsts = self._firsts[role].get(ctx.boundary, (None, {}))
        repeat = step_of == ctx.step and key in firsts
        first = not repeat and self._carries_basis((ctx.boundary, ctx.step), role)
        return (self.nbytes(shape, elem, first, repeat=repeat) // elem,)

    # ---- state ---------------------------------------------------------------------------
    @staticmethod
    def _key(ctx, shape):
        return (int(ctx.step), tuple(int(i) for i in ctx.sample_ids.reshape(-1).tolist()), tuple(int(v) for v in shape))

    def _lookup(self, role, ctx, shape):
        step_of, firsts = self._firsts[role].get(ctx.boundary, (None, {}))
        return firsts.get(self._key(ctx, shape)) if step_of == ctx.step else None

    def _store(self, role, ctx, shape, value):
        step_of, firsts = self._firsts[role].get(ctx.boundary, (None, {}))
        if step_of != ctx.step:
            firsts = {}
            self._firsts[role][ctx.boundary] = (ctx.step, firsts)
        firsts[self._key(ctx, shape)] = value

    def reset(self):
        super().reset()
        for store in self._firsts.values():
            store.clear()
        self._last_sent = None

    # ---- codec ---------------------------------------------------------------------------
    def encode(self, t, ctx):
        """Sender: first crossing (pcaq layout with the larger budget) or later crossing (coded
        delta to the first); remembers what the receiver will decode."""
        shape = _check_shape(t.shape)
        s, b, d = shape
        elem = t.element_size()
        x = t.detach().reshape(-1, d).float()
        prev = self._lookup("send", ctx, shape)
        if prev is None:
            payload, carried, v, lam = self._encode_first(x, ctx, shape, elem, t.dtype)
            # the sender's decode is needed only by decode_sent (the error tracker): done on demand
            x_hat = _Lazy(lambda: self._decode_first(payload, ctx, shape, "send", carried, basis=(v, lam))[0])
            self._store("send", ctx, shape, (x_hat, v, lam, x.clone()))
        else:
            x_hat_first, v, lam, x_first = prev
            bits = allocate_bits(lam, self.repeat_bits(shape, elem), self.max_bits)
            coef, _ = quantize_columns((x - x_first) @ v.t(), bits, return_hat=False)
            payload = bytes_to_wire([coef], t.dtype)
            x_hat = _Lazy(lambda: self._decode_repeat(payload, shape, prev))
        self._last_sent = (payload, x_hat)
        return payload

    def _encode_first(self, x, ctx, shape, elem, dtype):
        key, parts = (ctx.boundary, ctx.step), []
        idx = torch.sort(torch.topk(x.norm(dim=-1), self.outlier_count(shape)).indices).values
        parts += [tensor_bytes(idx.to(torch.int32)), tensor_bytes(x[idx].half())]
        # outliers leave the basis and the column scales (SubspaceQuantHalf.encode)
        carried, coef = self._carries_basis(key, "send"), None
        if carried:
            v16, lam, coef = self._fit_basis(x, idx, self.basis_rows(shape, elem), ctx.boundary)
            parts += [tensor_bytes(v16), tensor_bytes(lam)]
            v, lam_list = v16.float(), lam.tolist()
            if not self.own:
                self._remember("send", key, (v, lam_list))
        else:
            v, lam_list = self._state["send"][key]
        bits = allocate_bits(lam_list, self.coef_bits(shape, elem), self.max_bits)
        if coef is None:
            coef = (x @ v.t()).index_fill_(0, idx, 0.0)
        payload, _ = quantize_columns(coef, bits, return_hat=False)
        return bytes_to_wire(parts + [payload], dtype), carried, v, lam_list

    def decode(self, payload, ctx, shape):
        """Receiver: decode and remember a first crossing; a later one adds its decoded delta."""
        shape = _check_shape(shape)
        prev = self._lookup("recv", ctx, shape)
        if prev is None:
            out, v, lam = self._decode_first(payload, ctx, shape, "recv", self._carries_basis(
                (ctx.boundary, ctx.step), "recv"))
            self._store("recv", ctx, shape, (out, v, lam, None))
        else:
            out = self._decode_repeat(payload, shape, prev)
        return out.view(shape).to(payload.dtype)

    def decode_sent(self, payload, ctx, shape):
        """Sender: what the receiver decodes from the payload just encoded (kept by
        :meth:`encode`; receive-side state untouched).

        Raises:
            ValueError: ``payload`` is not the latest encoded one.
        """
        if self._last_sent is not None and (self._last_sent[0] is payload or torch.equal(self._last_sent[0], payload)):
            return self._last_sent[1].get().view(_check_shape(shape)).to(payload.dtype)
        raise ValueError("rpq.decode_sent: not the payload of the latest encode")

    def _decode_repeat(self, payload, shape, prev):
        """x_hat_first + decoded delta, [N, d] fp32 (both roles)."""
        s, b, d = shape
        x_hat_first, v, lam = prev[:3]
        x_hat_first = x_hat_first.get() if isinstance(x_hat_first, _Lazy) else x_hat_first
        bits = allocate_bits(lam, self.repeat_bits(shape, payload.element_size()), self.max_bits)
        return x_hat_first + dequantize_columns(ByteReader(wire_to_bytes(payload)), s * b, bits,
                                                device=payload.device) @ v

    def _decode_first(self, payload, ctx, shape, role, carries: bool, basis=None):
        """(x_hat [N, d] fp32, basis v [r, d] fp32, variances list) of a first crossing; both
        roles run this code. ``carries``: the payload holds a basis (read from it; at the
        receiver of a per-step basis it is remembered for the step). ``basis``: (v, lam) the
        sender already holds (its bytes in the payload are skipped)."""
        s, b, d = shape
        elem = payload.element_size()
        reader = ByteReader(wire_to_bytes(payload))
        key = (ctx.boundary, ctx.step)
        r, k = self.basis_rows(shape, elem), self.outlier_count(shape)
        idx = reader.take_as((k,), torch.int32).to(payload.device).long()
        rows = reader.take_as((k, d), torch.float16).to(payload.device).float()
        if carries and basis is not None:
            reader.take(r * (2 * d + 4))
            v, lam = basis
        elif carries:
            v = reader.take_as((r, d), torch.float16).to(payload.device).float()
            lam = reader.take_as((r,), torch.float32).tolist()
            if role == "recv" and not self.own:
                self._remember("recv", key, (v, lam))
        else:
            v, lam = basis if basis is not None else self._state[role][key]
        bits = allocate_bits(lam, self.coef_bits(shape, elem), self.max_bits)
        c_hat = dequantize_columns(reader, s * b, bits, device=payload.device)
        return (c_hat @ v).index_copy_(0, idx, rows), v, lam
