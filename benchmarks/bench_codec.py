"""bench_codec: bytes on the wire per token per boundary, and codec cost vs one transformer layer.

    python -m benchmarks.bench_codec [--dims 576,1024,1536,4096] [--seq-len 256 --micro-batch 4]
                                     [--keep-ratio 0.05] [--wire-dtype bf16] [--out codec.json]
                                     [--codecs mask,pcaq:lrq,rpq/passes=2:lrq] [--passes 3]

Codecs: ``--codecs`` (comma-separated ``--boundary-codec`` specs), by default every registered
codec (``available_codecs()``) and the pair specs :data:`PAIR_SPECS` (``dense:mask``,
``mask:mask``, ``pcaq:lrq``, ``rpq:lrq``, ``rpq/passes=2:lrq`` and the warm-started-basis variants
``pcaq/warm=1:lrq/warm=1``, ``rpq/warm=1:lrq/warm=1``, ``rpq/passes=2/warm=1:lrq/warm=1``), each built by
``compression.build_codec(spec, --keep-ratio)`` exactly as the trainer's ``--boundary-codec
SPEC --boundary-keep-ratio R`` builds it; a spec that cannot be built, or cannot code the
shape (a budget with no coefficient bits), gets an n/a row with the reason. Plus reference
points a user would otherwise pick (``benchmarks/reference_codecs.py``; bytes always, timing
unless ``--no-references``): bf16 top-k (same k as the mask) with int32 or int16 indices, and
per-token int8 quantization.

A micro-batch crosses a boundary forward P times per iteration (``--passes``, default 3: the
old-logprob, reference and update passes; an ``rpq`` forward half uses its own ``passes``)
and backward once (the update pass). The FIRST forward crossing of a micro-batch in a step
and a LATER one differ for stateful halves: ``pcaq`` computes and sends the step's basis on
the first message of the step, ``rpq`` codes its first crossing with the budget of all P and
a later one as a coded delta to it. Both are measured (the later crossing sends
:func:`repeat_tensor`, x plus 1 % noise, as the reference pass does).

1. Bytes: for each hidden size d, a boundary tensor [s, b, d] (s * b tokens of one
   micro-batch) is encoded by every codec and the payload tensors' bytes are summed
   (forward = activations, backward = the gradient of the receiver's input). Nothing is
   computed from a formula: the numbers are ``numel * element_size`` of what the encoders
   returned (first and later forward crossing, backward, and the per-iteration ratio).
2. Time (issue 10 item 6): per micro-batch, every repetition with a new context (as every
   training step has), split into what is on the critical path and what is not, each as a
   fraction of one transformer layer's forward + backward at the same shape ([s, b, d],
   llama-style layer of the model family that uses this d; megatron-core's local layer spec),
   all measured in this process with the same thread count, the layer run interleaved with
   every codec's repetitions (each codec's share uses the layer runs interleaved with it):
   * off-path: the codec's ``precompute`` (for ``mask`` and a pair's mask halves the PRF index
     derivation), which the trainer runs on a background thread for every crossing of an
     iteration as soon as the batch is known (``pipeline/prefetch.py``); charged twice
     (sender and receiver);
   * critical path: encode + decode of the first forward crossing and of the backward
     ("critical"), of a later forward crossing and the backward ("later"), and
     first + (P - 1) later + backward ("iter": a micro-batch's codec time per iteration, still
     against ONE layer f+b), timed after that precompute; any work a codec does lazily (no
     precompute, a crossing nobody announced, a data-dependent basis) lands here; a
     ``warm=1`` half's basis is timed in its steady state (the untimed warm-up repetition
     leaves it a previous basis; its cost does not depend on the data);
   * "no prefetch": critical + off-path, i.e. the crossing's cost if the precompute ran inline.
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
from megatron_cegrpo.compression import BoundaryContext, MaskHalf, available_codecs, build_codec, keep_count
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
# the pair specs (``FWD:BWD``, compression/spec.py) that matter: the trainer's candidates of issue 10,
# their warm-started-basis variants (``warm=1``: one x^T (x V_prev) subspace iteration instead of a
# d x d eigh per basis) and lagged ones (``lag=1``: that iteration on a background thread, on the
# previous message; ``compression/subspace.py``), side by side with the fresh-eigh ones
_LAG = "/warm=1/lag=1"
PAIR_SPECS = ("dense:mask", "mask:mask", "pcaq:lrq", "rpq:lrq", "rpq/passes=2:lrq",
              "pcaq/warm=1:lrq/warm=1", "rpq/warm=1:lrq/warm=1", "rpq/passes=2/warm=1:lrq/warm=1",
              f"pcaq{_LAG}:lrq{_LAG}", f"rpq{_LAG}:lrq{_LAG}", f"rpq/passes=2{_LAG}:lrq{_LAG}")
DEFAULT_PASSES = 3  # forward crossings of a micro-batch per iteration in the demo: old-logprob, reference, update
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SEED = 20260731


def _layer_shape(d: int):
    if d in LAYER_SHAPES:
        return LAYER_SHAPES[d]
    heads = max(1, d // 64)
    return heads, heads, int(8 * d / 3 + 127) // 128 * 128, f"generic d={d}"


# --------------------------------------------------------------------------- codec adapters


def _ctx(step: int, b: int) -> BoundaryContext:
    return BoundaryContext(seed=SEED, boundary=0, step=step, sample_ids=torch.arange(b, dtype=torch.long))


class _Adapter:
    """Uniform view over library and reference codecs (payload: a tensor or a tuple of tensors).

    Every call takes the crossing's context ``ctx`` (reference codecs ignore it);
    ``precompute(ctx)`` is None for codecs with nothing to derive ahead of the crossing.
    """

    def __init__(self, name: str, enc_f, dec_f, enc_b, dec_b, precompute: Optional[Callable] = None, k=None,
                 passes: Optional[int] = None, halves=()):
        self.name, self.k, self.passes = name, k, passes
        self.enc_f, self.dec_f, self.enc_b, self.dec_b, self.precompute = enc_f, dec_f, enc_b, dec_b, precompute
        self.halves = list(halves)  # halves with a lagged basis (lag=1; _library_adapter picks them)

    def settle(self) -> float:
        """Wait for the halves' background basis updates (``lag=1``: a worker thread builds the
        next basis after each encode); returns their cumulative wall seconds so far."""
        for h in self.halves:
            h._settle()
        return sum(h.background_s for h in self.halves)


def _library_adapter(name: str, codec, shape) -> _Adapter:
    from megatron_cegrpo.compression.repeat import RepeatPcaHalf
    from megatron_cegrpo.compression.subspace import SubspaceQuantHalf

    fwd = codec.fwd  # rpq plans its budget for `passes`
    return _Adapter(
        name,
        enc_f=lambda x, ctx: codec.encode_forward(x, ctx),
        dec_f=lambda p, ctx: codec.decode_forward(p, ctx, shape),
        enc_b=lambda g, ctx, fp: codec.encode_backward(g, ctx),
        dec_b=lambda p, ctx, fp: codec.decode_backward(p, ctx, shape),
        precompute=(lambda ctx: codec.precompute(ctx, shape, "cpu")) if codec.precomputes else None,
        k=fwd.k(shape[2]) if isinstance(fwd, MaskHalf) else None,
        passes=fwd.passes if isinstance(fwd, RepeatPcaHalf) else None,
        halves=[h for h in (fwd, codec.bwd) if isinstance(h, SubspaceQuantHalf) and h.lag])


def _reference_adapter(ref, shape) -> _Adapter:
    return _Adapter(ref.name, lambda x, ctx: ref.encode_forward(x), lambda p, ctx: ref.decode_forward(p, shape),
                    lambda g, ctx, fp: ref.encode_backward(g, fp), lambda p, ctx, fp: ref.decode_backward(p, fp, shape),
                    k=ref.k if isinstance(ref, TopKReference) else None)


def default_specs() -> List[str]:
    """Every registered codec name (``available_codecs()``), then :data:`PAIR_SPECS`."""
    return list(available_codecs()) + [p for p in PAIR_SPECS if p not in available_codecs()]


def build_adapters(d: int, s: int, b: int, keep_ratio: float, specs: Optional[List[str]] = None,
                   references: bool = True):
    """(adapters, n/a rows) for hidden size d: each of ``specs`` (default :func:`default_specs`:
    every registered codec and the pair specs), built by ``build_codec`` as
    ``--boundary-codec SPEC --boundary-keep-ratio keep_ratio`` builds it in the trainer, then
    (``references``) the reference encodings; ``n/a`` maps specs that cannot be built to the
    reason."""
    shape = (s, b, d)
    adapters, missing = [], {}
    for name in (default_specs() if specs is None else specs):
        try:
            adapters.append(_library_adapter(name, build_codec(name, keep_ratio, warn=False), shape))
        except Exception as e:  # a constructor that needs arguments this benchmark does not know
            missing[name] = f"n/a (registered, but build_codec({name!r}) failed: {e})"
    k = keep_count(d, keep_ratio)
    for ref in (TopKReference(k, torch.int32), TopKReference(k, torch.int16), Int8Reference()) if references else ():
        adapters.append(_reference_adapter(ref, shape))
    return adapters, missing


def boundary_tensors(s: int, b: int, d: int, dtype: torch.dtype, seed: int = SEED):
    """An activation-like boundary tensor (a few outlier channels) and a gradient, [s, b, d]."""
    g = torch.Generator().manual_seed(seed + d)
    chan = torch.ones(d)
    chan[torch.randperm(d, generator=g)[: max(1, d // 100)]] = 20.0  # residual-stream outliers
    x = torch.randn(s, b, d, generator=g) * chan
    grad = torch.randn(s, b, d, generator=g) * 1e-3
    return x.to(dtype), grad.to(dtype)


def repeat_tensor(x: torch.Tensor, rel: float = 0.01, seed: int = SEED) -> torch.Tensor:
    """What a later crossing of the same micro-batch sends: ``x`` [s, b, d] plus Gaussian noise
    of ``rel`` times x's RMS (the reference model's or a later epoch's activations; the update
    pass of a one-step iteration resends x itself), in x's dtype."""
    g = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(x.shape, generator=g) * (rel * float(x.float().pow(2).mean().sqrt()))
    return (x.float() + noise).to(x.dtype)


