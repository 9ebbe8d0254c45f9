"""projection: what the measured bytes predict for a deep pipeline over a slow link (a model, not a run).

    python -m benchmarks.projection [--stages 8] [--bandwidth-mbit 200] [--latency-ms 50]
                                    [--tflops 250] [--gpu-json bench_gpu.json] [--codec-json codec.json]

Default model: Qwen2.5-1.5B shape (d=1536, 28 layers, ffn 8960, 12 heads / 2 kv heads,
vocab 151936, tied embeddings), 8 stages, one GRPO step = forward-only pass (old
log-probs) + forward+backward pass (1F1B) + tied-embedding gradient all-reduce between the
first and last stage + the grad-norm all-reduce over the pipeline.

Per micro-batch of T tokens (b x s):
    F   = per-stage forward time  = FLOPs_fwd(T) / S / throughput   (stages balanced, head included)
    B   = 2 F (backward)
    t_w = 8 * T * width * wire_bytes / bandwidth     width = d (dense) or k = ceil(ratio d) (mask)
    C   = latency + t_w                               one boundary crossing
Pipeline (M micro-batches, S stages), two bounds:
    synchronous (blocking p2p, as megatron's 1F1B with wait_on_reqs; what the CPU runs do):
        fwd-only  (M + S - 1)(F + C)
        1F1B      (M + S - 1)(F + B + 2C)
    overlapped (asynchronous p2p, full-duplex links, comm hidden behind compute when it can be):
        fwd-only  (S - 1)(F + C) + M max(F, t_w)
        1F1B      (S - 1)(F + B + 2C) + M max(F + B, t_w)
Collectives: embedding all-reduce 2 latency + 8 V d grad_bytes / bandwidth (two ranks);
grad-norm all-reduce 2 (S - 1) latency. Codec cost: ``--codec-share`` x (one layer's
forward+backward) per micro-batch and stage (each stage is one end of two boundaries), added
to B for the mask (0 by default for the GPU scenario; taken from bench_codec's JSON for the
CPU scenario).

The whole step (issue 12 item 5; ``whole_step``): every transfer that crosses a host, in three
states of the code, with each transfer's bytes and link time:

    transfer        dense-everything          today                     after issue 12
    boundaries      d, bf16 (--wire-bytes)    k = ceil(ratio d)         k
    rollout batch   --batch-bytes-per-token x tokens x (S - 1), the same in all three
    tied embedding  V d x 4, each way          same                      x --embd-fraction
    sampler sync    fp32 copy of stages 1..   same                      bf16 copy x --sync-fraction
    anchor / step   fp32 (n + V d) / c        same                      --anchor-ship deltas of
                    + signs n / 8 / c                                   n / c (int4 by default:
                                                                        ``anchor/shipment.py``'s
                                                                        exact sizes; theta(0) not
                                                                        sent, amortised away)

n = every stage's parameters (the last stage's tied copy of W included, as shipped today).
Link time: the embedding all-reduce 2 latency + 8 B / bandwidth (full duplex); the sampler
sync and the anchor shipments all go into one host (the driver's, the anchor's): latency +
8 B / bandwidth; the batch leaves the driver's link the same way. The anchor's shipments are
non-blocking (``isend``) but billed in full, as if nothing overlapped them. ``--embd-fraction``
and ``--sync-fraction`` are the sparse embedding exchange's and the sampler's bf16 delta sync's
bytes as a fraction of their dense references (defaults: 0.05, the issue's goal, for the
embedding; 0.022 for the sampler, the sampler-sync branch's measured first-step size on
SmolLM2-135M at lr 2e-6). Not modelled: the optimizer step, the reference
pass (it repeats the forward-only pass when the KL term is on).
"""

from __future__ import annotations

import argparse
import json
import math
import os

from megatron_cegrpo.anchor.shipment import SHIP_MODES, shipment_nbytes
from megatron_cegrpo.bootstrap import bootstrap


def layer_params(d, ffn, heads, kv_heads):
    hd = d // heads
    return 2 * d * heads * hd + 2 * d * kv_heads * hd + 3 * d * ffn


