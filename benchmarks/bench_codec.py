"""bench_codec: bytes on the wire per token per boundary, and codec cost vs one transformer layer.

    python -m benchmarks.bench_codec [--dims 576,1024,1536,4096] [--seq-len 256 --micro-batch 4]
                                     [--keep-ratio 0.05] [--wire-dtype bf16] [--out codec.json]

1. Bytes: for each hidden size d, a boundary tensor [s, b, d] (s * b tokens of one
   micro-batch) is encoded by every codec and the payload tensors' bytes are summed
   (forward = activations, backward = the gradient of the receiver's input). Nothing is
   computed from a formula: the numbers are ``numel * element_size`` of what the encoders
   returned. Codecs: the library's ``dense`` and ``mask`` (and ``lowrank`` once it is
   registered; until then the row says n/a), plus reference points a user would otherwise
   pick (``benchmarks/reference_codecs.py``): bf16 top-k (same k as the mask) with int32 or
   int16 indices, and per-token int8 quantization.
2. Time: encode + decode in both directions for one micro-batch, as a fraction of one
   transformer layer's forward + backward at the same shape ([s, b, d], llama-style layer of
   the model family that uses this d; megatron-core's local layer spec), all measured in this
   process with the same thread count. For ``mask`` the PRF index derivation (done once per
   micro-batch and iteration by each end, then cached) is timed separately and charged twice
   (sender and receiver) in the share.

Timing uses ``--compute-dtype`` (fp32 by default: the dtype the CPU trainer runs in); bytes
use ``--wire-dtype`` (bf16 by default: what a GPU pipeline puts on the wire). The bytes
ratio mask/dense is k/d in any dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Callable, List, Optional

import torch
from transformers import LlamaConfig

from benchmarks.reference_codecs import Int8Reference, TopKReference, wire_bytes
from megatron_cegrpo.bootstrap import bootstrap
from megatron_cegrpo.compression import BoundaryContext, available_codecs, get_codec, keep_count
from megatron_cegrpo.models import (destroy_single_process_megatron, init_single_process_megatron,
                                    transformer_config_from_hf)

# d -> (heads, kv heads, ffn, a model family with this hidden size)
LAYER_SHAPES = {
    64: (4, 2, 128, "tiny-llama (test model)"),
    576: (9, 3, 1536, "SmolLM2-135M"),
    1024: (16, 8, 3072, "Qwen3-0.6B"),
    1536: (12, 2, 8960, "Qwen2.5-1.5B"),
    4096: (32, 8, 14336, "Llama-3-8B"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SEED = 20260731


def _layer_shape(d: int):
    if d in LAYER_SHAPES:
        return LAYER_SHAPES[d]
    heads = max(1, d // 64)
    return heads, heads, int(8 * d / 3 + 127) // 128 * 128, f"generic d={d}"


# --------------------------------------------------------------------------- codec adapters


class _Adapter:
    """Uniform view over library and reference codecs: payloads are tuples of tensors."""

    def __init__(self, name: str, enc_f, dec_f, enc_b, dec_b, prf: Optional[Callable] = None, k=None):
        self.name, self.k = name, k
        self.enc_f, self.dec_f, self.enc_b, self.dec_b, self.prf = enc_f, dec_f, enc_b, dec_b, prf


def _library_adapter(name: str, codec, ctx, shape) -> _Adapter:
    def as_tuple(t):
        return (t,)

    def cold_indices():
        codec.clear_cache()
        return codec.indices(ctx, shape[0], shape[2], "cpu")

    prf = cold_indices if (hasattr(codec, "indices") and hasattr(codec, "clear_cache")) else None
    return _Adapter(
        name,
        enc_f=lambda x: as_tuple(codec.encode_forward(x, ctx).contiguous()),
        dec_f=lambda p: codec.decode_forward(p[0], ctx, shape),
        enc_b=lambda g, fp: as_tuple(codec.encode_backward(g, ctx).contiguous()),
        dec_b=lambda p, fp: codec.decode_backward(p[0], ctx, shape),
        prf=prf, k=codec.k(shape[2]) if hasattr(codec, "k") else None)


def build_adapters(d: int, s: int, b: int, keep_ratio: float):
    """(adapters, n/a rows) for hidden size d; ``n/a`` lists codecs that cannot be measured."""
    shape = (s, b, d)
    ctx = BoundaryContext(seed=SEED, boundary=0, step=1, sample_ids=torch.arange(b, dtype=torch.long))
    k = keep_count(d, keep_ratio)
    adapters = [_library_adapter("dense", get_codec("dense"), ctx, shape),
                _library_adapter("mask", get_codec("mask", keep_ratio=keep_ratio), ctx, shape)]
    missing = {}
    if "lowrank" in available_codecs():
        try:
            adapters.append(_library_adapter("lowrank", get_codec("lowrank"), ctx, shape))
        except Exception as e:  # constructor needs arguments this benchmark does not know yet
            missing["lowrank"] = f"n/a (registered, but get_codec('lowrank') failed: {e})"
    else:
        missing["lowrank"] = "n/a (no lowrank codec registered in megatron_cegrpo.compression yet)"
    for idx_dtype in (torch.int32, torch.int16):
        ref = TopKReference(k, idx_dtype)
        adapters.append(_Adapter(ref.name, ref.encode_forward, lambda p, r=ref: r.decode_forward(p, shape),
                                 ref.encode_backward, lambda p, fp, r=ref: r.decode_backward(p, fp, shape), k=k))
    q = Int8Reference()
    adapters.append(_Adapter(q.name, q.encode_forward, lambda p: q.decode_forward(p, shape),
                             q.encode_backward, lambda p, fp: q.decode_backward(p, fp, shape)))
    return adapters, missing


def boundary_tensors(s: int, b: int, d: int, dtype: torch.dtype, seed: int = SEED):
    """An activation-like boundary tensor (a few outlier channels) and a gradient, [s, b, d]."""
    g = torch.Generator().manual_seed(seed + d)
    chan = torch.ones(d)
    chan[torch.randperm(d, generator=g)[: max(1, d // 100)]] = 20.0  # residual-stream outliers
    x = torch.randn(s, b, d, generator=g) * chan
    grad = torch.randn(s, b, d, generator=g) * 1e-3
    return x.to(dtype), grad.to(dtype)


# --------------------------------------------------------------------------- bytes


def measure_bytes(d: int, s: int, b: int, keep_ratio: float = 0.05, wire_dtype: torch.dtype = torch.bfloat16):
    """Encode one micro-batch [s, b, d] with every codec; bytes are summed from the payloads.

    Returns a list of dict rows: codec, d, k, tokens, fwd_bytes, bwd_bytes (per micro-batch),
    fwd/bwd_bytes_per_token, ratio_vs_dense ((fwd + bwd) / dense (fwd + bwd)), or
    ``{"codec": name, "note": "n/a ..."}`` for codecs that do not exist.
    """
    adapters, missing = build_adapters(d, s, b, keep_ratio)
    x, grad = boundary_tensors(s, b, d, wire_dtype)
    tokens = s * b
    rows = []
    for a in adapters:
        fp = a.enc_f(x)
        bp = a.enc_b(grad, fp)
        rows.append({"codec": a.name, "d": d, "k": a.k, "tokens": tokens, "wire_dtype": str(wire_dtype),
                     "fwd_bytes": wire_bytes(fp), "bwd_bytes": wire_bytes(bp),
                     "fwd_bytes_per_token": wire_bytes(fp) / tokens, "bwd_bytes_per_token": wire_bytes(bp) / tokens})
    dense = next(r for r in rows if r["codec"] == "dense")
    for r in rows:
        r["ratio_vs_dense"] = (r["fwd_bytes"] + r["bwd_bytes"]) / (dense["fwd_bytes"] + dense["bwd_bytes"])
    for name, note in missing.items():
        rows.append({"codec": name, "d": d, "note": note})
    return rows


# --------------------------------------------------------------------------- time


def _timeit(fn: Callable[[], object], min_time: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds of ``fn()`` after one warm-up call (at least min_reps calls, ~min_time s)."""
    fn()
    times: List[float] = []
    t_start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - t_start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_layer(d: int, dtype: torch.dtype):
    """One megatron-core decoder layer (local spec, RMSNorm, SwiGLU, GQA, RoPE) at hidden size d."""
    # megatron-core warns at import: imported here, after main()'s bootstrap()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    heads, kv, ffn, family = _layer_shape(d)
    cfg = LlamaConfig(hidden_size=d, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn,
                      num_hidden_layers=1, vocab_size=128, max_position_embeddings=32768)
    tf = transformer_config_from_hf(cfg, params_dtype=dtype)
    layer = build_module(get_gpt_layer_local_spec(normalization="RMSNorm"), config=tf, layer_number=1)
    rope = RotaryEmbedding(kv_channels=tf.kv_channels, rotary_percent=1.0, rotary_base=10000)
    return layer, rope, family