# --------------------------------------------------------------------------- bytes


def _passes(a: _Adapter, passes: int) -> int:
    """Forward crossings per micro-batch and iteration for codec ``a``: its forward half's own
    plan (``rpq/passes=P``) when it has one, else ``passes``."""
    return int(a.passes) if a.passes else int(passes)


def measure_bytes(d: int, s: int, b: int, keep_ratio: float = 0.05, wire_dtype: torch.dtype = torch.bfloat16,
                  specs: Optional[List[str]] = None, passes: int = DEFAULT_PASSES):
    """Encode one micro-batch [s, b, d] with every codec; bytes are summed from the payloads.

    Per codec (a fresh instance) and crossing context: the FIRST forward crossing of the
    micro-batch in its step (for ``pcaq``/``rpq`` it carries the step's basis; ``rpq`` codes it
    with the budget of all ``passes`` crossings), one LATER forward crossing of the same
    micro-batch (same context; ``rpq``: the coded delta to the first, here of a changed tensor,
    :func:`repeat_tensor`) and the backward message.

    Returns:
        list of dict rows: codec, d, k, tokens, fwd_bytes, bwd_bytes (per micro-batch, first
        crossing), fwd/bwd_bytes_per_token, ratio_vs_dense ((fwd + bwd) / dense (fwd + bwd)),
        fwd_bytes_repeat (the later crossing), passes (P: the codec's own ``rpq/passes``, else
        ``passes``), iter_ratio_vs_dense ((fwd + (P - 1) fwd_repeat + bwd) / ((P + 1) dense)),
        the bytes of one micro-batch's iteration; or ``{"codec": name, "note": "n/a ..."}``
        for codecs that cannot be built.
    """
    adapters, missing = build_adapters(d, s, b, keep_ratio, specs)
    x, grad = boundary_tensors(s, b, d, wire_dtype)
    x_rep = repeat_tensor(x)
    tokens = s * b
    dense_b = tokens * d * torch.empty((), dtype=wire_dtype).element_size()
    rows = []
    for a in adapters:
        ctx = _ctx(1, b)
        try:
            fp = a.enc_f(x, ctx)
            a.dec_f(fp, ctx)  # the receiver's state of a first crossing (rpq, pcaq)
            fr = a.enc_f(x_rep, ctx)
            bp = a.enc_b(grad, ctx, fp)
        except ValueError as e:  # e.g. a budget that leaves no coefficient bits at this shape
            missing[a.name] = f"n/a at [{s}, {b}, {d}] {wire_dtype}: {e}"
            continue
        p = _passes(a, passes)
        f, fr, bw = wire_bytes(fp), wire_bytes(fr), wire_bytes(bp)
        rows.append({"codec": a.name, "d": d, "k": a.k, "tokens": tokens, "wire_dtype": str(wire_dtype),
                     "fwd_bytes": f, "bwd_bytes": bw, "fwd_bytes_per_token": f / tokens,
                     "bwd_bytes_per_token": bw / tokens, "fwd_bytes_repeat": fr, "passes": p,
                     "iter_ratio_vs_dense": (f + (p - 1) * fr + bw) / ((p + 1) * dense_b)})
    dense = next((r for r in rows if r["codec"] == "dense"), None)
    for r in rows:
        r["ratio_vs_dense"] = (r["fwd_bytes"] + r["bwd_bytes"]) / (2 * dense_b)
    assert dense is None or dense["fwd_bytes"] == dense["bwd_bytes"] == dense_b
    for name, note in missing.items():
        rows.append({"codec": name, "d": d, "note": note})
    return rows


