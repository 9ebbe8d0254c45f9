#!/usr/bin/env python
"""Gradient fidelity of boundary codecs, measured in the real pipeline (issue 10 item 2).

    python tools/codec_fidelity.py --model smollm2-135m-instruct --pp 2 --batches 4 \\
        --codecs dense mask --out fidelity.json [-- more trainer flags]

One launch: the tool starts ``--pp`` gloo processes of itself (RANK / WORLD_SIZE / MASTER_*
as torchrun sets them); each builds the trainer's own rank (``GRPOTrainer``: megatron-core
stages, the compressed p2p communicator, the driver's dense sampler and verifier) from the
trainer flags (the 128-token rollout shape by default, :data:`TRAINER_FLAGS`; anything after ``--``
is appended and wins). For each of ``--batches`` iterations t = 1, 2, ... the driver
generates and scores one rollout batch, once, and then, for every codec spec in turn, on
that batch and the same (never updated) weights:

0. for a codec with ``pcaq/prepass=1``, the first stage's prepass (as the trainer runs it);
1. the old-logprob (and, with ``--kl-coef > 0``, reference) pass through the codec:
   ``mismatch`` = ``mismatch/abs_logprob_diff_mean``, the sampler vs trainer log-prob gap in
   nats/token exactly as the trainer logs it;
2. the update's forward+backward through the codec (``StageWorker.accumulate_gradients``,
   one per optimizer step of the first PPO epoch, no step taken) with the trainer's
   gradient-fidelity probe (``training/fidelity.py``): ``cos``, ``cos_stage<i>``,
   ``sign_agreement``, ``norm_ratio`` against the dense-boundary gradient;
3. ``bytes_ratio``: every byte the codec put on the wire in those passes, both directions
   (so a per-step basis is amortised over two passes here, over one in a ``--kl-coef 0``
   training run: compare a per-step codec's bytes with the trainer's start-up check),
   summed over the stages (whatever the codec bills to the communicator's ByteMeter: payloads,
   scales, basis or other side traffic), over the dense bytes of the same tensors — the
   trainer's ``comm/bytes_ratio``; ``bytes_per_response_token``: the same bytes over the
   batch's response tokens (the trainer's ``comm/boundary_bytes_per_response_token``: the
   comparison at equal wire cost per trained token, whatever the prompts' share of positions);
4. ``error_persistence``: ``codec/error_persistence`` between successive batches (from
   the second batch on; undefined for a codec without error, e.g. dense).

``--out`` is rewritten after every batch (an interrupted run keeps the batches it finished).

``--codecs``: specs accepted by ``compression.build_codec(spec, --keep-ratio)``; default: every
codec that goes alone (``available_codecs()``: dense, lowrank, mask), so new ones join automatically. A codec keeps
its state from batch to batch, as in training.

Output: ``--out`` holds a JSON list of rows, one per codec::

    {"codec": "mask", "bytes_ratio": 0.0503, "bytes_ratio_se": 0.0, "mismatch": 15.4,
     "mismatch_se": 0.3, "cos": 0.02, "cos_se": 0.01, "cos_stage0": ..., "cos_stage0_se": ...,
     "sign_agreement": ..., "sign_agreement_se": ..., "norm_ratio": ..., "norm_ratio_se": ...,
     "error_persistence": ..., "error_persistence_se": ..., "cos_stage<i>": ... (every stage),
     "n_batches": 4, "per_batch": {field: [value or null per batch]}, "seconds_per_batch": ...,
     "model": ..., "pp": 2, "keep_ratio": 0.05}

Each field is the mean over the batches where it is defined, ``_se`` its standard error
(sample standard deviation / sqrt(n); null for n < 2). The same table is printed, with
progress lines while it runs. ``--save-grads DIR`` also writes every rank's codec gradient
of every (codec, batch) as ``DIR/grad_<codec>_b<t>_rank<r>.pt`` (a dict parameter name ->
fp32 tensor, the last stage's tied embedding copy left out) for checks by hand.

Cost per batch: one generation, one dense old-logprob (+reference) pass, and per codec one
forward-only pass (+reference), one codec forward+backward and one dense forward+backward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from megatron_cegrpo.bootstrap import bootstrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The 128-token rollout shape (4 prompts x 8 responses, <= 128 new tokens, micro-batch 4, KL 0.001: `make demo`'s
#: until 2026-12-03, when the demo took the study's 64-token configuration), no anchor, no evaluation.
TRAINER_FLAGS = [
    "--train-data", "mawps/singleop", "--num-holdout", "48", "--micro-batch-size", "4",
    "--rollout-batch-size", "4", "--num-generations", "8", "--max-new-tokens", "128", "--temperature", "0.7",
    "--kl-coef", "0.001", "--seed", "1234", "--anchor-ranks", "0", "--no-tqdm",
    "--rollout-dtype", "fp32",  # an fp32 sampler: the mismatch column is the codec's alone
    "--deepspeed_config", os.path.join(REPO, "ds_configs", "cpu_adamw.json"),
]
#: row fields (name, metric key); cos_stage<i> for every stage is added per run
FIELDS = [("bytes_ratio", "comm/bytes_ratio"), ("bytes_per_response_token", "comm/boundary_bytes_per_response_token"),
          ("mismatch", "mismatch/abs_logprob_diff_mean"),
          ("cos", "fidelity/cos"), ("cos_stage0", "fidelity/cos/stage_0"),
          ("sign_agreement", "fidelity/sign_agreement"), ("norm_ratio", "fidelity/norm_ratio"),
          ("error_persistence", "codec/error_persistence")]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="as the trainer's --model")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (>= 2)")
    p.add_argument("--batches", type=int, default=4, help="rollout batches (iterations) to average over")
    p.add_argument("--codecs", nargs="+", default=None, help="codec specs (default: every codec that goes alone: dense, lowrank, mask)")
    p.add_argument("--keep-ratio", type=float, default=0.05, help="--boundary-keep-ratio for the codecs")
    p.add_argument("--out", default="codec_fidelity.json", help="JSON output (a list of rows)")
    p.add_argument("--save-grads", default=None, help="also save every rank's codec gradients here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank started by the tool
    p.add_argument("--log-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("trainer_flags", nargs=argparse.REMAINDER, help="after --: more trainer flags")
    args = p.parse_args(argv)
    if args.trainer_flags and args.trainer_flags[0] == "--":
        args.trainer_flags = args.trainer_flags[1:]
    if args.pp < 2:
        p.error(f"--pp {args.pp}: the codecs need a stage boundary; fix: --pp 2 or more")
    if args.batches < 1:
        p.error(f"--batches {args.batches}: fix: at least 1")
    return args


# ----------------------------------------------------------------------------- launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, argv) -> int:
    """Start ``--pp`` ranks of this script; rank 0 prints, the others log to files shown on failure."""
    port, logdir = _free_port(), tempfile.mkdtemp(prefix="codec_fidelity_")
    procs, logs = [], []
    try:
        for r in range(args.pp):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.pp),
                       LOCAL_WORLD_SIZE=str(args.pp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            out = None if r == 0 else open(os.path.join(logdir, f"rank{r}.log"), "w")
            logs.append(out)
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                           "--log-dir", os.path.join(logdir, "run"), *argv],
                                          env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
        while any(p.poll() is None for p in procs):  # one rank failing: the others would wait forever
            if any(p.poll() for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.5)
        codes = [p.wait() for p in procs]
        for r, code in enumerate(codes):
            if code > 0 and r > 0:
                logs[r].close()
                print(f"[fidelity] rank {r} exited {code}:\n" + open(logs[r].name).read()[-4000:], file=sys.stderr)
        return 0 if all(c == 0 for c in codes) else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            if f is not None:
                f.close()
        shutil.rmtree(logdir, ignore_errors=True)


# ----------------------------------------------------------------------------- one rank
def _reducer():
    from megatron_cegrpo.pipeline.boundary_error import declare_error_persistence
    from megatron_cegrpo.training.fidelity import GradFidelityProbe
    from megatron_cegrpo.training.reduce import StageMetricsReducer
    from megatron_cegrpo.training.stage import boundary_bytes_ratio

    r = StageMetricsReducer().declare("comm/", "sum").declare("mismatch/", "sum").derive(boundary_bytes_ratio)
    GradFidelityProbe.declare_metrics(r)
    declare_error_persistence(r)
    return r


def _measure_codec(trainer, probe, codec, tracker, batch, t: int, save: Optional[str], name: str) -> Dict:
    """One codec on one batch (module docstring, steps 1-4); this stage's metrics."""
    import torch

    from megatron_cegrpo.compression import ByteMeter
    from megatron_cegrpo.grpo.batch import slice_batch

    stage, meter = trainer.stage, ByteMeter()
    stage.error_tracker = tracker
    n, gbs = batch["tokens"].shape[0], trainer.cfg.global_batch_size
    with stage.comm.using(codec, meter):
        stage.boundary_prepass(batch, t)  # pcaq/prepass=1's forward (the other codecs: only the tied rows' refresh)
        stats = stage.old_log_prob(batch, t)
        if stage.ref_model is not None:
            stage.ref_log_prob(batch, t)
        stage.model.train()
        for start in range(0, n, gbs):
            stage.accumulate_gradients(slice_batch(batch, start, start + gbs), start, t, probe)
    if save:
        names = [nm for nm, p in stage.model.named_parameters() if p.requires_grad]
        grads = {nm: p.grad.detach().float().clone() for nm, p in zip(names, stage.params)
                 if p.grad is not None and stage.counted_here(p)}
        torch.save(grads, os.path.join(save, f"grad_{name.replace('/', '_')}_b{t}_rank{trainer.ctx.rank}.pt"))
    stage.optimizer.zero_grad(set_to_none=True)
    local = {k: v for k, v in meter.snapshot_and_reset().items() if k != "comm/bytes_ratio"}
    local.update(probe.stage_metrics())
    local.update(tracker.end_iteration())
    local.update({k: v for k, v in stats.items() if k.startswith("mismatch/")})
    return local