def step_time(a, width: int, codec_s: float, overlapped: bool, datacenter: bool = False) -> dict:
    tokens = a.seq_len * a.micro_batch
    flops_tok = a.layers * (2 * layer_params(a.d, a.ffn, a.heads, a.kv_heads) + 2 * a.seq_len * a.d) + 2 * a.vocab * a.d
    if a.layer_fwd_bwd_ms is not None:  # measured compute (one layer f+b at this shape); head scaled by FLOPs
        per_layer_fb = a.layer_fwd_bwd_ms / 1e3
        layer_flops = 2 * layer_params(a.d, a.ffn, a.heads, a.kv_heads) + 2 * a.seq_len * a.d
        total_fb = per_layer_fb * flops_tok / layer_flops
        F = total_fb / 3 / a.stages
    else:
        F = flops_tok * tokens / a.stages / (a.tflops * 1e12)
    B = 2 * F
    B += codec_s  # both ends' encode/decode, charged to the backward slot
    bw = a.bandwidth_mbit * 1e6
    lat = 0.0 if datacenter else a.latency_ms / 1e3
    t_w = 0.0 if datacenter else 8 * tokens * width * a.wire_bytes / bw
    C = lat + t_w
    M, S = a.micro_batches, a.stages
    if overlapped:
        fwd_only = (S - 1) * (F + C) + M * max(F, t_w)
        update = (S - 1) * (F + B + 2 * C) + M * max(F + B, t_w)
    else:
        fwd_only = (M + S - 1) * (F + C)
        update = (M + S - 1) * (F + B + 2 * C)
    embd = 0.0
    if a.tied and not datacenter:
        embd = 2 * lat + 8 * a.vocab * a.d * a.grad_bytes / bw
    norm = 2 * (S - 1) * lat
    return {"F_ms": F * 1e3, "C_ms": C * 1e3, "t_wire_ms": t_w * 1e3, "fwd_only_s": fwd_only, "update_s": update,
            "embd_sync_s": embd, "grad_norm_s": norm, "total_s": fwd_only + update + embd + norm,
            "total_without_embd_s": fwd_only + update + norm}