# --------------------------------------------------------------------------- time


#: the clock of every timed interval (``--clock``): wall time (default) or the calling thread's
#: CPU time (``time.thread_time``: robust to a machine shared with other jobs, which deschedule
#: this one; both the layer and the codec are timed with it, so the shares stay side by side)
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
_CLOCK = [time.perf_counter]


def _now() -> float:
    return _CLOCK[0]()


def _timeit(fn: Callable[[], object], min_time: float, min_reps: int = 3, max_reps: int = 200,
            samples: bool = False):
    """Median seconds of ``fn()`` after one warm-up call (at least min_reps calls, ~min_time s);
    ``samples``: the list of every timed call's seconds instead."""
    fn()
    times: List[float] = []
    t_start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - t_start < min_time and len(times) < max_reps):
        t0 = _now()
        fn()
        times.append(_now() - t0)
    return times if samples else statistics.median(times)


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


def _untimed(fn: Callable[[], object]) -> float:
    """Run ``fn``; return the seconds it took (subtracted from the interval being timed)."""
    t0 = _now()
    fn()
    return _now() - t0


def time_codec(a: _Adapter, x: torch.Tensor, grad: torch.Tensor, min_time: float, min_reps: int = 5,
               max_reps: int = 200, x_rep: Optional[torch.Tensor] = None,
               layer: Optional[Callable[[], object]] = None) -> dict:
    """Median ms of each codec call for one micro-batch's crossings, every repetition a new step.

    Repetition i uses a context never seen before (step i), as every training step does: the
    codec cannot reuse anything but what it derives per context. Per repetition, in order:
    ``precompute(ctx)`` (off the critical path: in training a background thread runs it for
    every crossing of the iteration when the batch is known, ``pipeline/prefetch.py``); the
    FIRST forward crossing of the micro-batch (encode, decode of ``x``: for ``pcaq``/``rpq`` the
    step's basis is computed here); one LATER forward crossing of the same micro-batch (same
    context, tensor ``x_rep``, default ``x``: ``rpq``'s delta path, ``pcaq``'s reuse of the step
    basis, the mask's cached indices); then the backward message (encode, decode of ``grad``).
    All of these are on the critical path: anything a codec derives lazily inside them (no
    precompute, or a crossing not prefetched) is timed there. One untimed warm-up first.
    ``layer``: a callable (one layer's forward + backward) run and timed at the start of every
    repetition, so that codec and layer see the same machine load (interleaved).

    A half with ``lag=1`` starts its next basis on a background thread after each encode; the
    loop waits for it after the encode, untimed (in training it overlaps the sender's compute
    until its next crossing at that boundary), and reports its wall time as ``background_ms``.

    Returns:
        {"precompute_ms", "encode_fwd_ms", "decode_fwd_ms", "repeat_encode_fwd_ms",
        "repeat_decode_fwd_ms", "encode_bwd_ms", "decode_bwd_ms", "background_ms", "reps"} and,
        with ``layer``, "layer_ms": medians in ms over the repetitions (precompute_ms 0.0 when
        there is none; background_ms the background basis work per repetition, 0.0 without lag).
    """
    x_rep = x if x_rep is None else x_rep
    keys = ("precompute_ms", "encode_fwd_ms", "decode_fwd_ms", "repeat_encode_fwd_ms", "repeat_decode_fwd_ms",
            "encode_bwd_ms", "decode_bwd_ms")
    samples = {k: [] for k in keys}
    b = x.shape[1]
    t_start, step = time.perf_counter(), 1_000_000  # far from the steps of measure_bytes
    while step - 1_000_000 < min_reps + 1 or (time.perf_counter() - t_start < min_time
                                              and step - 1_000_000 < max_reps + 1):
        ctx = _ctx(step, b)
        if layer is not None:
            t_layer = _now()
            layer()
            t_layer = _now() - t_layer
        bg0 = a.settle()
        t = [_now()]
        if a.precompute is not None:
            a.precompute(ctx)
        t.append(_now())
        fp = a.enc_f(x, ctx)
        t.append(_now())
        pause = _untimed(a.settle)
        a.dec_f(fp, ctx)
        t.append(_now() - pause)
        fr = a.enc_f(x_rep, ctx)
        t.append(_now() - pause)
        pause += _untimed(a.settle)
        a.dec_f(fr, ctx)
        t.append(_now() - pause)
        bp = a.enc_b(grad, ctx, fp)
        t.append(_now() - pause)
        pause += _untimed(a.settle)
        a.dec_b(bp, ctx, fp)
        t.append(_now() - pause)
        bg = a.settle() - bg0
        if step > 1_000_000:  # the first repetition is the warm-up
            for i, k in enumerate(keys):
                samples[k].append((t[i + 1] - t[i]) * 1e3)
            samples.setdefault("background_ms", []).append(bg * 1e3)
            if layer is not None:
                samples.setdefault("layer_ms", []).append(t_layer * 1e3)
        step += 1
    out = {k: statistics.median(v) for k, v in samples.items()}
    if a.precompute is None:
        out["precompute_ms"] = 0.0  # (what was timed is an empty interval)
    out["reps"] = len(samples["precompute_ms"])
    return out


