"""Whether this host computes bf16 faster than fp32: the precision ``make demo`` and the study pick.

``--bf16`` (``optim/mixed_precision.py``) pays off only where the matmuls have a native bf16 path:
GPUs with bf16 tensor cores (``torch.cuda.is_bf16_supported``), and CPUs with AMX-BF16 (Intel
Sapphire Rapids and later: 627 vs 98 GFLOP/s fp32 on one core, measured there) or AVX512-BF16.
Elsewhere PyTorch emulates bf16 matmuls: on an AMD EPYC with AVX2 only (a machine this project
also runs on) a 512x576 @ 576x1536 bf16 product ran at 0.4-0.5 GFLOP/s against 23-30 GFLOP/s in
fp32 (two measurements on two days), 45-75 times slower, so ``--bf16`` there makes a run far
slower, not faster.

The sampler's weights are bf16 by default (``--rollout-dtype bf16``: what the delta sync sends);
:func:`rollout_compute_dtype` runs the hf sampler in bf16 only where it is native, else in fp32
holding the same bf16 values exactly (``--rollout-compute-dtype auto``).

    python -m megatron_cegrpo.compat.precision          # prints the flags: "--bf16" or ""
    python -m megatron_cegrpo.compat.precision --explain  # also why, and both measured speeds
    python -m megatron_cegrpo.compat.precision --kernels  # amx, avx512_bf16 or emulated (CPU only)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Tuple

import torch

from megatron_cegrpo.bootstrap import bootstrap

__all__ = ["native_bf16", "cpu_bf16_kernels", "matmul_gflops", "recommended_precision_flags", "precision_warning",
           "rollout_compute_dtype"]

BF16_FLAGS = "--bf16"


def cpu_bf16_kernels() -> str:
    """Which bf16 matmul kernels this CPU runs: ``"amx"`` (AMX tiles), ``"avx512_bf16"`` or
    ``"emulated"``. The kinds round bf16 products differently, so runs compare paired only within
    one kind (the study's pages are kept per kind: ``docs/study_bf16_amx.md``, ``docs/study_bf16.md``)."""
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "emulated"


def native_bf16() -> Tuple[bool, str]:
    """(whether bf16 matmuls run natively here, the reason in words): CUDA with bf16 support, or a CPU
    with AMX tiles or AVX512-BF16 (``torch.cpu``'s feature checks)."""
    if torch.cuda.is_available():
        ok = torch.cuda.is_bf16_supported()
        return ok, f"CUDA device {torch.cuda.get_device_name()}: bf16 {'supported' if ok else 'not supported'}"
    amx, avx = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported()
    if amx or avx:
        return True, "CPU with " + " and ".join(n for n, f in (("AMX tiles", amx), ("AVX512-BF16", avx)) if f)
    return False, "CPU without AMX or AVX512-BF16: PyTorch emulates bf16 matmuls"


def matmul_gflops(dtype: torch.dtype, seconds: float = 0.3, threads: int = 1) -> float:
    """GFLOP/s of a 512x576 @ 576x1536 product (a SmolLM2 MLP matmul) in ``dtype`` on ``threads``
    threads, repeated for about ``seconds`` after a warm-up (at least 2 products)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(512, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        a @ b
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        return 2 * 512 * 576 * 1536 * n / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(prev)


def recommended_precision_flags() -> str:
    """``--bf16`` where :func:`native_bf16`, else the empty string (fp32 passes; the sampler's
    compute dtype follows by itself, :func:`rollout_compute_dtype`)."""
    return BF16_FLAGS if native_bf16()[0] else ""


def rollout_compute_dtype(rollout) -> str:
    """The dtype the sampler runs in, ``fp32`` or ``bf16``, for the rollout options ``rollout``
    (``RolloutConfig``): ``--rollout-compute-dtype`` when given; under ``auto``, vLLM's is
    ``--rollout-dtype`` and the hf sampler's is bf16 where ``--rollout-dtype bf16`` and
    :func:`native_bf16`, else fp32 (the bf16 weights upcast exactly: same values, fp32 speed)."""
    if rollout.compute_dtype != "auto":
        return rollout.compute_dtype
    if rollout.engine == "vllm" or rollout.dtype == "fp32":
        return rollout.dtype
    return "bf16" if native_bf16()[0] else "fp32"


def precision_warning(cfg) -> str:
    """A warning line when the run computes in bf16 (``--bf16``, ``--params-dtype bf16`` or a bf16
    sampler, :func:`rollout_compute_dtype`) on a host without native bf16 matmuls; the empty
    string otherwise."""
    flags = [f for f, on in (("--bf16", cfg.model.bf16), ("--params-dtype bf16", cfg.model.params_dtype == "bf16"),
                             ("a bf16 sampler (--rollout-compute-dtype)",
                              cfg.rollout.compute_dtype == "bf16" or (cfg.rollout.engine == "vllm"
                                                                      and cfg.rollout.dtype == "bf16")))
             if on]
    ok, why = native_bf16()
    if not flags or ok:
        return ""
    return (f"warning: {' and '.join(flags)} on a {why}: bf16 runs many times slower than fp32 here "
            "(python -m megatron_cegrpo.compat.precision --explain measures both); fix: drop them on this host")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="print the precision flags for this host (bf16 where native)")
    ap.add_argument("--explain", action="store_true", help="say why, with both dtypes' measured GFLOP/s, on stderr")
    ap.add_argument("--kernels", action="store_true", help="print only this CPU's bf16 kernels: amx, avx512_bf16 "
                                                           "or emulated")
    args = ap.parse_args(argv)
    bootstrap()
    if args.kernels:
        print(cpu_bf16_kernels())
        return 0
    flags = recommended_precision_flags()
    if args.explain:
        ok, why = native_bf16()
        speeds = ""
        if not torch.cuda.is_available():
            speeds = (f"; one thread: bf16 {matmul_gflops(torch.bfloat16):.1f} GFLOP/s, "
                      f"fp32 {matmul_gflops(torch.float32):.1f} GFLOP/s")
        print(f"[cegrpo] precision: {why}{speeds}; flags: {flags or '(none: fp32)'}", file=sys.stderr)
    print(flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