def model_params(a) -> dict:
    """Parameter counts: ``layers`` (all decoder layers), ``embd`` (V d, counted once) and
    ``shipped`` (every stage's parameters, the last stage's tied copy of W included)."""
    layers = a.layers * layer_params(a.d, a.ffn, a.heads, a.kv_heads)
    embd = a.vocab * a.d
    return {"layers": layers, "embd": embd, "shipped": layers + embd * (2 if a.tied else 1),
            "sync": layers * (a.stages - 1) // a.stages + (embd if a.tied else 0)}


def _ship_bytes(numel: int, stages: int, mode: str) -> int:
    """One shipment of ``numel`` parameters split evenly over ``stages`` stages in ``mode``
    (``anchor/shipment.shipment_nbytes``: each stage's delta padded to whole blocks)."""
    per, rest = divmod(numel, stages)
    return sum(shipment_nbytes(per + (1 if i < rest else 0), mode, keyframe=False) for i in range(stages))


def whole_step(a, k: int) -> dict:
    """Bytes per step of every transfer that crosses a host, and the step time at the link,
    for ``dense`` (dense-everything), ``today`` and ``after`` (issue 12); the table in the
    module docstring says what each state sends. Returns {state: {"bytes": {...}, "time": {...}}}."""
    n = model_params(a)
    tokens = a.seq_len * a.micro_batch
    bw, lat = a.bandwidth_mbit * 1e6, a.latency_ms / 1e3
    crossings = 3 * a.micro_batches * (a.stages - 1)  # fwd-only + 1F1B (fwd and bwd) per boundary
    batch = a.batch_bytes_per_token * tokens * a.micro_batches * (a.stages - 1)
    embd_dense = 2 * n["embd"] * a.grad_bytes if a.tied else 0
    sync_dense, ship_dense = 4 * n["sync"], 4 * n["shipped"]
    signs = (n["shipped"] + 7) // 8  # sign(M) back, 1 bit a shipped parameter
    states = {
        "dense": dict(width=a.d, embd=embd_dense, sync=sync_dense, ship=ship_dense),
        "today": dict(width=k, embd=embd_dense, sync=sync_dense, ship=ship_dense),
        # the sparse exchange leaves W out of the first stage's shipments (one copy of W shipped);
        # the deltas' bytes as anchor/shipment.py sends them, one shipment per stage
        "after": dict(width=k, embd=embd_dense * a.embd_fraction, sync=2 * n["sync"] * a.sync_fraction,
                      ship=_ship_bytes(n["layers"] + n["embd"], a.stages, a.anchor_ship)),
    }
    out = {}
    for name, st in states.items():
        b = {"boundaries": crossings * tokens * st["width"] * a.wire_bytes, "batch": batch, "embd_sync": st["embd"],
             "sampler_sync": st["sync"], "anchor": (st["ship"] + signs) / a.anchor_interval}
        b["total"] = sum(b.values())
        res = {}
        for overlapped in (False, True):
            r = step_time(a, st["width"], 0.0, overlapped)
            link = {"embd_sync_s": (2 * lat + 8 * st["embd"] / 2 / bw) if st["embd"] else 0.0,
                    "sampler_sync_s": lat + 8 * st["sync"] / bw, "batch_s": lat + 8 * batch / bw,
                    "anchor_s": 8 * b["anchor"] / bw}
            pipe = r["total_without_embd_s"]
            res["overlapped" if overlapped else "synchronous"] = dict(pipeline_s=pipe, **link,
                                                                      step_s=pipe + sum(link.values()))
        out[name] = {"bytes": b, "time": res}
    return out


def print_whole_step(a, k: int) -> dict:
    """Print and return :func:`whole_step` with the datacenter step and what bounds the compressed one."""
    ws = whole_step(a, k)
    print(f"\nwhole step at {a.bandwidth_mbit:g} Mbit/s + {a.latency_ms:g} ms (GPU, {a.tflops:.0f} TFLOP/s a stage; "
          f"embd fraction {a.embd_fraction:g}, sampler-sync fraction {a.sync_fraction:g}, anchor c={a.anchor_interval})")
    print(f"  {'bytes per step (MB)':<22}" + "".join(f"{s:>16}" for s in ws))
    for part in ws["dense"]["bytes"]:
        print(f"  {part:<22}" + "".join(f"{ws[s]['bytes'][part] / 1e6:>16.1f}" for s in ws))
    for sched in ("synchronous", "overlapped"):
        print(f"  {sched + ' step s':<22}" + "".join(f"{ws[s]['time'][sched]['step_s']:>16.2f}" for s in ws))
        dc = step_time(a, a.d, 0.0, sched == "overlapped", datacenter=True)["total_s"]
        after, dense = ws["after"]["time"][sched], ws["dense"]["time"][sched]
        r = step_time(a, k, 0.0, sched == "overlapped")
        # fwd-only 1 and 1F1B 2 latencies per sequential slot: (M + S - 1) slots synchronous, S - 1 overlapped
        slots = a.micro_batches + a.stages - 1 if sched == "synchronous" else a.stages - 1
        lat_part = 3 * slots * a.latency_ms / 1e3
        bf16_dense = dense["step_s"] - 8 * ws["dense"]["bytes"]["sampler_sync"] / 2 / (a.bandwidth_mbit * 1e6)
        print(f"    {sched}: dense-everything / after = {dense['step_s'] / after['step_s']:.1f}x (with a bf16 "
              f"sampler copy in dense-everything {bf16_dense / after['step_s']:.1f}x), today / after = "
              f"{ws['today']['time'][sched]['step_s'] / after['step_s']:.1f}x; datacenter step {dc:.2f} s, after "
              f"is {after['step_s'] / dc:.1f}x it: pipeline {after['pipeline_s']:.2f} s (of it latency x sequential "
              f"crossings {lat_part:.2f} s, compute {dc:.2f} s, boundary bytes and the grad-norm all-reduce "
              f"{r['total_without_embd_s'] - dc - lat_part:.2f} s), "
              f"links outside the pipeline {after['step_s'] - after['pipeline_s']:.2f} s")
    return ws


#: bench_gpu's measurement on an H200 (issue 29 item 6) at the default shape (d 1536, 256 x 4 tokens)
GPU_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "issue29_gpu_h200", "bench_gpu_1k.json")


