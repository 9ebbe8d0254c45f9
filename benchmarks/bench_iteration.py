"""The main job's iteration, before and after issue 29, side by side in one command.

Runs ``examples/run_smollm2_mawps.sh`` (SmolLM2-135M-Instruct, MAWPS, PP=2, exact-k mask at 5 %,
anchor c = K = 4: ``make demo``'s configuration, held-out evaluations off) once per variant, one
after the other, and prints each variant's median ``timing_s/step`` over all its iterations (the
anchor's fire iterations included) and its phases, the ratio to the first variant, and the update
pass's model TFLOP/s and utilisation against the matmul peak it measures first on all cores, in
the variant's compute dtype (``perf/mfu/actor``):

  fp32-separate   fp32 weights and activations, the sampler fp32 too (--rollout-dtype fp32), the
                  old-logprob pass of its own (the path before)
  fp32            fp32 passes, old log-probs from the update pass, the sampler fp32
  bf16            --bf16 (bf16 passes over fp32 masters), a bf16 sampler computing in bf16
                  (--rollout-compute-dtype bf16), old log-probs from the update pass: the path
                  ``make demo`` takes where bf16 is native
  bf16-mb8        bf16 with micro-batches of 8 sequences (the control of the next)
  bf16-shared-prefix  bf16-mb8 with --shared-prefix (each prompt once per group; issue 32 item 1)

    python -m benchmarks.bench_iteration [--iters 10] [--variants fp32-separate bf16] [--work-dir DIR]

Needs the project's venv on PATH (``deepspeed``). Each variant takes about as long as ``make demo``
without its evaluations. Say what else was running on the machine when you quote the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from megatron_cegrpo.bootstrap import bootstrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "fp32-separate": {"PRECISION_FLAGS": "--rollout-dtype fp32"}, "fp32": {"PRECISION_FLAGS": "--rollout-dtype fp32"},
    "bf16": {"PRECISION_FLAGS": "--bf16 --rollout-compute-dtype bf16"},
    "bf16-mb8": {"PRECISION_FLAGS": "--bf16 --rollout-compute-dtype bf16"},
    "bf16-shared-prefix": {"PRECISION_FLAGS": "--bf16 --rollout-compute-dtype bf16"},
}
#: flags after the script's own (the later occurrence wins): --shared-prefix needs micro-batches of whole
#: groups (8 = G), and bf16-mb8 is the same micro-batch without sharing, its control
EXTRA = {"fp32-separate": ["--recompute-old-log-prob"], "bf16-mb8": ["--micro-batch-size", "8"],
         "bf16-shared-prefix": ["--micro-batch-size", "8", "--shared-prefix"]}
PHASES = ("gen", "old_log_prob", "update", "anchor", "sync", "probe", "broadcast")


def measure_peak_tflops(dtype: str = "bf16", seconds: float = 2.0) -> float:
    """This machine's matmul TFLOP/s in ``dtype`` on all its cores (a 512x576 @ 576x1536 product, the
    shape of a SmolLM2 MLP matmul, repeated for ``seconds``): the peak ``perf/mfu/actor`` is taken
    against (``--peak-tflops``)."""
    import time

    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a, b = torch.randn(512, 576, dtype=dt), torch.randn(576, 1536, dtype=dt)
    for _ in range(20):
        a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    secs = time.perf_counter() - t0
    torch.set_num_threads(prev)
    return 2 * 512 * 576 * 1536 * n / secs / 1e12


def summarize(records):
    """Median seconds per phase and per step over ``records`` (metrics.jsonl lines with a
    ``timing_s/step``); a phase a variant does not run is absent."""
    steps = [r for r in records if "timing_s/step" in r]
    out = {"step": statistics.median(r["timing_s/step"] for r in steps), "iterations": len(steps)}
    bnd = [r.get("comm/fwd_bytes", 0) + r.get("comm/bwd_bytes", 0) for r in steps]
    if any(bnd):  # the boundary's wire bytes an iteration (what --shared-prefix cuts)
        out["boundary_bytes"] = statistics.median(bnd)
    for k in ("perf/flops/actor", "perf/mfu/actor"):
        vals = [r[k] for r in steps if k in r]
        if vals:
            out[k] = statistics.median(vals)
    for ph in PHASES:
        vals = [r[f"timing_s/{ph}"] for r in steps if f"timing_s/{ph}" in r]
        if vals:
            out[ph] = statistics.median(vals)
    return out


def run_variant(name: str, iters: int, work: str, port: int, peak: float) -> dict:
    log = os.path.join(work, name)
    env = dict(os.environ, TRAIN_ITERS=str(iters), NUM_HOLDOUT="0", LOG_DIR=log, MASTER_PORT=str(port), CODEC="mask",
               **VARIANTS[name])
    cmd = ["bash", "examples/run_smollm2_mawps.sh", "--no-tqdm", "--peak-tflops", f"{peak:.4f}", *EXTRA.get(name, [])]
    print(f"[bench_iteration] {name}: {' '.join(cmd)} (log {log})", flush=True)
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("iter "):
            print(f"[bench_iteration] {name}: {line}", flush=True)
    if p.returncode:
        raise SystemExit(f"[bench_iteration] {name} failed (exit {p.returncode}):\n{p.stdout[-3000:]}")
    with open(os.path.join(log, "metrics.jsonl")) as f:
        return summarize([json.loads(x) for x in f if x.strip()])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=["fp32-separate", "bf16"], choices=list(VARIANTS))
    ap.add_argument("--work-dir", default=None, help="where the runs' logs go (default: a new temporary folder)")
    ap.add_argument("--port", type=int, default=29591)
    args = ap.parse_args(argv)
    bootstrap()
    work = args.work_dir or tempfile.mkdtemp(prefix="bench_iteration_")
    peaks = {d: measure_peak_tflops(d) for d in ("fp32", "bf16")}
    print(f"[bench_iteration] matmul peak on {os.cpu_count()} cores: fp32 {peaks['fp32']:.4f} TFLOP/s, "
          f"bf16 {peaks['bf16']:.4f}", flush=True)
    res = {v: run_variant(v, args.iters, work, args.port + i, peaks["bf16" if "--bf16" in VARIANTS[v]["PRECISION_FLAGS"]
                                                                      else "fp32"])
           for i, v in enumerate(args.variants)}
    base = res[args.variants[0]]["step"]
    print(f"\nmedian seconds per iteration over {args.iters} iterations (fire iterations included); "
          f"ratio = step / {args.variants[0]}'s step")
    cols = [p for p in PHASES if any(p in r for r in res.values())]
    print(f"{'variant':<19} {'step':>7} " + " ".join(f"{c:>12}" for c in cols) + f" {'ratio':>6} {'update TFLOP/s':>14}"
          f" {'MFU':>6} {'boundary MB':>11}")
    for v, r in res.items():
        print(f"{v:<19} {r['step']:>7.1f} " + " ".join(f"{r[c]:>12.1f}" if c in r else f"{'-':>12}" for c in cols)
              + f" {r['step'] / base:>6.2f} {r.get('perf/flops/actor', 0):>14.3f} {r.get('perf/mfu/actor', 0):>6.1%}"
              f" {r.get('boundary_bytes', 0) / 1e6:>11.3f}")
    with open(os.path.join(work, "bench_iteration.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"[bench_iteration] results: {os.path.join(work, 'bench_iteration.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
