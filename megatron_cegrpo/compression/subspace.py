"""Subspace halves: a sent PCA basis and bit-allocated quantised coefficients.

Issue 10, item 4 ("a subspace basis with quantized coefficients forward ... sent and
amortised, and counted"; "a low-rank ... activation-gradient backward"). Transform coding:
rotate each token's d-vector onto the top-r right singular vectors V [r, d] of the sender's
data (KLT/PCA, uncentred, so the mean direction is one of them), quantise the r coefficients
with an integer bit allocation driven by the singular values (``quant.py``), and decode
``x_hat = c_hat V``. The basis is computed by the SENDER and SENT (fp16 rows, or with pcaq's
``basis_bits=8`` int8 rows and a scale each, and fp32 variances lambda_j = sigma_j**2 / N); the
sender uses the same rounded basis, so both ends decode bit-identical tensors. Nothing is
derived at the receiver except the bit allocation, a deterministic function of the sent
variances and the message shape.

Two refresh policies:

* ``pcaq`` (refresh="step", the forward half): one basis per (boundary, step), computed from
  the first micro-batch that crosses the boundary in that step (with ``ema``, from the sender's
  history of every message; with ``prepass``, from every message of the step: ``history.py``)
  and carried by that message only; every later
  message of the step (other micro-batches, the reference and update passes) reuses it. Its
  cost is amortised over the step's messages and counted by the meter.
* ``lrq`` (refresh="microbatch", the backward half): a fresh basis of each message's own
  data in every message (PowerSGD's rank-r projection without warm start; Vogels et al.,
  NeurIPS 2019), so nothing is kept across messages.

Bytes of one message of N = s * b tokens, r basis rows, B coefficient bits per token,
elem = the wire dtype's element size (everything padded once to whole elements)::

    basis (pcaq: first message of the step; lrq: every message)   r * (2 d + 4)
      (pcaq/basis_bits=8: int8 rows, an fp32 scale each)           r * (d + 8)
    common prefix length p (pcaq/prefix=1: int32, ``prefix.py``)  4
    shared sink (pcaq/sink=1: a flag byte + position 0 in fp16)   2 d + 1
    outlier tokens (index int32 + the token in fp16)              K * (2 d + 4)
    column scales (fp32)                                          4 r
    coefficients                                                  ceil(N * B / 8)
      (pcaq/prefix=1: N' = p + (s - p) b coded rows share these bytes, ``prefix.py``)

Outliers: the K = outliers * b tokens of largest norm in the message (``outliers`` per
sequence: default 1 for pcaq, 0 for lrq) are sent whole in fp16 and left out of the basis and
the column scales: SmolLM2's residual stream has one token per sequence with a ~150x larger
norm (the attention sink), which otherwise sets every column's quantisation step (measured
on a SmolLM2 batch: relative error of the other tokens 0.11-0.18 without, 0.02-0.09 with).

Budget (per message, ``budget = floor(keep_ratio * N * d * elem)`` bytes):

* pcaq: B = min(max_bits r, floor(8 * (budget * (1 - share) - 4 r - K (2 d + 4) - sink (2 d + 1) - 4 prefix) / N));
  with ``prefix`` = 1 the N' coded rows share those bytes (``prefix.py``); the basis is paid from the reserved
  ``share`` of the budget of the step's other messages (start-up check: ``spec.py``).
* lrq:  r = min(rank, d, N, floor(budget / (2 (2 d + 8)))),
  B = min(max_bits r, floor(8 * (budget - r (2 d + 8) - K (2 d + 4)) / N)).

Both are biased (truncation to r directions and deterministic rounding): not unbiased
estimators, and no chain rule: see ``codecs.py`` for what the backward of a pair is.

Pure tensor code: no torch.distributed.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Tuple

import torch

from .codecs import _check_shape
from .halves import DirectionCodec, register_half
from .history import BasisHistory, project_sorted
from .prefix import PrefixRows
from .wire import ByteReader, bytes_to_wire, packed_nbytes, tensor_bytes, wire_numel, wire_to_bytes

__all__ = ["SubspaceQuantHalf", "PcaQuantHalf", "LowRankQuantHalf", "top_basis", "warm_basis", "MAX_WARM"]

#: the largest ``warm`` (subspace iterations per basis) a half accepts
MAX_WARM = 4

_BACKGROUND: Optional[ThreadPoolExecutor] = None


def _background() -> ThreadPoolExecutor:
    """The one worker thread that runs lagged basis updates (``lag=1``) off the critical path;
    torch's kernels release the GIL, so it overlaps the caller's layer compute."""
    global _BACKGROUND
    if _BACKGROUND is None:
        _BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cegrpo-basis")
    return _BACKGROUND


def _count_bad(x: torch.Tensor) -> int:
    """NaN and infinite entries of ``x``."""
    return int((~torch.isfinite(x)).sum())


def _eigh_ascending(g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of the symmetric PSD Gram matrix ``g`` [m, m] (fp32), eigenvalues ascending.

    ``torch.linalg.eigh`` (LAPACK syevd) first; where it fails to converge (``LinAlgError``,
    seen in the study on the Gram of a [512, 576] activation gradient whose rows were mostly
    zero: "too many repeated eigenvalues", error code 262634) it retries in fp64, then takes the
    SVD of ``g`` (for a PSD matrix its singular vectors are eigenvectors and its singular values
    the eigenvalues; ``torch.linalg.svd``, a different LAPACK routine, gesdd).

    Returns:
        (evals fp32 [m] ascending, evecs fp32 [m, m], column j for evals[j]).
    Raises:
        torch.linalg.LinAlgError: all three fail (not seen on a finite input).
    """
    try:
        return torch.linalg.eigh(g)
    except torch.linalg.LinAlgError:
        pass
    try:
        evals, evecs = torch.linalg.eigh(g.double())
        return evals.float(), evecs.float()
    except torch.linalg.LinAlgError:
        u, sv, _ = torch.linalg.svd(g.double())  # descending
        return sv.flip(0).float(), u.flip(1).float()