def measure_time(d: int, s: int, b: int, keep_ratio: float = 0.05, dtype: torch.dtype = torch.float32,
                 min_time: float = 1.0, layer_min_reps: int = 2, specs: Optional[List[str]] = None,
                 passes: int = DEFAULT_PASSES, references: bool = True):
    """One layer's forward+backward and each codec's per-crossing time (ms) at [s, b, d], same process.

    The layer runs interleaved with each codec's repetitions (one layer forward+backward, then
    the codec's crossings, repeated; the machine may be shared): a row's ``layer_fwd_bwd_ms`` is
    the median of the layer runs interleaved with that codec, so that its shares are
    side-by-side ratios; ``layer_before_ms`` / ``layer_after_ms``: medians of a layer-only run
    before the first and after the last codec.
    Row keys (ms per micro-batch; ``time_codec`` for what each call is):

    * ``critical_ms`` = first forward crossing (encode + decode) + backward (encode + decode),
      with the crossing's precompute already done; ``share_of_layer_fwd_bwd`` = critical_ms /
      layer f+b: THE critical-path share (issue 10 item 6);
    * ``repeat_critical_ms`` = a later forward crossing + backward; ``repeat_share`` likewise;
    * ``iteration_critical_ms`` = first fwd + (P - 1) later fwd + one backward: a micro-batch's
      critical-path codec time in one iteration of P forward crossings (``passes``: the codec's
      own ``rpq/passes``, else ``passes``; the backward crosses once, in the update pass);
      ``iteration_share`` = that / ONE layer f+b (conservative: the layer itself also runs
      P - 1 extra forwards per iteration);
    * ``precompute_ms`` = the codec's work ahead of the crossing at one end (both ends do it);
      ``background_ms`` = the sender's background basis updates of a ``lag=1`` half;
      ``offpath_share`` = (2 x precompute_ms + background_ms) / layer f+b;
      ``share_without_prefetch`` = (critical_ms + 2 x precompute_ms + background_ms) / layer
      f+b, what the crossing costs when nothing is prefetched or overlapped (masks derived on
      demand at both ends, the lagged basis inline).
    """
    layer, rope, family = build_layer(d, dtype)
    emb = rope(s)
    x, grad = boundary_tensors(s, b, d, dtype)
    x_rep = repeat_tensor(x)
    inp = x.detach().clone().requires_grad_(True)

    def fwd_bwd():
        inp.grad = None
        out = layer(inp, attention_mask=None, rotary_pos_emb=emb)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    adapters, missing = build_adapters(d, s, b, keep_ratio, specs, references)
    timed = []
    before = _timeit(fwd_bwd, min_time, min_reps=layer_min_reps, samples=True)
    for a in adapters:
        try:  # the layer runs interleaved with the codec's repetitions: its share is a side-by-side ratio
            t = time_codec(a, x, grad, min_time / 2, x_rep=x_rep, layer=fwd_bwd)
        except ValueError as e:  # e.g. a budget that leaves no coefficient bits at this shape
            missing[a.name] = f"n/a at [{s}, {b}, {d}] {dtype}: {e}"
            continue
        timed.append((a, t, t.pop("layer_ms")))
    after = _timeit(fwd_bwd, min_time, min_reps=layer_min_reps, samples=True)
    layer = None
    rows = []
    for a, t, layer_ms in timed:
        fwd, bwd = t["encode_fwd_ms"] + t["decode_fwd_ms"], t["encode_bwd_ms"] + t["decode_bwd_ms"]
        rep = t["repeat_encode_fwd_ms"] + t["repeat_decode_fwd_ms"]
        p = _passes(a, passes)
        crit, rcrit, icrit = fwd + bwd, rep + bwd, fwd + (p - 1) * rep + bwd
        rows.append({"codec": a.name, "d": d, "tokens": s * b, "dtype": str(dtype), "layer": family,
                     "layer_fwd_bwd_ms": layer_ms, "layer_before_ms": statistics.median(before) * 1e3,
                     "layer_after_ms": statistics.median(after) * 1e3, **t,
                     "has_precompute": a.precompute is not None, "passes": p,
                     "critical_ms": crit, "share_of_layer_fwd_bwd": crit / layer_ms,
                     "repeat_critical_ms": rcrit, "repeat_share": rcrit / layer_ms,
                     "iteration_critical_ms": icrit, "iteration_share": icrit / layer_ms,
                     "offpath_share": (2 * t["precompute_ms"] + t["background_ms"]) / layer_ms,
                     "share_without_prefetch": (crit + 2 * t["precompute_ms"] + t["background_ms"]) / layer_ms})
    for name, note in missing.items():
        rows.append({"codec": name, "d": d, "note": note})
    return rows


