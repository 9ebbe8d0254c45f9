"""pcaq's basis from the sender's history (``pcaq/ema=beta``) or from the step's own boundary
states (``pcaq/prepass=1``; issue 32 item 3).

Today's per-step basis is fitted on the step's first message alone: at the main job's shape that
is the G / 2 = 4 responses of one prompt, and the basis then codes the other prompts' messages of
the step (and, with ``every=2``, of the next step). A basis of the sender's recent messages (other
prompts) generalises better: on SmolLM2-135M's PP = 2 boundary (bf16 wire, the main job's
``pcaq/every=2:lrq``, ``tools/codec_fidelity.py`` on the 4 batches of ``docs/codecs.md``, "A basis
from the sender's history") ``ema=0.9`` lowered the log-prob mismatch from 1.03 to 0.89
nats/token (lower on 3 of 4 batches) and moved the gradient's cosine to dense from 0.418 to 0.437
(within noise), at the same bytes: a small gain, off by default.

With ``ema`` = beta in (0, 1) the sender keeps, per boundary, the exponential moving average of
the uncentred second moment of every message it codes there (outlier and sink rows zeroed, as the
basis fit sees them)::

    C_b <- beta C_b + (1 - beta) x^T x / N      (C_b = x^T x / N at the first message)

and a basis-carrying message sends the top-r eigenvectors of C_b after its own update. The basis
is still sent (same bytes, same receiver); only where it comes from changes. The sender's state is
one fp32 [d, d] matrix per boundary (``state_dict``: a resume codes bit for bit as the run would
have). beta is per message, a memory of about 1 / (1 - beta) messages: 10 at 0.9, 50 at 0.98; the
main job's step codes 8 forward messages (the fidelity probe's 16: its old-logprob pass codes each
micro-batch once more).

With ``prepass`` = 1 the basis comes from the step itself: before the step's passes the first
stage runs its forward over the whole batch (no gradient, no boundary traffic; the tied embedding's
rows are refreshed first as before any pass: ``PipelineRunner.boundary_prepass``) and folds each micro-batch's boundary state into

    C = sum over the step's messages of x^T x      (the rows each message codes)

and the step's (window's) first message sends C's top-r eigenvectors, sorted by that message's
own variances. Same bytes and receiver; the Gram is forgotten once the basis is fitted, so nothing
is checkpointed. It costs one forward of the first stage per basis window and reaches only the
boundary that stage sends (a later stage's inputs arrive message by message); other boundaries fit
their first message's basis as before. Measured: ``docs/codecs.md``, "The prompt once inside the
codec, and the step's own basis".

The seeds' warning applies with more force than to ``every``: a basis of a long history changes
slowly, so it discards nearly the same subspace step after step (``codec/error_persistence``; on
the 4-batch probe above it did not rise: 0.20 at ``ema=0.9`` against 0.26).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

__all__ = ["BasisHistory", "gram_basis", "project_sorted"]


def project_sorted(x: torch.Tensor, idx: torch.Tensor, v16: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v fp16 [r, d], lam fp32 [r], coefficients fp32 [N, r]) of message ``x`` [N, d] fp32 on a
    basis ``v16`` fp16 [r, d] fitted elsewhere (a history, a previous message): the coefficients
    ``x v^T`` with rows ``idx`` (int64) zero, their column variances lam_j = mean_i c_ij^2 (the
    bit allocation's input), rows and columns sorted by lam, descending, so that equal bit widths
    form contiguous column runs."""
    coef = (x @ v16.float().t()).index_fill_(0, idx, 0.0)
    lam = coef.square().mean(dim=0) if x.shape[0] else torch.zeros(v16.shape[0])
    order = torch.argsort(lam, descending=True, stable=True)
    return v16[order], lam[order], coef[:, order]


