"""bench_basis: how to compute the top-r PCA basis of ``pcaq`` / ``rpq`` / ``lrq`` (issue 10 item 6).

    python -m benchmarks.bench_basis [--seq-len 256 --micro-batch 4 --dim 576] [--threads 1]
                                     [--hf-dir DIR] [--out basis.json]

The subspace halves compute, on the critical path, the top-r right singular vectors of each
micro-batch's boundary tensor X [N = s * b, d] (``compression.subspace.top_basis``; sent in
fp16). Candidates, each timed (median ms, ``--threads`` torch threads) and scored by the
relative reconstruction error ||X - X V^T V|| / ||X|| of its fp16 basis V:

* ``svd``: ``torch.linalg.svd(X)`` (full, thin), the method before this benchmark;
* ``gram-eigh``: ``top_basis`` today: ``torch.linalg.eigh`` of the fp32 Gram matrix X^T X;
* ``svd_lowrank``: ``torch.svd_lowrank(X, q=r + 10, niter=2)`` (randomized; draws from the
  GLOBAL torch RNG, which a trainer must not disturb: listed for its time only);
* ``subspace-iter``: 3 block power iterations on X^T X from a fixed-seed start, QR, and a
  Rayleigh-Ritz step (own generator).

Data: the ``bench_codec`` boundary activation (r = 144, ``rpq``'s rank) and gradient
(r = 48, ``lrq``'s), and, when ``--hf-dir`` (default: a SmolLM2-135M HF directory in the
megatron_cegrpo GGUF cache, if there is one) holds a model with hidden size ``--dim``, its
residual stream after layer L/2 (the PP = 2 boundary) on this repository's README text,
[s, b] tokens. For the codec itself, ``rpq:lrq``'s forward round trip error with ``svd``
and with ``gram-eigh`` is reported too (``codec_relerr``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from benchmarks.bench_codec import _ctx, boundary_tensors
from megatron_cegrpo.bootstrap import bootstrap

Basis = Callable[[torch.Tensor, int], Tuple[torch.Tensor, torch.Tensor]]  # X [N, d], r -> (V [r, d], lam [r])


def basis_svd(x: torch.Tensor, r: int):
    """The former ``top_basis``: full thin SVD; (V fp32 [r, d], sigma**2 / N [r])."""
    _, sv, vh = torch.linalg.svd(x, full_matrices=False)
    return vh[:r], sv[:r] ** 2 / x.shape[0]


def basis_gram_eigh(x: torch.Tensor, r: int):
    """``compression.subspace.top_basis`` (eigh of the Gram matrix), V returned as fp32."""
    from megatron_cegrpo.compression.subspace import top_basis
    v, lam = top_basis(x, r)
    return v.float(), lam


def basis_svd_lowrank(x: torch.Tensor, r: int):
    """Randomized SVD (``torch.svd_lowrank``, global RNG), q = r + 10, 2 power iterations."""
    _, sv, v = torch.svd_lowrank(x, q=min(r + 10, min(x.shape)), niter=2)
    return v[:, :r].t(), sv[:r] ** 2 / x.shape[0]


def basis_subspace_iter(x: torch.Tensor, r: int, iters: int = 3, oversample: int = 16):
    """Block power iteration on X^T X (fixed-seed start), QR, Rayleigh-Ritz."""
    g = x.t() @ x
    q = torch.randn(g.shape[0], min(r + oversample, g.shape[0]), generator=torch.Generator().manual_seed(0))
    for _ in range(iters):
        q, _ = torch.linalg.qr(g @ q)
    e, w = torch.linalg.eigh(q.t() @ g @ q)
    return (q @ w[:, -r:].flip(1)).t(), e[-r:].flip(0).clamp_min(0) / x.shape[0]


METHODS: Dict[str, Basis] = {"svd": basis_svd, "gram-eigh": basis_gram_eigh, "svd_lowrank": basis_svd_lowrank,
                             "subspace-iter": basis_subspace_iter}


def relerr(x: torch.Tensor, v: torch.Tensor) -> float:
    """||x - x V^T V|| / ||x|| with V rounded to fp16 (as sent); x [N, d], v [r, d]."""
    v = v.half().float()
    return float((x - (x @ v.t()) @ v).norm() / x.norm())


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def codec_relerr(x: torch.Tensor, spec: str = "rpq:lrq", keep_ratio: float = 0.05, method: str = "gram-eigh") -> float:
    """Relative error of ``spec``'s forward round trip (first crossing) of x [s, b, d] with the basis
    computed by ``method`` ("svd" or "gram-eigh"; the halves' ``top_basis`` is swapped in place)."""
    from megatron_cegrpo.compression import build_codec
    from megatron_cegrpo.compression import repeat as rep_mod
    from megatron_cegrpo.compression import subspace as sub_mod
    saved = sub_mod.top_basis, rep_mod.top_basis
    if method == "svd":
        def tb(a, r):
            v, lam = basis_svd(a.float(), r)
            out_v = torch.zeros((r, a.shape[1]))
            out_l = torch.zeros(r)
            out_v[: v.shape[0]], out_l[: lam.shape[0]] = v, lam
            return out_v.half(), out_l
        sub_mod.top_basis = rep_mod.top_basis = tb
    try:
        codec = build_codec(spec, keep_ratio)
        ctx = _ctx(1, x.shape[1])
        y = codec.decode_forward(codec.encode_forward(x, ctx), ctx, tuple(x.shape))
    finally:
        sub_mod.top_basis, rep_mod.top_basis = saved
    return float((y.float() - x.float()).norm() / x.float().norm())


def _default_hf_dir() -> Optional[str]:
    from megatron_cegrpo.models.hf_config import cache_root
    hits = sorted(glob.glob(os.path.join(cache_root(), "gguf", "SmolLM2*", "model.safetensors")))
    return os.path.dirname(hits[0]) if hits else None


def model_activation(hf_dir: str, s: int, b: int, d: int) -> Optional[torch.Tensor]:
    """Residual stream [s, b, d] fp32 after layer L // 2 of the HF model in ``hf_dir`` on README
    text (b windows of s tokens), or None if its hidden size is not d or there is too little text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok_dir = os.path.join(hf_dir, "tokenizer") if os.path.isdir(os.path.join(hf_dir, "tokenizer")) else hf_dir
    tok = AutoTokenizer.from_pretrained(tok_dir)
    text = ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("README.md", "docs/codecs.md", "docs/benchmarks.md"):
        p = os.path.join(root, name)
        if os.path.exists(p):
            text += open(p).read() + "\n"
    ids = tok(text)["input_ids"]
    if len(ids) < s * b:
        return None
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if model.config.hidden_size != d:
        return None
    inp = torch.tensor(ids[: s * b]).view(b, s)
    with torch.no_grad():
        hs = model(input_ids=inp, output_hidden_states=True).hidden_states
    return hs[model.config.num_hidden_layers // 2].transpose(0, 1).contiguous()


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7, help="timed calls per method (median)")
    ap.add_argument("--hf-dir", default="auto", help="HF model directory for a real activation ('' = none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    bootstrap(num_threads=args.threads)
    s, b, d = args.seq_len, args.micro_batch, args.dim
    x, g = boundary_tensors(s, b, d, torch.float32)
    data = [("bench activation", x, 144), ("bench gradient", g, 48)]
    hf_dir = _default_hf_dir() if args.hf_dir == "auto" else (args.hf_dir or None)
    if hf_dir:
        act = model_activation(hf_dir, s, b, d)
        if act is not None:
            data.append((f"{os.path.basename(hf_dir.rstrip('/'))[:24]} layer-L/2 activation", act, 144))
    rows = []
    for name, t, r in data:
        flat = t.reshape(-1, d).float()
        for m, fn in METHODS.items():
            v, _ = fn(flat, r)
            rows.append({"data": name, "N": flat.shape[0], "d": d, "r": r, "method": m,
                         "ms": _median_ms(lambda: fn(flat, r), args.reps), "relerr": relerr(flat, v)})
        if r == 144 and d >= 144:
            for m in ("svd", "gram-eigh"):
                rows.append({"data": name, "N": flat.shape[0], "d": d, "r": r, "method": f"rpq:lrq fwd ({m})",
                             "ms": None, "relerr": codec_relerr(t, method=m)})
    print(f"bench_basis: X [{s * b}, {d}], {args.threads} thread(s); relerr of the fp16 basis "
          "(codec rows: rpq:lrq forward round trip)")
    print(f"{'data':<44} {'r':>4} {'method':<24} {'ms':>9} {'relerr':>10}")
    for r in rows:
        ms = f"{r['ms']:>9.2f}" if r["ms"] is not None else f"{'':>9}"
        print(f"{r['data']:<44} {r['r']:>4} {r['method']:<24} {ms} {r['relerr']:>10.6f}")
    result = {"config": vars(args), "hf_dir": hf_dir, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