def measure_time(d: int, s: int, b: int, keep_ratio: float = 0.05, dtype: torch.dtype = torch.float32,
                 min_time: float = 1.0, layer_min_reps: int = 2):
    """One layer's forward+backward and each codec's encode/decode time (ms) at [s, b, d], same process."""
    layer, rope, family = build_layer(d, dtype)
    emb = rope(s)
    x, grad = boundary_tensors(s, b, d, dtype)
    inp = x.detach().clone().requires_grad_(True)
    state = {}

    def fwd_bwd():
        inp.grad = None
        out = layer(inp, attention_mask=None, rotary_pos_emb=emb)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    layer_fwd_bwd = _timeit(fwd_bwd, min_time, min_reps=layer_min_reps)
    layer = None  # free the weights (and grads) before timing the codecs

    adapters, missing = build_adapters(d, s, b, keep_ratio)
    rows = []
    for a in adapters:
        state["fp"] = a.enc_f(x)
        state["bp"] = a.enc_b(grad, state["fp"])
        t = {
            "encode_fwd_ms": _timeit(lambda: a.enc_f(x), min_time / 4) * 1e3,
            "decode_fwd_ms": _timeit(lambda: a.dec_f(state["fp"]), min_time / 4) * 1e3,
            "encode_bwd_ms": _timeit(lambda: a.enc_b(grad, state["fp"]), min_time / 4) * 1e3,
            "decode_bwd_ms": _timeit(lambda: a.dec_b(state["bp"], state["fp"]), min_time / 4) * 1e3,
        }
        t["codec_ms"] = sum(t.values())
        t["prf_ms"] = _timeit(a.prf, min_time / 4) * 1e3 if a.prf else 0.0
        total = t["codec_ms"] + 2 * t["prf_ms"]
        rows.append({"codec": a.name, "d": d, "tokens": s * b, "dtype": str(dtype), "layer": family,
                     "layer_fwd_bwd_ms": layer_fwd_bwd * 1e3, **t,
                     "codec_total_ms": total, "share_of_layer_fwd_bwd": total / (layer_fwd_bwd * 1e3),
                     "share_without_prf": t["codec_ms"] / (layer_fwd_bwd * 1e3)})
    for name, note in missing.items():
        rows.append({"codec": name, "d": d, "note": note})
    return rows