def gram_basis(gram: torch.Tensor, r: int) -> torch.Tensor:
    """Top-r eigenvectors of the symmetric PSD ``gram`` [d, d] (fp32) as fp16 rows [r, d],
    largest eigenvalue first (rows beyond d zero). Eigen-decomposition by the subspace module's
    ``_eigh_ascending`` (LAPACK syevd, fp64 and SVD fallbacks). Signs are arbitrary: the rows are
    sent. Raises FloatingPointError if ``gram`` holds a NaN or an infinity (a diverged step)."""
    from .subspace import _eigh_ascending

    d = gram.shape[0]
    if not bool(torch.isfinite(gram).all()):
        raise FloatingPointError(f"pcaq/ema: the boundary's [{d}, {d}] second-moment history holds NaN/inf values "
                                 "(a diverged step: lower --lr or check the loss)")
    v = torch.zeros((int(r), d), dtype=torch.float32, device=gram.device)
    m = min(int(r), d)
    _, evecs = _eigh_ascending(gram)
    v[:m] = evecs[:, -m:].flip(1).t()
    return v.half()


class BasisHistory:
    """Mixin of :class:`~megatron_cegrpo.compression.subspace.SubspaceQuantHalf`: the sender's
    per-boundary second-moment history and the prepass' second moment (module docstring). ``ema`` = 0
    turns the history's methods into no-ops except :meth:`_history_state` (``{}``); ``prepass`` = 0
    leaves :meth:`_fit_window` to ``_fit_basis``."""

    ema: float
    _history: Dict[int, torch.Tensor]

    def _init_history(self, ema: float, prepass: int = 0) -> None:
        """Validate and set ``ema`` and ``prepass``. Raises ValueError: ema outside [0, 1), or ema > 0
        on a half without a per-step basis (lrq, rpq) or with a warm-started basis (warm > 0);
        prepass not 0 or 1, or 1 on such a half or with ema > 0 (two sources for one basis)."""
        if not 0.0 <= float(ema) < 1.0 or (float(ema) > 0 and (self.refresh != "step" or self.warm)):
            raise ValueError(f"{self.name}/ema={ema}: ema is the decay per message of the sender's second-moment "
                             f"history, in [0, 1), for pcaq's basis with warm=0; fix: pcaq/every=2/ema=0.9 (or ema=0)")
        if int(prepass) not in (0, 1) or (int(prepass) and (self.refresh != "step" or self.warm or float(ema))):
            raise ValueError(f"{self.name}/prepass={prepass}: prepass=1 fits pcaq's basis (warm=0, ema=0) to the "
                             f"step's own boundary states; fix: pcaq/prepass=1 (or prepass=0)")
        self.ema, self._history = float(ema), {}
        self.prepass, self._prepass = int(prepass), {}

    def prepass_due(self, ctx) -> bool:
        """``prepass`` = 1 and no basis of ``ctx``'s (boundary, window) is held at the sender yet."""
        return bool(self.prepass) and self._carries_basis(self._key(ctx), "send")

    def observe_prepass(self, t: torch.Tensor, ctx) -> None:
        """``prepass`` = 1, at the sender before the step's passes: fold one micro-batch's boundary
        state ``t`` [s, b, d] (what the pass will send; any float dtype) into the second moment the
        basis of ``ctx``'s (boundary, window) is fitted to, with the rows the message codes
        (outliers, a shared sink and prefix copies left out: ``prefix.py``). A no-op where the
        window's basis is already held or ``prepass`` = 0. Raises FloatingPointError as
        :meth:`_add_prepass`."""
        if not self.prepass_due(ctx):
            return
        x = t.detach().reshape(-1, t.shape[-1]).float()
        self._add_prepass(self._key(ctx), x, self._select_rows(x, t.shape)[3])

    def _add_prepass(self, key: Tuple[int, int], x: torch.Tensor, idx: torch.Tensor) -> None:
        """``prepass`` = 1: add x^T x of one message ``x`` [N, d] fp32 (rows ``idx`` zeroed) to the
        second moment of ``key`` = (boundary, window); another window's at that boundary is dropped.
        Raises FloatingPointError, adding nothing, if it is not finite (a diverged step)."""
        xz = x.index_fill(0, idx, 0.0) if idx.numel() else x
        g = xz.t() @ xz
        if not bool(torch.isfinite(g).all()):
            raise FloatingPointError(f"pcaq/prepass: a [{x.shape[0]}, {x.shape[1]}] boundary state of the prepass "
                                     "holds NaN/inf values (a diverged step: lower --lr or check the loss)")
        self._prepass = {k: v for k, v in self._prepass.items() if k[0] != key[0] or k == key}
        prev = self._prepass.get(key)
        self._prepass[key] = g if prev is None else prev.add_(g)

    def _fit_window(self, x: torch.Tensor, idx: torch.Tensor, r: int, boundary: int, key: Tuple[int, int]
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The basis a window's first message ``x`` [N, d] fp32 sends (rows ``idx`` zeroed): the top-r
        eigenvectors of the second moment the prepass gathered for ``key`` (forgotten once used) with
        ``x``'s own variances (:func:`project_sorted`), or, without one (prepass = 0, a boundary the
        prepass does not reach), ``_fit_basis``'s. Returns (v fp16 [r, d], lam fp32 [r], coefficients
        fp32 [N, r] or None)."""
        gram = self._prepass.pop(key, None)
        if gram is None:
            return self._fit_basis(x, idx, r, boundary)
        return project_sorted(x, idx, gram_basis(gram, r))

    def _observe(self, x: torch.Tensor, idx: torch.Tensor, boundary: int) -> None:
        """Fold message ``x`` [N, d] fp32 (rows ``idx``, int64, zeroed) into the history of
        ``boundary``: one [d, d] Gram, N d^2 multiply-adds, on every message (a basis without
        ``ema`` computes one on basis-carrying messages only). Raises FloatingPointError, leaving
        the history unchanged, if that Gram is not finite (a NaN/inf message)."""
        if not self.ema or x.shape[0] == 0:
            return
        xz = x.index_fill(0, idx, 0.0) if idx.numel() else x
        g = (xz.t() @ xz) / x.shape[0]
        if not bool(torch.isfinite(g).all()):  # checked before it joins: one bad message would poison every later basis
            raise FloatingPointError(f"pcaq/ema: a [{x.shape[0]}, {x.shape[1]}] boundary message holds NaN/inf values "
                                     "(or its second moment overflows fp32); the second-moment history is left as it "
                                     "was (a diverged step: lower --lr or check the loss)")
        prev = self._history.get(int(boundary))
        if prev is None or prev.shape != g.shape:
            self._history[int(boundary)] = g
        else:  # a history loaded from a checkpoint lies on the CPU
            self._history[int(boundary)] = prev.to(g.device).mul_(self.ema).add_(g, alpha=1.0 - self.ema)

    def _fit_history(self, x: torch.Tensor, idx: torch.Tensor, r: int, boundary: int
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(v fp16 [r, d], lam fp32 [r], coefficients fp32 [N, r]) for message ``x`` [N, d]
        (already observed): the history's top-r eigenvectors, with the message's own column
        variances lam_j = mean_i c_ij^2 (the bit allocation's input, as ``top_basis``'s) and the
        rows sorted by them, descending; coefficient rows ``idx`` are zero."""
        return project_sorted(x, idx, gram_basis(self._history[int(boundary)], r))

    def _history_state(self) -> dict:
        """``{"history": {boundary: fp32 [d, d]}}`` when ``ema`` > 0, else ``{}``."""
        return {"history": {b: g.clone() for b, g in self._history.items()}} if self.ema else {}

    def _load_history(self, history) -> None:
        """Restore :meth:`_history_state`'s ``history`` (None: none kept). Raises ValueError for a
        history given to a half with ema = 0."""
        if history and not self.ema:
            raise ValueError(f"the checkpoint's {self.name} half has a second-moment history, this run's has ema=0; "
                             f"fix: resume with the checkpoint's {self.name}/ema=beta in --boundary-codec")
        self._history = {int(b): g.float().clone() for b, g in (history or {}).items()}