def _mean_se(vals: List[Optional[float]]):
    xs = [v for v in vals if v is not None and math.isfinite(v)]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def make_rows(per_codec: Dict[str, List[Dict]], pp: int, extra: Dict) -> List[Dict]:
    """Rows of the JSON (module docstring) from each codec's reduced metrics per batch."""
    fields = FIELDS + [(f"cos_stage{i}", f"fidelity/cos/stage_{i}") for i in range(1, pp)]
    rows = []
    for name, recs in per_codec.items():
        row = {"codec": name}
        per_batch = {}
        for field, key in fields:
            vals = [r.get(key) for r in recs]
            per_batch[field] = vals
            row[field], row[field + "_se"] = _mean_se(vals)
        row["n_batches"] = len(recs)
        row["seconds_per_batch"] = sum(r["seconds"] for r in recs) / len(recs)
        row["per_batch"] = per_batch
        row.update(extra)
        rows.append(row)
    return rows


def format_table(rows: List[Dict]) -> str:
    """The rows as a fixed-width table: mean ± standard error per field."""
    cols = [f for f, _ in FIELDS]
    head = f"{'codec':<16}" + "".join(f"{c:>22}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for c in cols:
            m, se = r[c], r[c + "_se"]
            cells.append(f"{'-' if m is None else f'{m:.4f}'}{'' if se is None else f' ± {se:.4f}':>10}")
        lines.append(f"{r['codec']:<16}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def _run(trainer, args, specs: List[str]) -> Optional[List[Dict]]:
    """Every batch, every codec; the rows on the driver (None elsewhere)."""
    import torch.distributed as dist

    from megatron_cegrpo.compression import build_codec
    from megatron_cegrpo.pipeline.boundary_error import BoundaryErrorTracker
    from megatron_cegrpo.training.fidelity import GradFidelityProbe
    from megatron_cegrpo.training.ledger import boundary_bytes

    ctx, reducer, probe = trainer.ctx, _reducer(), GradFidelityProbe(trainer.stage)
    codecs = {s: build_codec(s, args.keep_ratio) for s in specs}
    trackers = {s: BoundaryErrorTracker() for s in specs}
    per = {s: [] for s in specs}
    say = (lambda msg: print(f"[fidelity] {msg}", flush=True)) if ctx.is_driver else (lambda msg: None)
    say(f"codecs: {', '.join(specs)} at keep ratio {args.keep_ratio} (the trainer's own --boundary-codec is unused)")
    for t in range(1, args.batches + 1):
        t0 = time.perf_counter()
        _, batch = trainer.rollout(t)  # (the whole batch on the driver, this rank's rows): DP = 1 here
        probe.prepare(batch, t)
        say(f"batch {t}/{args.batches}: {batch['tokens'].shape[0]} responses generated and scored, dense "
            f"log-probs done in {time.perf_counter() - t0:.1f} s")
        for s in specs:
            t1 = time.perf_counter()
            local = _measure_codec(trainer, probe, codecs[s], trackers[s], batch, t, args.save_grads, s)
            gathered = [None] * ctx.pp_size if ctx.is_driver else None
            dist.gather_object(local, gathered, dst=dist.get_global_rank(ctx.pp_group, 0), group=ctx.pp_group)
            if ctx.is_driver:
                m = reducer.reduce(gathered)
                m["seconds"] = time.perf_counter() - t1
                # the wire cost per token the batch trains on (issue 32 item 4; the ledger's key)
                m["comm/boundary_bytes_per_response_token"] = (
                    boundary_bytes(m) / max(int(batch["response_lengths"].sum()), 1))
                per[s].append(m)
                say(f"batch {t}/{args.batches} {s}: bytes_ratio {m['comm/bytes_ratio']:.4f} mismatch "
                    f"{m.get('mismatch/abs_logprob_diff_mean', float('nan')):.3f} cos "
                    f"{m.get('fidelity/cos', float('nan')):.4f} cos_stage0 "
                    f"{m.get('fidelity/cos/stage_0', float('nan')):.4f} sign "
                    f"{m.get('fidelity/sign_agreement', float('nan')):.3f} ({m['seconds']:.1f} s)")
        if ctx.is_driver:  # after every batch, so that an interrupted run keeps what it measured
            rows = make_rows(per, ctx.pp_size, {"model": args.model, "pp": ctx.pp_size,
                                                "keep_ratio": args.keep_ratio})
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    return rows if ctx.is_driver else None


def worker(args) -> int:
    """One rank (after ``bootstrap(cpu_compat=True)``): the trainer's start-up (flags, checks,
    process groups, GRPOTrainer), then :func:`_run`."""
    from megatron_cegrpo.compression import available_codecs
    from megatron_cegrpo.initialize import initialize_distributed, shutdown_distributed
    from megatron_cegrpo.train import _configure
    from megatron_cegrpo.training import GRPOTrainer

    t0 = time.perf_counter()
    specs = args.codecs or available_codecs()
    cfg, plan = _configure(["--model", args.model, "--pipeline-model-parallel-size", str(args.pp), *TRAINER_FLAGS,
                            "--log-dir", args.log_dir, *args.trainer_flags])
    ctx = initialize_distributed(cfg.parallel.pipeline_model_parallel_size, cfg.optim.seed,
                                 cfg.parallel.num_threads, anchor_ranks=0,
                                 timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    try:
        if args.save_grads:
            os.makedirs(args.save_grads, exist_ok=True)
        rows = _run(GRPOTrainer(cfg, ctx, plan), args, specs)
        if rows is not None:
            print(format_table(rows), flush=True)
            print(f"[fidelity] {len(specs)} codecs x {args.batches} batches, PP={args.pp}, {args.model}: "
                  f"{time.perf_counter() - t0:.0f} s; wrote {args.out}", flush=True)
    finally:
        shutdown_distributed()
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    bootstrap(cpu_compat=args.worker)  # the launcher itself imports no torch
    if args.worker:
        return worker(args)
    return launch(args, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