def _measured_mask_row(a, path: str, key: str, tool: str) -> dict:
    """(The timed ``mask`` row for ``a.d`` of a ``tool --out`` file (rows under ``key``), the whole
    file); a note when it was timed at another micro-batch shape. Raises SystemExit when there is none."""
    with open(path) as f:
        doc = json.load(f)
    rows = [r for r in doc[key] if r.get("d") == a.d and r.get("codec") == "mask" and "note" not in r and "error" not in r]
    if not rows:
        raise SystemExit(f"{path} has no timed mask row for d={a.d} (run {tool} with that d)")
    r = rows[0]
    if r["tokens"] != a.seq_len * a.micro_batch:
        print(f"note: {path} was timed at {r['tokens']} tokens per micro-batch, "
              f"the projection uses {a.seq_len * a.micro_batch}")
    return r, doc


def main(argv=None):
    bootstrap()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--ffn", type=int, default=8960)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--untied", dest="tied", action="store_false", help="no tied-embedding all-reduce")
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=32, help="M per pass")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--bandwidth-mbit", type=float, default=200.0)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--wire-bytes", type=int, default=2, help="bytes per boundary element (bf16: 2)")
    ap.add_argument("--grad-bytes", type=int, default=4, help="bytes per embedding-gradient element (fp32 main grads)")
    ap.add_argument("--keep-ratio", type=float, default=0.05)
    ap.add_argument("--tflops", type=float, default=250.0,
                    help="effective per-stage throughput, TFLOP/s (assumed; 250 ~ an H100 at ~25%% MFU)")
    ap.add_argument("--layer-fwd-bwd-ms", type=float, default=None,
                    help="measured ms of one layer forward+backward at [seq-len, micro-batch, d] (replaces --tflops)")
    ap.add_argument("--codec-share", type=float, default=0.0,
                    help="mask codec time per micro-batch crossing as a fraction of one layer fwd+bwd")
    ap.add_argument("--gpu-json", default=GPU_JSON,
                    help="bench_gpu --out file: adds a GPU scenario with its measured layer time and mask codec share "
                         "(default: the H200 run in benchmarks/results; '' leaves it out)")
    ap.add_argument("--codec-json", default=None,
                    help="bench_codec --out file: adds a CPU scenario with its measured layer time and codec share")
    ap.add_argument("--embd-fraction", type=float, default=0.05,
                    help="after issue 12: tied-embedding bytes / the dense all-reduce's (the issue's goal)")
    ap.add_argument("--sync-fraction", type=float, default=0.022,
                    help="after issue 12: sampler-sync bytes / a dense bf16 copy (the sampler-sync branch's "
                         "measured 2.2 %% on SmolLM2-135M at lr 2e-6; the issue's goal is <= 5 %%)")
    ap.add_argument("--anchor-interval", type=int, nargs="+", default=[20, 4],
                    help="c: anchor shipments every c steps; the whole step is printed for each (the seeds' 20, "
                         "the demo's 4)")
    ap.add_argument("--anchor-ship", default="int4-delta", choices=SHIP_MODES[1:],
                    help="after: the anchor shipments' coding (--anchor-ship; default the trainer's)")
    ap.add_argument("--batch-bytes-per-token", type=int, default=40,
                    help="rollout batch bytes a token (ids, positions, labels: int64; mask, advantage, "
                         "sampler log-prob: 4 bytes)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    k = math.ceil(round(a.keep_ratio * a.d, 9))

    scenarios = [("GPU (assumed %.0f TFLOP/s per stage)" % a.tflops, dict(layer_fwd_bwd_ms=None), a.codec_share)]
    if a.gpu_json:
        r, doc = _measured_mask_row(a, a.gpu_json, "rows", "bench_gpu")
        scenarios.append((f"{doc.get('device', 'GPU')} (measured: layer f+b "
                          f"{r['layer_fwd_bwd_ms']:.2f} ms, mask codec {100 * r['share_of_layer_fwd_bwd']:.0f}% of it "
                          f"on the critical path)", dict(layer_fwd_bwd_ms=r["layer_fwd_bwd_ms"]),
                          r["share_of_layer_fwd_bwd"]))
    if a.codec_json:
        r, _ = _measured_mask_row(a, a.codec_json, "time", "bench_codec")
        scenarios.append((f"this CPU (measured: layer f+b {r['layer_fwd_bwd_ms']:.0f} ms, mask codec "
                          f"{100 * r['share_of_layer_fwd_bwd']:.2f}% of it on the critical path)",
                          dict(layer_fwd_bwd_ms=r["layer_fwd_bwd_ms"]), r["share_of_layer_fwd_bwd"]))

    out = {"config": vars(a), "k": k, "scenarios": []}
    print(f"projection: d={a.d}, {a.layers} layers, vocab {a.vocab}{' (tied)' if a.tied else ''}, "
          f"{a.stages} stages, M={a.micro_batches} micro-batches of {a.micro_batch}x{a.seq_len} tokens per pass, "
          f"{a.bandwidth_mbit:g} Mbit/s, {a.latency_ms:g} ms, wire {a.wire_bytes} B/elem, mask k={k}")
    for name, over, share in scenarios:
        for key, v in over.items():
            setattr(a, key, v)
        layer_fb_s = None
        if a.layer_fwd_bwd_ms is not None:
            layer_fb_s = a.layer_fwd_bwd_ms / 1e3
        else:
            lf = 2 * layer_params(a.d, a.ffn, a.heads, a.kv_heads) + 2 * a.seq_len * a.d
            layer_fb_s = 3 * lf * a.seq_len * a.micro_batch / (a.tflops * 1e12)
        codec_s = share * layer_fb_s  # a stage holds one end of two boundaries: ~ one full crossing's codec work
        print(f"\n{name}")
        print(f"  {'schedule':<13}{'codec':<7}{'F ms':>8}{'C ms':>8}{'fwd-only s':>11}{'1F1B s':>9}{'embd s':>8}"
              f"{'norm s':>8}{'step s':>9}{'w/o embd':>9}")
        res = {}
        for overlapped in (False, True):
            sched = "overlapped" if overlapped else "synchronous"
            for codec, width, cs in (("dense", a.d, 0.0), ("mask", k, codec_s)):
                r = step_time(a, width, cs, overlapped)
                res[(sched, codec)] = r
                print(f"  {sched:<13}{codec:<7}{r['F_ms']:>8.1f}{r['C_ms']:>8.1f}{r['fwd_only_s']:>11.2f}"
                      f"{r['update_s']:>9.2f}{r['embd_sync_s']:>8.2f}{r['grad_norm_s']:>8.2f}{r['total_s']:>9.2f}"
                      f"{r['total_without_embd_s']:>9.2f}")
            dc = step_time(a, a.d, 0.0, overlapped, datacenter=True)
            res[(sched, "datacenter")] = dc
            m, d = res[(sched, "mask")], res[(sched, "dense")]
            print(f"  {sched:<13}mask/dense step {m['total_s'] / d['total_s']:.3f} "
                  f"(w/o embedding all-reduce {m['total_without_embd_s'] / d['total_without_embd_s']:.3f}); "
                  f"datacenter (no link cost) {dc['total_s']:.2f} s -> mask/datacenter "
                  f"{m['total_without_embd_s'] / dc['total_s']:.1f}x w/o embd")
        out["scenarios"].append({"name": name, "codec_share": share,
                                 "results": {f"{s}/{c}": v for (s, c), v in res.items()}})
    for key, v in scenarios[0][1].items():
        setattr(a, key, v)
    intervals = list(a.anchor_interval)
    for c in intervals:  # the first (the seeds' c) is the result; the others follow under whole_step_by_c
        a.anchor_interval = c
        out.setdefault("whole_step_by_c", {})[c] = print_whole_step(a, k)
    out["whole_step"] = out["whole_step_by_c"][intervals[0]]
    a.anchor_interval = intervals
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {a.out}")
    return out


if __name__ == "__main__":
    main()