# --------------------------------------------------------------------------- report


def _fmt_bytes_table(rows) -> str:
    out = [f"{'d':>5} {'codec':<9} {'k':>5} {'fwd B/tok':>10} {'bwd B/tok':>10} {'vs dense':>9}"]
    for r in rows:
        if "note" in r:
            out.append(f"{r['d']:>5} {r['codec']:<9} {'':>5} {r['note']}")
            continue
        out.append(f"{r['d']:>5} {r['codec']:<9} {r['k'] if r['k'] else '':>5} {r['fwd_bytes_per_token']:>10.1f} "
                   f"{r['bwd_bytes_per_token']:>10.1f} {r['ratio_vs_dense']:>9.4f}")
    return "\n".join(out)


def _fmt_time_table(rows) -> str:
    out = [f"{'d':>5} {'codec':<9} {'enc+dec ms':>10} {'prf ms':>8} {'layer f+b ms':>12} {'share':>8} "
           f"{'w/o prf':>8}   layer"]
    for r in rows:
        if "note" in r:
            out.append(f"{r['d']:>5} {r['codec']:<9} {r['note']}")
            continue
        out.append(f"{r['d']:>5} {r['codec']:<9} {r['codec_ms']:>10.3f} {r['prf_ms']:>8.3f} "
                   f"{r['layer_fwd_bwd_ms']:>12.1f} {100 * r['share_of_layer_fwd_bwd']:>7.2f}% "
                   f"{100 * r['share_without_prf']:>7.3f}%   {r['layer']}")
    return "\n".join(out)


