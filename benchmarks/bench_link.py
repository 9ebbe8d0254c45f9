"""bench_link: the real GRPO training step through the pipeline, dense vs mask, over a modelled link.

    python -m benchmarks.bench_link [--model tiny-llama] [--pp 2] [--settings off,sim,tbf]
                                    [--bandwidth-mbit 200] [--latency-ms 50] [--out link.json]
    python -m benchmarks.bench_link --cleanup        # remove namespaces left by a killed run

One invocation starts the pipeline ranks once and runs, round by round, every
(setting, codec) pair on the same processes, so dense and mask are measured side by side
under the same machine load. Settings (see benchmarks/link_model.py):

``off``  no link model: loopback, or the veth pair with no qdisc when ``tbf`` is also run.
``sim``  every boundary modelled on the receiving side from the metered payload bytes:
         arrival = start + queueing on the link + 8 B / bandwidth + latency, where start is
         when both ends are ready (``--transfer rendezvous``, default, as gloo/NCCL p2p
         behave) or the send time (``--transfer eager``, an optimistic asynchronous NIC).
``tbf``  real kernel throttling: every rank runs in its own network namespace, joined by
         veth pairs (a bridge for PP > 2), with ``tc qdisc tbf rate <bandwidth>`` on each
         rank's egress; this kernel has no netem, so the latency is added by the same
         receive-side model (``latency`` mode).

Besides the pipeline boundaries the step moves the rollout batch, the tied embedding's
exchange, the scalar grad-norm all-reduce, the weights to the sampler and the anchor's
shipments (benchmarks/whole_step.py: three variants, ``dense`` = dense-everything, ``mask``
= today, ``after`` = issue 12; what is real and what is modelled is said there); ``sim``
bills them too, ``tbf`` throttles the real ones. The per-phase table shows where the time
goes, the whole-step table the bytes of every transfer.

Needs root and iproute2 for ``tbf`` (skipped with a note otherwise). Namespaces are
removed on exit, on Ctrl-C and on SIGTERM; ``--cleanup`` removes leftovers of a run that
was killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

from benchmarks.netns import Topology, cleanup_stale, kill_process_groups, netns_available
from benchmarks.shared_clock import create_timestamp_file
from megatron_cegrpo.bootstrap import bootstrap

#: the repository root: the ranks run ``python -m benchmarks._link_worker`` from here
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# model -> (sequences, tokens per sequence, micro-batch, timed rounds): a default run stays < 10 min here
DEFAULT_SHAPES = {"tiny-llama": (16, 256, 4, 3), "tiny-qwen2": (16, 256, 4, 3),
                  "smollm2-135m-instruct": (8, 128, 2, 2)}
ALL_SETTINGS = ("off", "sim", "tbf")


def cleanup_stale_files(force: bool = False) -> List[str]:
    """Remove /dev/shm/cegrpo-bench-ts-<pid>-* timestamp files whose run is gone."""
    removed = []
    if not os.path.isdir("/dev/shm"):
        return removed
    for name in os.listdir("/dev/shm"):
        m = re.match(r"cegrpo-bench-ts-(\d+)-", name)
        if not m:
            continue
        pid = int(m.group(1))
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            pass
        if force or not alive or pid == os.getpid():
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append("/dev/shm/" + name)
            except OSError:
                pass
    return removed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Terminated(BaseException):
    pass


def _on_signal(signum, frame):
    raise _Terminated(signum)


def run_ranks(args, settings: List[str], topo: Optional[Topology], ts_file: str, result_file: str,
              log_dir: str) -> None:
    port = _free_port() if topo is None else 29511
    procs: List[subprocess.Popen] = []
    worker = [sys.executable, "-m", "benchmarks._link_worker",
              "--model", args.model, "--pp", str(args.pp), "--codecs", args.codecs,
              "--keep-ratio", str(args.keep_ratio), "--settings", ",".join(settings),
              "--num-seqs", str(args.num_seqs), "--seq-len", str(args.seq_len),
              "--micro-batch", str(args.micro_batch), "--iters", str(args.iters), "--warmup", str(args.warmup),
              "--threads", str(args.threads), "--bandwidth-mbit", str(args.bandwidth_mbit),
              "--latency-ms", str(args.latency_ms), "--ts-file", ts_file, "--result", result_file,
              "--tc-rate", f"{args.bandwidth_mbit:g}mbit", "--tc-burst", args.tbf_burst,
              "--tc-latency", args.tbf_latency]
    worker += ["--transfer", args.transfer, "--sync-fraction", str(args.sync_fraction),
               "--anchor-interval", str(args.anchor_interval)]
    if args.blocking_send:
        worker.append("--blocking-send")
    if args.trace:
        worker.append("--trace")
    logs = []
    try:
        for r in range(args.pp):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.pp),
                       LOCAL_WORLD_SIZE=str(args.pp), MASTER_PORT=str(port), OMP_NUM_THREADS=str(args.threads),
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       PYTHONUNBUFFERED="1")
            cmd = list(worker)
            if topo is None:
                env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
            else:
                env.update(MASTER_ADDR=topo.addrs[0], GLOO_SOCKET_IFNAME=topo.ifname)
                cmd = topo.exec_prefix(r) + cmd + ["--tc-dev", topo.ifname]
            log = open(os.path.join(log_dir, f"rank{r}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE if r == 0 else log,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))

        def pump():  # echo rank 0's progress lines, keep everything in its log
            for line in procs[0].stdout:
                logs[0].write(line)
                logs[0].flush()
                if line.startswith("[rank0]"):
                    print("   " + line.rstrip(), flush=True)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after --timeout={args.timeout} s")
            time.sleep(0.5)
        th.join(timeout=5)
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad:
            for log in logs:
                log.flush()
            msg = []
            for r, rc in bad:
                with open(os.path.join(log_dir, f"rank{r}.log")) as f:
                    msg.append(f"--- rank {r} exited {rc}:\n" + f.read()[-4000:])
            raise RuntimeError("bench_link worker failed\n" + "\n".join(msg))
    finally:
        kill_process_groups(procs)
        for log in logs:
            log.close()


# --------------------------------------------------------------------------- summary


PHASES = ("batch_s", "old_logprob_s", "update_s", "embd_sync_s", "optimizer_s", "sampler_sync_s", "anchor_s")


def whole_step_bytes(per_rank: List[List[dict]]) -> Dict[str, float]:
    """Bytes of one step by transfer (the first timed record of each rank): boundaries (every
    rank's metered sends), and rank 0's batch, embedding, sampler-sync and anchor bytes; total."""
    r0 = per_rank[0][0]
    out = {"boundaries": sum(recs[0]["wire_bytes"] for recs in per_rank), "batch": r0["batch_bytes"],
           "embd_sync": r0["embd_sync_bytes"], "sampler_sync": r0["sampler_sync_bytes"], "anchor": r0["anchor_bytes"]}
    out["total"] = sum(out.values())
    return out


def summarize(raw: dict, settings: List[str], codecs: List[str]) -> dict:
    ranks = sorted(raw["ranks"], key=lambda r: r["pp_rank"])
    summary: Dict[str, Dict[str, dict]] = {}
    for s in settings:
        summary[s] = {}
        for c in codecs:
            per_rank = [[rec for rec in r["records"] if rec["setting"] == s and rec["codec"] == c and not rec["warmup"]]
                        for r in ranks]
            if not per_rank[0]:
                continue
            it = [rec["iter_s"] for rec in per_rank[0]]
            passes = [rec["old_logprob_s"] + rec["update_s"] for rec in per_rank[0]]
            phases = {}
            for ph in PHASES:
                phases[ph] = max(statistics.median(rec[ph] for rec in recs) for recs in per_rank)
            summary[s][c] = {
                "iter_s_median": statistics.median(it), "iter_s_min": min(it), "iter_s_all": it,
                "passes_s_median": statistics.median(passes), "passes_s_all": passes,
                "phases_s_max_over_ranks": phases,
                "boundary_wire_bytes_per_iter": sum(recs[0]["wire_bytes"] for recs in per_rank),
                "boundary_dense_equiv_bytes_per_iter": sum(recs[0]["dense_equiv_bytes"] for recs in per_rank),
                "link_wait_s_per_rank": [statistics.median(rec["link_wait_s"] for rec in recs) for recs in per_rank],
                "embd_sync_bytes": max(r["embd_bytes"] for r in ranks),
                "whole_step_bytes": whole_step_bytes(per_rank),
            }
    ratios = {}
    rank0 = ranks[0]["records"]
    for s in settings:
        if "dense" in summary[s] and "mask" in summary[s]:
            dense, mask = summary[s]["dense"], summary[s]["mask"]
            ratios[f"{s}: mask/dense s/iter"] = mask["iter_s_median"] / dense["iter_s_median"]
            by_round = {}
            for rec in rank0:
                if rec["setting"] == s and not rec["warmup"]:
                    by_round.setdefault(rec["round"], {})[rec["codec"]] = rec["iter_s"]
            paired = [r["mask"] / r["dense"] for r in by_round.values() if "mask" in r and "dense" in r]
            summary[s]["mask"]["paired_ratio_per_round"] = paired
            ratios[f"{s}: mask/dense s/iter, paired"] = statistics.median(paired)
            db = summary[s]["dense"]["boundary_wire_bytes_per_iter"]
            ratios[f"{s}: mask/dense pipeline passes s"] = (summary[s]["mask"]["passes_s_median"]
                                                            / summary[s]["dense"]["passes_s_median"])
            ratios[f"{s}: mask/dense boundary bytes"] = mask["boundary_wire_bytes_per_iter"] / db if db else None
    for s in settings:
        if "after" in summary[s]:
            for c in ("dense", "mask"):
                if c in summary[s]:
                    ratios[f"{s}: {c}/after s/iter (whole step)"] = (summary[s][c]["iter_s_median"]
                                                                   / summary[s]["after"]["iter_s_median"])
                    ratios[f"{s}: {c}/after bytes (whole step)"] = (summary[s][c]["whole_step_bytes"]["total"]
                                                                  / summary[s]["after"]["whole_step_bytes"]["total"])
    if "off" in summary and "dense" in summary["off"]:
        base = summary["off"]["dense"]["iter_s_median"]
        for s in settings:
            for c in codecs:
                if s != "off" and c in summary[s]:
                    ratios[f"{c}@{s} / dense@off s/iter"] = summary[s][c]["iter_s_median"] / base
        base_p = summary["off"]["dense"]["passes_s_median"]
        for s in settings:
            for c in codecs:
                if s != "off" and c in summary[s]:
                    ratios[f"{c}@{s} / dense@off pipeline passes s"] = summary[s][c]["passes_s_median"] / base_p
    return {"per_setting": summary, "ratios": ratios}


def print_report(raw: dict, summ: dict, args, settings: List[str], codecs: List[str], skipped: Dict[str, str]):
    print(f"\nbench_link: {raw['model']} (d={raw['d']}, {raw['num_layers']} layers, vocab {raw['vocab']}), "
          f"PP={raw['pp']}, {args.num_seqs} seqs x {args.seq_len} tokens, micro-batch {args.micro_batch}, "
          f"wire dtype {raw['pipeline_dtype'].replace('torch.', '')}, mask k={raw['k']} of {raw['d']}; "
          f"link {args.bandwidth_mbit:g} Mbit/s, {args.latency_ms:g} ms, {args.transfer}; "
          f"{args.threads} thread(s)/rank, "
          f"{args.iters} timed rounds (median)")
    per = summ["per_setting"]
    print("s/it = median seconds per GRPO iteration (old log-probs + update + embedding sync + optimizer);\n"
          "mask/dense = ratio of the medians; paired = median over rounds of the back-to-back ratio;\n"
          "bytes = boundary payload bytes per iteration, all boundaries, both directions (metered)")
    hdr = f"{'setting':<8}" + "".join(f"{c + ' s/it':>12}" for c in codecs)
    if "dense" in codecs and "mask" in codecs:
        hdr += f"{'mask/dense':>12}{'paired':>8}{'bytes/iter dense':>18}{'mask':>12}{'bytes ratio':>12}"
    print(hdr)
    for s in ALL_SETTINGS:
        if s in skipped:
            print(f"{s:<8}  skipped: {skipped[s]}")
            continue
        if s not in per:
            continue
        row = f"{s:<8}" + "".join(f"{per[s][c]['iter_s_median']:>12.2f}" if c in per[s] else f"{'-':>12}"
                                  for c in codecs)
        if "dense" in per[s] and "mask" in per[s]:
            d, m = per[s]["dense"], per[s]["mask"]
            row += (f"{m['iter_s_median'] / d['iter_s_median']:>12.3f}"
                    f"{statistics.median(m['paired_ratio_per_round']):>8.3f}"
                    f"{d['boundary_wire_bytes_per_iter'] / 1e6:>16.2f}MB"
                    f"{m['boundary_wire_bytes_per_iter'] / 1e6:>10.3f}MB"
                    f"{m['boundary_wire_bytes_per_iter'] / d['boundary_wire_bytes_per_iter']:>12.4f}")
        print(row)
    print("\nphases (s, median of each rank, max over ranks; a phase includes waiting for other ranks):\n"
          "  setting codec " + "".join(f"{ph[:-2]:>13}" for ph in PHASES) + "   passes (rank 0)")
    for s in settings:
        for c in codecs:
            if c in per[s]:
                ph = per[s][c]["phases_s_max_over_ranks"]
                print(f"  {s:<7} {c:<6}" + "".join(f"{ph[k]:>13.2f}" for k in PHASES)
                      + f"   {per[s][c]['passes_s_median']:>8.2f}")
    print_whole_step(per, settings, codecs)
    print("\nratios:")
    for k, v in summ["ratios"].items():
        print(f"  {k:<44} {v:.4f}" if v is not None else f"  {k:<44} n/a")


def print_whole_step(per: dict, settings: List[str], codecs: List[str]) -> None:
    """Bytes per step by transfer and variant (dense = dense-everything, mask = today, after =
    issue 12), and the whole-step seconds per setting."""
    s0 = settings[0]
    print("\nwhole step, bytes per iteration (MB; boundaries metered, batch/embd/sync real payloads, "
          "the sampler's bf16 delta and the anchor modelled: benchmarks/whole_step.py):")
    print(f"  {'transfer':<14}" + "".join(f"{c:>12}" for c in codecs if c in per[s0]))
    for part in next(iter(per[s0].values()))["whole_step_bytes"]:
        print(f"  {part:<14}" + "".join(f"{per[s0][c]['whole_step_bytes'][part] / 1e6:>12.3f}"
                                        for c in codecs if c in per[s0]))


def main(argv=None):
    bootstrap()  # the ranks it starts bootstrap themselves
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="tiny-llama | smollm2-135m-instruct | HF dir | .gguf")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (one process each)")
    ap.add_argument("--codecs", default="dense,mask,after",
                    help="step variants (benchmarks/whole_step.py): dense = dense-everything, mask = today, "
                         "after = issue 12 (sparse embedding rows, bf16 delta sampler sync and anchor shipments)")
    ap.add_argument("--sync-fraction", type=float, default=0.022,
                    help="after: sampler-sync bytes / a dense bf16 copy (modelled; the sampler-sync branch "
                         "measured 2.2 %% on SmolLM2-135M at lr 2e-6)")
    ap.add_argument("--anchor-interval", type=int, default=20, help="c: anchor shipments every c steps (modelled)")
    ap.add_argument("--keep-ratio", type=float, default=0.05)
    ap.add_argument("--settings", default="off,sim,tbf", help="comma list of off, sim, tbf")
    ap.add_argument("--bandwidth-mbit", type=float, default=200.0, help="link rate, Mbit/s (sim and tbf)")
    ap.add_argument("--latency-ms", type=float, default=50.0, help="one-way latency, ms (sim and tbf)")
    ap.add_argument("--transfer", choices=["rendezvous", "eager"], default="rendezvous",
                    help="when a payload starts moving: when both ends are ready (rendezvous, what gloo/NCCL "
                         "p2p do) or as soon as it is sent (eager: async NIC, optimistic); see link_model.py")
    ap.add_argument("--blocking-send", action="store_true",
                    help="sim: the sender also waits until its payload has left the link")
    ap.add_argument("--trace", action="store_true",
                    help="keep every received message's (boundary, dir, bytes, t_send, t_post, t_done, "
                         "arrival) in --out")
    ap.add_argument("--num-seqs", type=int, default=None, help="sequences per step (default per model)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default per model)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default per model)")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed rounds, each runs every setting x codec once (default per model: 3 tiny, 2 smollm2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (codecs alternating)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores // pp)")
    ap.add_argument("--subnet", default="10.213.0", help="/24 used on the veths inside the namespaces")
    ap.add_argument("--tbf-burst", default="32kbit")
    ap.add_argument("--tbf-latency", default="400ms", help="tbf queue limit (not a delay)")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds before the ranks are killed")
    ap.add_argument("--out", default=None, help="write config, raw records and summary as JSON here")
    ap.add_argument("--cleanup", action="store_true",
                    help="remove cegrpo-bench-* namespaces whose run is gone, then exit")
    ap.add_argument("--force", action="store_true", help="with --cleanup: also those of live runs")
    args = ap.parse_args(argv)

    if args.cleanup:
        why = netns_available()
        if why:
            print(f"nothing to clean up: {why}")
            return None
        removed = cleanup_stale(force=args.force)
        removed += cleanup_stale_files(force=args.force)
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return removed

    shape = DEFAULT_SHAPES.get(args.model.strip().lower(), (8, 128, 2, 2))
    args.iters = args.iters or shape[3]
    args.num_seqs = args.num_seqs or shape[0]
    args.seq_len = args.seq_len or shape[1]
    args.micro_batch = args.micro_batch or shape[2]
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.pp)
    if args.pp < 2:
        ap.error("--pp must be >= 2 (a boundary is needed)")
    settings = [s for s in args.settings.split(",") if s]
    bad = [s for s in settings if s not in ALL_SETTINGS]
    if bad:
        ap.error(f"unknown setting(s) {bad}; valid: {', '.join(ALL_SETTINGS)}")
    codecs = [c for c in args.codecs.split(",") if c]
    skipped: Dict[str, str] = {}
    if "tbf" in settings:
        why = netns_available()
        if why:
            skipped["tbf"] = why
            settings.remove("tbf")
    if not settings:
        ap.error("no setting left to run")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_signal)
    work = tempfile.mkdtemp(prefix="cegrpo-bench-")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else work
    ts_fd, ts_file = tempfile.mkstemp(prefix=f"cegrpo-bench-ts-{os.getpid()}-", dir=shm)
    os.close(ts_fd)
    result_file = os.path.join(work, "result.json")
    topo = Topology(args.pp, subnet=args.subnet) if "tbf" in settings else None
    t0 = time.monotonic()
    ok = False
    try:
        create_timestamp_file(ts_file, args.pp - 1)
        if topo is not None:
            topo.create()
            print(f"namespaces {', '.join(topo.namespaces())}; rank addresses {', '.join(topo.addrs)} "
                  f"on {topo.ifname}; tbf rate {args.bandwidth_mbit:g}mbit burst {args.tbf_burst} "
                  f"latency {args.tbf_latency} on each rank's egress while the tbf setting runs")
        print(f"running {args.model} PP={args.pp}: settings {settings} x codecs {codecs}, "
              f"{args.warmup} warm-up + {args.iters} timed rounds (logs in {work})", flush=True)
        run_ranks(args, settings, topo, ts_file, result_file, work)
        with open(result_file) as f:
            raw = json.load(f)
        ok = True
    except _Terminated as e:
        print(f"\ninterrupted by signal {e.args[0]}; cleaned up", file=sys.stderr)
        raise SystemExit(128 + int(e.args[0]))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if topo is not None:
            topo.destroy()
        try:
            os.unlink(ts_file)
        except OSError:
            pass
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"rank logs kept in {work}", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    summ = summarize(raw, settings, codecs)
    print_report(raw, summ, args, settings, codecs, skipped)
    print(f"\ntotal {time.monotonic() - t0:.0f} s; load average now {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "settings_run": settings, "skipped": skipped,
                       "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
                       "summary": summ, "raw": raw}, f, indent=1)
        print(f"wrote {args.out}")
    return summ


if __name__ == "__main__":
    main()