# --------------------------------------------------------------------------- report


W = 31  # codec column width (pair specs such as rpq/passes=2/warm=1:lrq/warm=1)


def _fmt_bytes_table(rows) -> str:
    out = [f"{'d':>5} {'codec':<{W}} {'k':>5} {'fwd B/tok':>10} {'bwd B/tok':>10} {'vs dense':>9} "
           f"{'later fwd B/tok':>15} {'P':>2} {'iter vs dense':>13}"]
    for r in rows:
        if "note" in r:
            out.append(f"{r['d']:>5} {r['codec']:<{W}} {'':>5} {r['note']}")
            continue
        out.append(f"{r['d']:>5} {r['codec']:<{W}} {r['k'] if r['k'] else '':>5} {r['fwd_bytes_per_token']:>10.1f} "
                   f"{r['bwd_bytes_per_token']:>10.1f} {r['ratio_vs_dense']:>9.4f} "
                   f"{r['fwd_bytes_repeat'] / r['tokens']:>15.1f} {r['passes']:>2} {r['iter_ratio_vs_dense']:>13.4f}")
    return "\n".join(out)


def _fmt_time_table(rows) -> str:
    out = [f"{'d':>5} {'codec':<{W}} {'first ms':>9} {'later ms':>9} {'P':>2} {'iter ms':>9} {'precomp ms':>10} "
           f"{'layer ms':>9} {'critical':>9} {'later':>8} {'iter':>8} {'off-path':>9} {'no prefetch':>11}   layer"]
    for r in rows:
        if "note" in r:
            out.append(f"{r['d']:>5} {r['codec']:<{W}} {r['note']}")
            continue
        offpath = r["has_precompute"] or r.get("background_ms", 0.0) > 0
        pre = (f"{r['precompute_ms'] + r.get('background_ms', 0.0):>10.3f}" if offpath else f"{'-':>10}")
        off = f"{100 * r['offpath_share']:>8.2f}%" if offpath else f"{'-':>9}"
        out.append(f"{r['d']:>5} {r['codec']:<{W}} {r['critical_ms']:>9.3f} {r['repeat_critical_ms']:>9.3f} "
                   f"{r['passes']:>2} {r['iteration_critical_ms']:>9.3f} {pre} {r['layer_fwd_bwd_ms']:>9.1f} "
                   f"{100 * r['share_of_layer_fwd_bwd']:>8.3f}% {100 * r['repeat_share']:>7.3f}% "
                   f"{100 * r['iteration_share']:>7.3f}% {off} {100 * r['share_without_prefetch']:>10.2f}%"
                   f"   {r['layer']}")
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
    ap.add_argument("--codecs", default=None,
                    help="comma-separated --boundary-codec specs, built by build_codec (default: every registered "
                         f"codec, then {', '.join(PAIR_SPECS)})")
    ap.add_argument("--passes", type=int, default=DEFAULT_PASSES,
                    help="forward crossings per micro-batch and iteration for the per-iteration total (default 3: "
                         "old-logprob, reference, update); an rpq forward half uses its own passes")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="timer of the codec and layer intervals: wall (default) or thread (this thread's CPU "
                         "time, for a shared machine)")
    ap.add_argument("--no-references", action="store_true", help="time only the --codecs (bytes keep the references)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    bootstrap(num_threads=args.threads)  # first thing after parsing the flags (it needs --threads)
    if args.clock == "thread" and args.threads != 1:
        ap.error(f"--clock thread counts the calling thread's CPU time only, so it needs --threads 1 "
                 f"(got --threads {args.threads}); fix: --threads 1, or --clock wall")
    _CLOCK[0] = CLOCKS[args.clock]
    dims = [int(v) for v in args.dims.split(",") if v]
    time_dims = dims if args.time_dims is None else [int(v) for v in args.time_dims.split(",") if v]
    s, b = args.seq_len, args.micro_batch
    specs = None if args.codecs is None else [c.strip() for c in args.codecs.split(",") if c.strip()]
    if specs is not None and not specs:
        ap.error("--codecs: no spec given")
    result = {"config": vars(args), "machine": _machine_info(args.threads), "bytes": [], "time": []}

    print(f"bench_codec: boundary tensor [s={s}, b={b}, d] = {s * b} tokens per micro-batch, "
          f"keep ratio {args.keep_ratio}, bytes in {args.wire_dtype}")
    for d in dims:
        result["bytes"].extend(measure_bytes(d, s, b, args.keep_ratio, DTYPES[args.wire_dtype], specs, args.passes))
    print("\nBytes per token per boundary per direction (measured from the encoded payloads; fwd = the first\n"
          "crossing of the micro-batch in its step, later fwd = a later crossing of it, P = forward crossings per\n"
          "iteration, iter = (fwd + (P-1) later + bwd) / ((P+1) dense)):")
    print(_fmt_bytes_table(result["bytes"]))

    if not args.bytes_only and time_dims:
        created = init_single_process_megatron(seed=1234)
        torch.set_num_threads(args.threads)
        try:
            for d in time_dims:
                t0 = time.perf_counter()
                rows = measure_time(d, s, b, args.keep_ratio, DTYPES[args.compute_dtype], args.min_time,
                                    specs=specs, passes=args.passes, references=not args.no_references)
                result["time"].extend(rows)
                print(f"  timed d={d} in {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            destroy_single_process_megatron(destroy_process_group=created)
        print(f"\nCodec time per micro-batch crossing ({args.compute_dtype}, {args.threads} thread(s), {args.clock} clock) vs one "
              "transformer layer forward+backward at the same shape; every repetition is a new crossing context.\n"
              "critical = encode+decode of the micro-batch's first forward crossing and of the backward, / layer f+b\n"
              "(with the crossing's precompute done, as the trainer's background prefetch leaves it); later = the same\n"
              "with a later forward crossing (rpq: the coded delta); iter = (first fwd + (P-1) later fwd + bwd) / ONE\n"
              "layer f+b, a micro-batch's codec time per iteration of P forward crossings; off-path = 2 x precompute (one per end: the mask's\n"
              "PRF indices, derived on a background thread when the batch is known; + the sender's background basis\n"
              "update of a lag=1 half; precomp ms = one end's precompute + that background time) / layer f+b; no prefetch =\n"
              "(critical + off-path) / layer f+b, the cost with masks derived on demand and the lagged basis inline.\n"
              "'-': nothing off the path.")
        print(_fmt_time_table(result["time"]))
    result["machine"]["loadavg_end"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
