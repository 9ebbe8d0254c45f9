"""bench_gpu: what only a GPU can measure (issue 29 item 6): its bf16 matmul rate, and the codec
and PRF kernels beside one decoder layer on it.

    python -m benchmarks.bench_gpu [--dims 576,1536,4096] [--seq-len 256 --micro-batch 4]
                                   [--codecs mask,pcaq:lrq] [--keep-ratio 0.05] [--out FILE]

Needs CUDA (exits with one line otherwise). All timings are CUDA-event medians after warm-up,
side by side in one process:

* ``matmul_bf16_tflops``: an 8192 x 8192 x 8192 bf16 product (10 timed after 3 warm-ups), the
  rate that replaces the projection's assumed 250 TFLOP/s (``benchmarks/projection.py``);
* per hidden size d at [s, b, d] (``--seq-len`` x ``--micro-batch`` tokens, bf16 activations):
  one megatron-core decoder layer's forward + backward (``bench_codec.build_layer``, the local
  spec of the model family using that d); ``prf_ms``: the exact-k index derivation of one
  crossing (``MaskHalf.precompute``, the Threefry-2x32 PRF and the top-k over its scores); per
  codec the critical path of one micro-batch's forward and backward crossing (encode + decode
  each, precompute done), and that as a share of the layer's f+b;
* ``prf_cpu_cuda_equal``: whether the indices derived on the GPU equal the CPU's bit for bit
  (both ends of a boundary derive them; a sender on a GPU and a receiver on a CPU must agree).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from typing import Callable, Dict, List, Optional

import torch

from megatron_cegrpo.bootstrap import bootstrap

DTYPE = torch.bfloat16


def cuda_ms(fn: Callable, reps: int = 20, warmup: int = 3, setup: Optional[Callable] = None) -> float:
    """Median milliseconds of ``fn(setup())`` (``fn()`` without ``setup``) between two CUDA events
    (host launch gaps included); ``setup`` runs before each call, untimed."""
    times = []
    for i in range(warmup + reps):
        arg = setup() if setup is not None else None
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if setup is not None:
            fn(arg)
        else:
            fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops(n: int = 8192) -> float:
    """bf16 TFLOP/s of an n x n x n product (2 n^3 FLOPs)."""
    a = torch.randn(n, n, device="cuda", dtype=DTYPE)
    b = torch.randn(n, n, device="cuda", dtype=DTYPE)
    ms = cuda_ms(lambda: a @ b, reps=10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def prf_equal(d: int, s: int, b: int, keep_ratio: float) -> bool:
    """The exact-k indices of one crossing derived on the CPU and on the GPU, compared exactly."""
    from megatron_cegrpo.compression.prf import exact_k_indices, keep_count

    k = keep_count(d, keep_ratio)
    ids = torch.arange(b, dtype=torch.long) + 1000
    cpu = exact_k_indices(20260731, 3, 17, ids, s, d, k, device="cpu")
    gpu = exact_k_indices(20260731, 3, 17, ids, s, d, k, device="cuda")
    return bool(torch.equal(cpu, gpu.cpu()))


def measure_dim(d: int, s: int, b: int, keep_ratio: float, specs: List[str]) -> List[Dict]:
    """The layer's f+b, the PRF derivation and each codec's critical path at [s, b, d] (ms)."""
    from benchmarks.bench_codec import SEED, boundary_tensors, build_layer
    from megatron_cegrpo.compression import BoundaryContext, build_codec

    layer, rope, family = build_layer(d, DTYPE)
    layer = layer.cuda()
    emb = rope(s).cuda()
    x, grad = (t.cuda() for t in boundary_tensors(s, b, d, DTYPE))
    inp = x.detach().clone().requires_grad_(True)

    def fwd_bwd():
        inp.grad = None
        out = layer(inp, attention_mask=None, rotary_pos_emb=emb)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    layer_ms = cuda_ms(fwd_bwd)
    shape = (s, b, d)
    rows = []
    step = [0]

    def ctx() -> "BoundaryContext":
        return BoundaryContext(seed=SEED, boundary=0, step=step[0], sample_ids=torch.arange(b, dtype=torch.long))

    for spec in specs:
        row = {"codec": spec, "d": d, "tokens": s * b, "layer": family, "layer_fwd_bwd_ms": layer_ms}
        try:
            rows.append(_measure_codec(build_codec(spec, keep_ratio, warn=False), row, x, grad, shape, ctx, step))
        except Exception as e:  # one codec's failure is a row, not the end of the run
            rows.append({**row, "error": f"{type(e).__name__}: {e}"})
    return rows


def _measure_codec(codec, row, x, grad, shape, ctx, step) -> Dict:
    """``row`` with the codec's ``prf_ms`` (its precompute, where it has one) and ``critical_ms``."""

    if codec.precomputes:
        def pre():
            step[0] += 1  # a new step: nothing cached
            codec.precompute(ctx(), shape, torch.device("cuda"))
        row["prf_ms"] = cuda_ms(pre)

    def crossing():
        step[0] += 1
        c = ctx()
        if codec.precomputes:
            codec.precompute(c, shape, torch.device("cuda"))
        return c

    def critical(c):
        y = codec.decode_forward(codec.encode_forward(x, c), c, shape)
        gy = codec.decode_backward(codec.encode_backward(grad, c), c, shape)
        return y, gy

    row["critical_ms"] = cuda_ms(critical, setup=crossing)
    row["share_of_layer_fwd_bwd"] = row["critical_ms"] / row["layer_fwd_bwd_ms"]
    return row


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="576,1536,4096", help="hidden sizes d (comma separated)")
    ap.add_argument("--seq-len", type=int, default=256, help="s: tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=4, help="b: sequences per micro-batch")
    ap.add_argument("--keep-ratio", type=float, default=0.05, help="k = ceil(ratio d)")
    ap.add_argument("--codecs", default="mask,pcaq:lrq,lowrank", help="--boundary-codec specs (comma separated)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    bootstrap()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA device (torch.cuda.is_available() is False); run it on a GPU host")
    from megatron_cegrpo.models import destroy_single_process_megatron, init_single_process_megatron

    created = init_single_process_megatron(seed=1234)
    try:
        res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "python": platform.python_version(), "matmul_bf16_tflops": matmul_tflops(),
               "seq_len": args.seq_len, "micro_batch": args.micro_batch, "rows": [], "prf_cpu_cuda_equal": {}}
        print(f"[bench_gpu] {res['device']}: bf16 matmul 8192^3 {res['matmul_bf16_tflops']:.0f} TFLOP/s", flush=True)
        for d in (int(v) for v in args.dims.split(",")):
            res["prf_cpu_cuda_equal"][d] = prf_equal(d, args.seq_len, args.micro_batch, args.keep_ratio)
            for row in measure_dim(d, args.seq_len, args.micro_batch, args.keep_ratio, args.codecs.split(",")):
                res["rows"].append(row)
                if "error" in row:
                    print(f"[bench_gpu] d={d:5d} {row['codec']:10s} failed: {row['error']}", flush=True)
                    continue
                print(f"[bench_gpu] d={d:5d} {row['codec']:10s} layer f+b {row['layer_fwd_bwd_ms']:7.3f} ms  "
                      f"prf {row.get('prf_ms', float('nan')):7.3f} ms  codec critical {row['critical_ms']:7.3f} ms "
                      f"({100 * row['share_of_layer_fwd_bwd']:.1f} % of the layer)  "
                      f"prf cpu==cuda {res['prf_cpu_cuda_equal'][d]}", flush=True)
    finally:
        destroy_single_process_megatron(destroy_process_group=created)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