def _machine_info(threads: int) -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "threads": threads, "loadavg_start": os.getloadavg(), "platform": platform.platform()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="576,1024,1536,4096", help="hidden sizes d (comma separated)")
    ap.add_argument("--seq-len", type=int, default=256, help="s: tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=4, help="b: sequences per micro-batch")
    ap.add_argument("--keep-ratio", type=float, default=0.05, help="mask / top-k keep ratio (k = ceil(ratio d))")
    ap.add_argument("--wire-dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the byte measurement")
    ap.add_argument("--compute-dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the timing")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the timing (default 1)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per timed quantity (approx.)")
    ap.add_argument("--bytes-only", action="store_true", help="skip the timing")
    ap.add_argument("--time-dims", default=None, help="hidden sizes to time (default: --dims)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    bootstrap(num_threads=args.threads)  # first thing after parsing the flags (it needs --threads)
    dims = [int(v) for v in args.dims.split(",") if v]
    time_dims = dims if args.time_dims is None else [int(v) for v in args.time_dims.split(",") if v]
    s, b = args.seq_len, args.micro_batch
    result = {"config": vars(args), "machine": _machine_info(args.threads), "bytes": [], "time": []}

    print(f"bench_codec: boundary tensor [s={s}, b={b}, d] = {s * b} tokens per micro-batch, "
          f"keep ratio {args.keep_ratio}, bytes in {args.wire_dtype}")
    for d in dims:
        result["bytes"].extend(measure_bytes(d, s, b, args.keep_ratio, DTYPES[args.wire_dtype]))
    print("\nBytes per token per boundary per direction (measured from the encoded payloads):")
    print(_fmt_bytes_table(result["bytes"]))

    if not args.bytes_only and time_dims:
        created = init_single_process_megatron(seed=1234)
        torch.set_num_threads(args.threads)
        try:
            for d in time_dims:
                t0 = time.perf_counter()
                rows = measure_time(d, s, b, args.keep_ratio, DTYPES[args.compute_dtype], args.min_time)
                result["time"].extend(rows)
                print(f"  timed d={d} in {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            destroy_single_process_megatron(destroy_process_group=created)
        print(f"\nCodec time per micro-batch crossing (encode+decode, forward and backward; {args.compute_dtype}, "
              f"{args.threads} thread(s)) vs one transformer layer forward+backward at the same shape.\n"
              "share = (enc+dec + 2 x prf) / layer f+b; prf = mask index derivation, once per end per micro-batch\n"
              "(cacheable, and computable before the step: it depends only on seed, boundary, step, sample ids);\n"
              "w/o prf = enc+dec / layer f+b (indices already cached):")
        print(_fmt_time_table(result["time"]))
    result["machine"]["loadavg_end"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