def top_basis(x: torch.Tensor, r: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-r right singular vectors of ``x`` [N, d] (uncentred) and the variances sigma**2 / N.

    Computed as the top-r eigenpairs (``torch.linalg.eigh``, fp32) of the smaller Gram matrix of
    the nonzero rows x' [N', d] of x (zero rows add nothing to x^T x; in x x^T they add repeated
    zero eigenvalues, on which LAPACK's eigh can fail to converge): x'^T x' [d, d] when N' >= d,
    else x' x'^T [N', N'] with v = u^T x' / sigma. x is first scaled by a power of two (exact)
    so that its largest entry is about 1, so the Gram neither overflows nor underflows in fp32.
    Issue 10 item 6: at [1024, 576] on one CPU thread this is 2-3x faster than the full
    ``torch.linalg.svd`` of x it replaces, with the same reconstruction error of the fp16 basis
    to 6 digits (``benchmarks/bench_basis.py``). Row signs are arbitrary (as with an SVD); the
    basis is sent, so both ends use the same one.

    Args:
        x: [N, d], any float dtype (computed in fp32).
        r: basis rows, >= 1.
    Returns:
        (v, lam): v fp16 [r, d] (rows beyond the rank, min(N', d), are zero, and so are rows of a
        zero singular value when N' < d), lam fp32 [r] >= 0 (zero there too); an all-zero x
        gives all zeros.
    Raises:
        FloatingPointError: x holds a NaN or an infinity (a diverged step upstream; no basis
            of it exists), naming the count.
    """
    x = x.float()
    n, d = x.shape
    v = torch.zeros((r, d), dtype=torch.float32, device=x.device)
    lam = torch.zeros(r, dtype=torch.float32, device=x.device)
    if n == 0 or d == 0:
        return v.half(), lam
    amax = float(x.abs().amax())
    if not math.isfinite(amax):
        raise FloatingPointError(f"top_basis: the [{n}, {d}] boundary tensor holds {_count_bad(x)} NaN/inf values "
                                 "(a diverged step: lower --lr or check the loss); no basis of it exists")
    if amax == 0.0:
        return v.half(), lam
    scale = 2.0 ** math.floor(math.log2(amax))  # exact in fp32
    nz = (x != 0).any(dim=1)
    xs = (x[nz] if not bool(nz.all()) else x) / scale
    n_nz = xs.shape[0]
    m = min(int(r), n_nz, d)
    if m:
        if n_nz >= d:
            evals, evecs = _eigh_ascending(xs.t() @ xs)  # ascending
            v[:m] = evecs[:, -m:].flip(1).t()
            lam[:m] = evals[-m:].flip(0).clamp_min(0) * (scale * scale / n)
        else:
            evals, u = _eigh_ascending(xs @ xs.t())
            sig = evals[-m:].flip(0).clamp_min(0).sqrt()
            keep = sig > sig[0] * (n_nz * torch.finfo(torch.float32).eps) if float(sig[0]) > 0 else sig > 0
            rows = (u[:, -m:].flip(1).t() @ xs) / torch.where(keep, sig, torch.ones_like(sig))[:, None]
            v[:m] = torch.where(keep[:, None], rows, torch.zeros_like(rows))
            lam[:m] = torch.where(keep, sig * sig * (scale * scale / n), torch.zeros_like(sig))
    return v.half(), lam


def warm_basis(x: torch.Tensor, v_prev: torch.Tensor, r: int, iters: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-r basis of ``x`` [N, d] by ``iters`` subspace iterations warm-started at ``v_prev``.

    PowerSGD's warm-started power step (Vogels et al., "PowerSGD: Practical Low-Rank Gradient
    Compression for Distributed Optimization", NeurIPS 2019, Algorithm 1: P = M Q_prev,
    orthogonalise, Q = M^T P) applied to the Gram matrix: per iteration Y = x^T (x Q) [d, r]
    and Q = qr(Y) (Householder, ``torch.linalg.qr``; robust to a rank-deficient Y), then one
    Rayleigh-Ritz step (Golub & Van Loan, Matrix Computations, 4th ed., sec. 8.3.7 / 10.1.3):
    C = x Q [N, r], eigh of C^T C [r, r], rotate Q onto its eigenvectors so that the returned
    rows are sorted by variance and the coefficients are decorrelated, as ``top_basis``'s.
    Cost (N >= d): (2 iters + 1) N d r + O(d r^2 + r^3) multiply-adds instead of ``top_basis``'s
    N d^2 Gram and d x d eigh (at N = 1024, d = 576, r = 144 and 1 iteration about the Gram's
    cost and no d x d eigh). Converges to ``top_basis``'s subspace at the rate
    (lambda_{r+1} / lambda_r)^iters per call; from a basis of similar data (the previous
    micro-batch, step) one iteration already captures nearly the top-r energy (tests,
    ``docs/codecs.md``).

    Args:
        x: [N, d], any float dtype (computed in fp32).
        v_prev: [r_prev, d] previous basis (any float dtype, rows need not be orthonormal);
            only its first min(r, r_prev) rows are used; missing rows (r > r_prev) start from a
            fixed-seed Gaussian (seed 0), so the result is a deterministic function of the inputs.
        r: basis rows, >= 1.
        iters: subspace iterations, >= 1.
    Returns:
        (v, lam) as ``top_basis``: v fp16 [r, d] (rows beyond min(N, d) zero), lam fp32 [r] >= 0,
        lam_j = ||x v_j||^2 / N of the returned (unrounded) rows.
    Raises:
        ValueError: ``v_prev``'s width is not d, or r / iters < 1.
        FloatingPointError: x holds a NaN or an infinity, or its Gram overflows fp32.
    """
    x = x.float()
    n, d = x.shape
    if v_prev.dim() != 2 or v_prev.shape[1] != d or int(r) < 1 or int(iters) < 1:
        raise ValueError(f"warm_basis: need v_prev [r_prev, {d}], r >= 1, iters >= 1; got {tuple(v_prev.shape)}, "
                         f"{r}, {iters}")
    v = torch.zeros((r, d), dtype=torch.float32, device=x.device)
    lam = torch.zeros(r, dtype=torch.float32, device=x.device)
    m = min(int(r), n, d)
    q = v_prev[:m].float().t().to(x.device)  # [d, m']
    if q.shape[1] < m:
        g = torch.Generator().manual_seed(0)
        q = torch.cat([q, torch.randn((d, m - q.shape[1]), generator=g).to(x.device)], dim=1)
    for _ in range(int(iters)):
        q = torch.linalg.qr(x.t() @ (x @ q)).Q  # [d, m]
    c = x @ q  # [N, m]
    gram = c.t() @ c
    if not bool(torch.isfinite(gram).all()):
        raise FloatingPointError(f"warm_basis: the [{n}, {d}] boundary tensor holds {_count_bad(x)} NaN/inf values, "
                                 "or its Gram overflows fp32 (a diverged step: lower --lr or check the loss)")
    evals, w = _eigh_ascending(gram)  # ascending, [m]
    v[:m] = (q @ w.flip(1)).t()
    lam[:m] = evals.flip(0).clamp_min(0) / n
    return v.half(), lam


class _WarmBasisFitting:
    """The sender's basis fitting of :class:`SubspaceQuantHalf`: a fresh ``top_basis``, or with
    ``warm`` > 0 warm-started subspace iterations from the previous basis at the boundary, on the
    critical path (``lag`` = 0) or on a background thread one message behind (``lag`` = 1). The
    attributes it uses (``warm``, ``lag``, ``rank``, ``_warm_basis``, ``_pending``,
    ``background_s``, ``background_jobs``) are set by :class:`SubspaceQuantHalf`'s constructor."""

    def _fit_basis(self, x: torch.Tensor, idx: torch.Tensor, r: int, boundary: int):
        """The sender's basis of ``x`` [N, d] fp32 with the outlier rows ``idx`` (int64 [K])
        zeroed: ``top_basis`` (``warm`` = 0, or no earlier basis of this width at ``boundary``),
        else ``warm_basis`` from the previous one (``lag`` = 0) or the basis the background
        thread built from the previous message (``lag`` = 1); remembers the fp16-rounded result
        per boundary when ``warm`` > 0. ``x`` itself is not written. Returns (v fp16 [r, d],
        lam fp32 [r], coefficients fp32 [N, r] with zero rows at ``idx``, or None when the
        caller has to project); with ``ema`` > 0 the sender's history's basis (``history.py``)."""
        if self.ema:
            return self._fit_history(x, idx, r, boundary)
        if not self.warm:
            return top_basis(_zero_rows(x, idx), r) + (None,)
        boundary = int(boundary)
        if self.lag:
            return self._fit_lagged(x, idx, r, boundary)
        prev = self._warm_basis.get(boundary)
        if prev is None or prev.shape[1] != x.shape[1]:
            v16, lam = top_basis(_zero_rows(x, idx), r)
        else:
            v16, lam = warm_basis(_zero_rows(x, idx), prev, r, self.warm)
        self._warm_basis[boundary] = v16.float()
        return v16, lam, None

    def _fit_lagged(self, x: torch.Tensor, idx: torch.Tensor, r: int, boundary: int):
        """``lag`` = 1: send the basis finished off the critical path, then start the next one.

        The background job keeps min(rank, d) rows (a later message whose shape allows more
        rows than this one takes a prefix: the rows are sorted by the previous data's variance);
        a stored basis of another width or with fewer than r rows gives a fresh ``top_basis``."""
        self._settle(boundary)
        nxt = self._warm_basis.get(boundary)
        d = x.shape[1]
        if nxt is None or nxt.shape[1] != d or nxt.shape[0] < r:
            v16, lam = top_basis(_zero_rows(x, idx), r)
            coef, v_prev = None, v16.float()
        else:
            v_prev = nxt
            v16, lam, coef = project_sorted(x, idx, nxt[:r].half())  # sorted by this message's variances
        warm, r_job = self.warm, max(int(r), min(self.rank, d))

        def job():
            t0 = time.thread_time()
            v_next, _ = warm_basis(_zero_rows(x, idx), v_prev, r_job, warm)
            return v_next.float(), time.thread_time() - t0

        # reads x (the caller's boundary tensor, which the pipeline does not write after the send)
        self._pending[boundary] = _background().submit(job)
        return v16, lam, coef

    def _settle(self, boundary: Optional[int] = None) -> None:
        """Wait for the pending background basis of ``boundary`` (None: of every boundary) and
        make it the next basis to send."""
        for b in ([boundary] if boundary is not None else list(self._pending)):
            fut = self._pending.pop(b, None)
            if fut is not None:
                v_next, took = fut.result()
                self._warm_basis[b] = v_next
                self.background_s += took
                self.background_jobs += 1


class SubspaceQuantHalf(_WarmBasisFitting, BasisHistory, PrefixRows, DirectionCodec):
    """Sent PCA basis + bit-allocated coefficients (module docstring for layout and bytes).

    Args:
        keep_ratio: byte budget per message as a fraction of the dense bytes, in (0, 1].
        rank: basis rows r (>= 1).
        share: (pcaq) fraction of each message's budget reserved for the per-step basis, [0, 1).
        max_bits: cap of bits per coefficient column, 1..16.
        outliers: tokens per sequence sent whole in fp16 (module docstring), >= 0.
        warm: 0 (default): every basis is a fresh ``top_basis`` (a d x d eigh on the critical
            path). 1..MAX_WARM: the sender computes each basis by ``warm`` subspace iterations
            (``warm_basis``) started at the previous basis it sent at this boundary, and a fresh
            ``top_basis`` only when it has none (the first message of a run, after ``reset``, or
            another d). The basis is still sent, so the wire layout, the bytes and the receiver
            are unchanged; the sender keeps an fp32 [r, d] basis a boundary (``state_dict``), not replica-invariant.
        lag: 0 (default) or 1 (needs warm >= 1): each message carries the basis a background
            thread finished BEFORE it (``warm`` iterations on the previous basis-carrying
            message's data), so no basis work is on the critical path (issue 10 item 6) but the
            basis lags the data by one message; ``lam`` is the message's own coefficients'
            variances, the rows sorted by it. The first message at a boundary (or after
            ``reset``, or at another d) fits ``top_basis``. Wire layout, bytes, receiver unchanged.
        every: (pcaq) steps one basis serves, >= 1 (issue 32 item 3: a basis fitted to the
            model's activations and kept, its bytes amortised). 1 (default): a basis per step.
            R > 1: one basis per (boundary, window of R steps: ``step // R``), fitted from the
            window's first message and sent with it, then held at both ends (``state_dict``:
            a resume inside a window decodes with the same basis) for every message of the
            window; its bytes are amortised over R steps (``step_nbytes``), so ``share`` can
            shrink by R and the coefficients get the bits. The seeds' warning applies: a held basis
            discards the same subspace each step (``codec/error_persistence``): judge R over a long horizon.
        basis_bits: (pcaq) 16 (default: fp16 rows) or 8: rows as int8 with an fp32 scale each
            (:func:`quantize_rows_int8`), d + 8 bytes a row with its variance instead of 2 d + 4;
            both ends code with the dequantised rows, so the decodes stay bit-identical
            (``docs/codec_pairs.md``: what lets a basis refit every 2 steps fit 5 % shared, bf16).
        sink: (pcaq) 0 (default) or 1 (issue 32 item 2): position 0 of every sequence (the
            attention sink: SmolLM2's boundary state there is ~165x the median token's norm and,
            under causal attention after the same first token, the same vector in every
            sequence) crosses once per message: a flag byte and one fp16 row, instead of b
            outlier rows. The sender checks that the b rows are bit-identical (flag 1: the
            receiver writes the row into all b; the rows leave the basis and the scales, as
            outliers do); where they are not (other first tokens), flag 0 and those rows are
            coded like any token. Use with ``outliers=0`` (the sink was the outlier): the
            b (2 d + 4) outlier bytes become 2 d + 1.
        rd: 0 (default) or 1: bits by the quantiser's distortion (``quant.allocate_bits_rd``), same bytes;
            measured worse on SmolLM2 bf16 (``docs/codecs.md``, "Bits by the quantiser's range").
        ema: (pcaq, warm=0) 0 (default) or the decay in (0, 1) per message of the sender's
            second-moment history the basis is fitted to (``history.py``); same bytes and receiver.
        prefix: (pcaq, sink=0) 0 (default) or 1: the b sequences' common prefix (a group's prompt)
            coded once, its coefficient bytes given to the other rows; same bytes (``prefix.py``).
        prepass: (pcaq, warm=0, ema=0) 0 (default) or 1: the basis fitted to the step's own boundary
            states, gathered by the first stage's no-gradient forward before the step's passes
            (``history.py``, ``PipelineRunner.boundary_prepass``); same bytes and receiver.
    Raises:
        ValueError: parameters out of range (the message names the parameter); at
        encode/decode, a shape whose budget leaves no coefficient bits.
    """

    refresh = "step"
    #: the basis rides inside the payload (split over the TP ranks with it); eigh, topk and the
    #: quantiser are deterministic on bit-identical inputs (tests/compression/test_tp_codec_determinism.py)
    tp_splittable = True

    PARAMS = {"rank": int, "share": float, "max_bits": int, "outliers": int, "warm": int, "lag": int, "every": int,
              "sink": int, "basis_bits": int, "rd": int, "ema": float, "prefix": int, "prepass": int}

    def __init__(self, keep_ratio: float = 0.05, rank: int = 128, share: float = 0.12, max_bits: int = 8,
                 outliers: int = 1, warm: int = 0, lag: int = 0, every: int = 1, sink: int = 0, basis_bits: int = 16,
                 rd: int = 0, ema: float = 0.0, prefix: int = 0, prepass: int = 0):
        if not 0.0 < float(keep_ratio) <= 1.0:
            raise ValueError(f"keep_ratio must lie in (0, 1], got {keep_ratio}")
        if int(rank) < 1 or not 0.0 <= float(share) < 1.0 or not 1 <= int(max_bits) <= 16 or int(outliers) < 0:
            raise ValueError(f"need rank >= 1, 0 <= share < 1, 1 <= max_bits <= 16, outliers >= 0; got {rank}, "
                             f"{share}, {max_bits}, {outliers}")
        self.keep_ratio, self.rank, self.share, self.max_bits = float(keep_ratio), int(rank), float(share), int(max_bits)
        self.outliers = int(outliers)
        if not 0 <= int(warm) <= MAX_WARM:
            raise ValueError(f"{self.name}/warm={warm}: warm is the number of warm-started subspace iterations per "
                             f"basis, 0 (a fresh eigh, the default) to {MAX_WARM}; fix: {self.name}/warm=1")
        self.warm = int(warm)
        if int(lag) not in (0, 1) or (int(lag) and not self.warm):
            raise ValueError(f"{self.name}/lag={lag}: lag=1 sends the basis a background thread built from the "
                             f"previous message, by warm-started iterations, so it needs warm >= 1; "
                             f"fix: {self.name}/warm=1/lag=1 (or lag=0)")
        self.lag = int(lag)
        if int(every) < 1 or (int(every) > 1 and self.refresh != "step"):
            raise ValueError(f"{self.name}/every={every}: every is the number of steps one basis serves, >= 1, and "
                             f"only a per-step basis (pcaq) can serve several; fix: pcaq/every=8 (or every=1)")
        self.every = int(every)
        if int(sink) not in (0, 1) or (int(sink) and self.refresh != "step"):
            raise ValueError(f"{self.name}/sink={sink}: sink=1 sends position 0 of the sequences once per message "
                             f"(the forward half, pcaq); fix: pcaq/sink=1/outliers=0 (or sink=0)")
        self.sink = int(sink)
        if int(basis_bits) not in (8, 16) or (int(basis_bits) == 8 and self.refresh != "step"):
            raise ValueError(f"{self.name}/basis_bits={basis_bits}: the basis rows go as fp16 (16) or as int8 with "
                             f"a scale a row (8, the forward half pcaq only); fix: pcaq/basis_bits=8 (or 16)")
        self.basis_bits = int(basis_bits)
        if int(rd) not in (0, 1):
            raise ValueError(f"{self.name}/rd={rd}: rd=1 allocates bits by the quantiser's range, rd=0 by the "
                             f"variances; fix: {self.name}/rd=1 (or rd=0)")
        self.rd = int(rd)
        self._init_prefix(prefix)
        self._init_history(ema, prepass)
        self._state = {"send": OrderedDict(), "recv": OrderedDict()}  # (boundary, step) -> (v fp32, lam list)
        # warm > 0: boundary -> fp32 [r, d]: lag=0, the last basis sent there; lag=1, the next one to send
        self._warm_basis = {}
        self._pending = {}  # lag=1: boundary -> Future of the next basis (fp32 [r, d])
        #: lag=1: CPU seconds of the background thread's basis updates, and how many ran (the
        #: benchmark's off-path column; they overlap the caller's compute)
        self.background_s, self.background_jobs = 0.0, 0

    @property
    def replica_invariant(self) -> bool:
        """A basis of each message's own data (``refresh`` "microbatch": lrq, rpq with own=1)
        depends on nothing else; a per-step basis (pcaq) comes from the step's first message,
        which differs between data-parallel replicas; a warm-started basis (``warm`` > 0) from
        the earlier messages of the run."""
        return self.refresh == "microbatch" and not self.warm

    def state_dict(self) -> dict:
        """Checkpointable state that outlives a step: ``{"warm_basis": {boundary: fp32 [r, d]}}``
        when ``warm`` > 0, ``{"window_basis": {role: {(boundary, window): (v fp32 [r, d], lam
        list)}}}`` when ``every`` > 1 (the per-step bases of ``every`` = 1 are rebuilt each step),
        ``{"history": {boundary: fp32 [d, d]}}`` when ``ema`` > 0 (``history.py``); ``{}`` otherwise."""
        out = {}
        if self.warm:
            self._settle()
            out["warm_basis"] = {b: v.clone() for b, v in self._warm_basis.items()}
        if self.every > 1:
            out["window_basis"] = {role: {k: (v.clone(), list(lam)) for k, (v, lam) in store.items()}
                                   for role, store in self._state.items()}
        out.update(self._history_state())
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (``{}``: no basis and no history, the next one is fitted fresh).

        Raises:
            ValueError: keys other than ``warm_basis`` / ``window_basis`` / ``history``, a warm basis for
                a half with warm = 0, a window basis for a half with every = 1, or a history for ema = 0.
        """
        state = dict(state or {})
        bases = state.pop("warm_basis", None)
        windows = state.pop("window_basis", None)
        self._load_history(state.pop("history", None))
        if windows is not None and self.every == 1:
            raise ValueError(f"the checkpoint's {self.name} half holds a basis over several steps, this run's has "
                             f"every=1; fix: resume with the checkpoint's {self.name}/every=R in --boundary-codec")
        for role, store in (windows or {}).items():
            self._state[role] = OrderedDict((tuple(int(x) for x in k), (v.float().clone(), list(lam)))
                                            for k, (v, lam) in store.items())
        if state:
            raise ValueError(f"{self.name}: unexpected codec state keys {sorted(state)}")
        if bases and not self.warm:
            raise ValueError(f"the checkpoint's {self.name} half has a warm-started basis, this run's has warm=0; "
                             f"fix: resume with {self.name}/warm=1 (or the checkpoint's warm) in --boundary-codec")
        self._settle()
        self._warm_basis = {int(b): v.float().clone() for b, v in (bases or {}).items()}

    # ---- sizes ---------------------------------------------------------------------------
    def budget(self, shape, elem: int) -> int:
        """floor(keep_ratio * N * d * elem) bytes for one message of ``shape``."""
        s, b, d = _check_shape(shape)
        return math.floor(self.keep_ratio * s * b * d * elem)

    def basis_rows(self, shape, elem: int) -> int:
        """r for a message of ``shape``."""
        return min(self.rank, _check_shape(shape)[2])

    def outlier_count(self, shape) -> int:
        """Tokens sent dense (fp16) per message: outliers * b, at most N."""
        s, b, d = _check_shape(shape)
        return min(self.outliers * b, s * b)

    def coef_bits(self, shape, elem: int) -> int:
        """B, coefficient bits per token (ValueError if < 1)."""
        s, b, d = _check_shape(shape)
        r = self.basis_rows(shape, elem)
        avail = (self.budget(shape, elem) * (1.0 - self.share) - 4 * r - self.outlier_count(shape) * (2 * d + 4)
                 - self.sink * (2 * d + 1) - 4 * self.prefix)
        bits = math.floor(8 * avail / max(s * b, 1))
        if bits < 1:
            raise ValueError(f"{self.name}: keep ratio {self.keep_ratio} leaves no coefficient bits for shape {shape}")
        return min(bits, self.max_bits * r)

    def basis_row_nbytes(self, d: int) -> int:
        """Wire bytes of one sent basis row with its variance: 2 d + 4 (fp16), d + 8 (int8 + scale)."""
        return 2 * d + 4 if self.basis_bits == 16 else d + 8

    def _key(self, ctx) -> Tuple[int, int]:
        """(boundary, the step's basis window): ``step // every`` (``every`` = 1: the step)."""
        return int(ctx.boundary), int(ctx.step) // self.every

    def step_nbytes(self, shape, elem: int, messages: int, keys: int) -> int:
        """As the base class's, with the basis amortised over ``every`` steps (rounded up)."""
        messages = int(messages)
        if messages <= 0 or self.every == 1:
            return super().step_nbytes(shape, elem, messages, keys)
        basis = self.nbytes(shape, elem, True) - self.nbytes(shape, elem, False)
        return messages * self.nbytes(shape, elem, False) + math.ceil(basis / self.every)

    def _carries_basis(self, key, role: str) -> bool:
        return self.refresh == "microbatch" or key not in self._state[role]

    def nbytes(self, shape, elem, first_of_step):
        s, b, d = _check_shape(shape)
        r = self.basis_rows(shape, elem)
        raw = (4 * r + packed_nbytes(s * b, self.coef_bits(shape, elem)) + self.outlier_count(shape) * (2 * d + 4)
               + self.sink * (2 * d + 1) + 4 * self.prefix)
        if first_of_step or self.refresh == "microbatch":
            raw += r * self.basis_row_nbytes(d)
        return wire_numel(raw, _dtype_of(elem)) * elem

    def wire_shape(self, shape, ctx, dtype, role):
        elem = torch.empty((), dtype=dtype).element_size()
        first = self._carries_basis(self._key(ctx), role)
        return (self.nbytes(shape, elem, first) // elem,)

    # ---- state ---------------------------------------------------------------------------
    def _remember(self, role: str, key, value) -> None:
        store = self._state[role]
        store[key] = value
        while len(store) > 4:
            store.popitem(last=False)

    def reset(self):
        """Forget every basis, the warm-start one and the history included (a pending background one too)."""
        for store in self._state.values():
            store.clear()
        self._settle()
        self._warm_basis, self._history, self._prepass = {}, {}, {}

    # ---- codec ---------------------------------------------------------------------------
    def encode(self, t, ctx):
        s, b, d = _check_shape(t.shape)
        elem = t.element_size()
        x = t.detach().reshape(-1, d).float()
        key, parts = self._key(ctx), []
        p, shared, out_idx, idx = self._select_rows(x, t.shape)
        if self.prefix:
            parts.append(tensor_bytes(torch.tensor([p], dtype=torch.int32, device=x.device)))
        if self.sink:
            parts += [torch.tensor([int(shared)], dtype=torch.uint8, device=x.device),
                      tensor_bytes((x[0] if shared else torch.zeros_like(x[0])).half())]
        parts += [tensor_bytes(out_idx.to(torch.int32)), tensor_bytes(x[out_idx].half())]
        self._observe(x, idx, ctx.boundary)
        coef = None
        if self._carries_basis(key, "send"):
            v16, lam, coef = self._fit_window(x, idx, self.basis_rows(t.shape, elem), ctx.boundary, key)
            fields, v = _basis_fields(v16, self.basis_bits)
            parts += fields + [tensor_bytes(lam)]
            coef = coef if self.basis_bits == 16 else None  # int8: project onto what the receiver decodes with
            lam_list = lam.tolist()
            if self.refresh == "step":
                self._remember("send", key, (v, lam_list))
        else:
            v, lam_list = _held(self._state["send"], key, x.device)
        if coef is None:
            coef = (x @ v.t()).index_fill_(0, idx, 0.0)
        return bytes_to_wire(parts + self._quantize_rows(coef, lam_list, t.shape, elem, p), t.dtype)

    def decode(self, payload, ctx, shape):
        return self._decode(payload, ctx, shape, "recv")

    def decode_sent(self, payload, ctx, shape):
        """At the sender, after :meth:`encode`: the payload carries a basis iff its length is
        that of a first message (the two lengths differ by the basis' r rows of
        :meth:`basis_row_nbytes`); the basis otherwise comes from the send-side state; nothing is
        remembered."""
        return self._decode(payload, ctx, shape, "send")

    def _decode(self, payload, ctx, shape, role: str):
        s, b, d = _check_shape(shape)
        elem = payload.element_size()
        r = self.basis_rows(shape, elem)
        key, k = self._key(ctx), self.outlier_count(shape)
        if role == "send":
            carries = payload.numel() * elem == self.nbytes(shape, elem, True)
        else:
            carries = self._carries_basis(key, "recv")
        reader = ByteReader(wire_to_bytes(payload))
        sink_row, p = None, self._read_prefix(reader, s)
        if self.sink:
            shared = bool(reader.take_as((1,), torch.uint8)[0])
            row = reader.take_as((d,), torch.float16).to(payload.device).float()
            sink_row = row if shared else None
        idx = reader.take_as((k,), torch.int32).to(payload.device).long()
        rows = reader.take_as((k, d), torch.float16).to(payload.device).float()
        if carries:
            v = _read_basis(reader, r, d, self.basis_bits, payload.device)
            lam_list = reader.take_as((r,), torch.float32).tolist()
            if self.refresh == "step" and role == "recv":
                self._remember("recv", key, (v, lam_list))
        else:
            v, lam_list = _held(self._state[role], key, payload.device)
        out = self._dequantize_rows(reader, lam_list, v, shape, elem, p).index_copy_(0, idx, rows)
        if p:
            out.view(s, b, d)[:p, 1:] = out.view(s, b, d)[:p, :1]  # the prefix (an outlier there too) copied
        if sink_row is not None:
            out[:b] = sink_row
        return out.view(s, b, d).to(payload.dtype)


def _basis_fields(v16: torch.Tensor, basis_bits: int):
    """(wire fields, the fp32 [r, d] rows both ends code with) of a basis fitted as fp16 ``v16``:
    the fp16 rows themselves, or with ``basis_bits`` 8 the scales and int8 rows."""
    if basis_bits == 16:
        return [tensor_bytes(v16)], v16.float()
    q, scale = quantize_rows_int8(v16.float())
    return [tensor_bytes(scale), tensor_bytes(q)], dequantize_rows_int8(q, scale)


def _read_basis(reader: ByteReader, r: int, d: int, basis_bits: int, device) -> torch.Tensor:
    """The fp32 [r, d] basis rows :func:`_basis_fields` wrote, read from ``reader``."""
    if basis_bits == 16:
        return reader.take_as((r, d), torch.float16).to(device).float()
    scale = reader.take_as((r,), torch.float32).to(device)
    return dequantize_rows_int8(reader.take_as((r, d), torch.int8).to(device), scale)


def quantize_rows_int8(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``v`` [r, d] (fp32) as int8 with one fp32 scale a row, ``max_j |v_ij| / 127``
    (symmetric, round half to even; a zero row gets scale 1). Returns (q int8 [r, d], scale fp32
    [r]); :func:`dequantize_rows_int8` inverts it up to half a step per entry."""
    amax = v.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).float()
    q = torch.round(v / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [r, d] rows ``q * scale`` from :func:`quantize_rows_int8`'s int8 ``q`` [r, d] and
    fp32 ``scale`` [r]."""
    return q.float() * scale[:, None]


def _held(store, key, device) -> Tuple[torch.Tensor, list]:
    """(basis fp32 [r, d] on ``device``, variances) held in ``store`` under ``key``: a basis
    restored from a checkpoint lies on the CPU (the stage files load with map_location="cpu")."""
    v, lam = store[key]
    return v.to(device), lam


def _zero_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` with rows ``idx`` zeroed (a copy), or ``x`` itself when ``idx`` is empty."""
    return x.index_fill(0, idx, 0.0) if idx.numel() else x


def _dtype_of(elem: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[int(elem)]


@register_half("pcaq")
class PcaQuantHalf(SubspaceQuantHalf):
    """``pcaq``: per-step sent basis (default rank 128, share 0.12, max_bits 8)."""

    refresh = "step"


@register_half("lrq")
class LowRankQuantHalf(SubspaceQuantHalf):
    """``lrq``: per-message basis of the message's own data (default rank 48, max_bits 8);
    r shrinks so that the basis takes at most half of the budget."""

    refresh = "microbatch"

    PARAMS = {"rank": int, "max_bits": int, "outliers": int, "warm": int, "lag": int, "rd": int}

    def __init__(self, keep_ratio: float = 0.05, rank: int = 48, max_bits: int = 8, outliers: int = 0,
                 warm: int = 0, lag: int = 0, rd: int = 0):
        super().__init__(keep_ratio=keep_ratio, rank=rank, share=0.0, max_bits=max_bits, outliers=outliers,
                         warm=warm, lag=lag, rd=rd)

    def basis_rows(self, shape, elem):
        s, b, d = _check_shape(shape)
        cap = self.budget(shape, elem) // (2 * (2 * d + 8))
        return max(1, min(self.rank, d, s * b, cap))

    def coef_bits(self, shape, elem):
        s, b, d = _check_shape(shape)
        r = self.basis_rows(shape, elem)
        spent = r * (2 * d + 8) + self.outlier_count(shape) * (2 * d + 4)
        bits = math.floor(8 * (self.budget(shape, elem) - spent) / max(s * b, 1))
        if bits < 1:
            raise ValueError(f"lrq: keep ratio {self.keep_ratio} leaves no coefficient bits for shape {shape}")
        return min(bits, self.max_bits * r)
