"""What each rank's thread count costs the sampler, alone and beside a busy anchor (issue 29 item 3).

The main job puts three ranks on a host's cores (two stages, the anchor). The driver (stage 0)
generates while stage 1 waits; the anchor may be replaying a fire's batch at the same time.
This measures HF ``generate`` on the main job's batch (SmolLM2-135M-Instruct, 4 MAWPS prompts x 8
samples, 64 new tokens, T 0.7, the ``answer_is`` template) for each thread count and sampler
dtype, alone and beside a competitor process standing in for the anchor (one thread of bf16
matmuls at the anchor replay's shapes), at the competitor's nice 0 and at the nice the anchor
rank takes (``--anchor-nice``). Each cell is the median of ``--repeats`` runs after a warm-up;
the configurations are interleaved, so slow drift of the machine's load hits all alike.

    python -m benchmarks.bench_threads [--repeats 3] [--threads 1 2] [--dtypes fp32 bf16]

Prints a table of seconds and each cell's ratio to the 2-thread quiet cell of its dtype. Say what
else was running on the machine when you quote it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from megatron_cegrpo.bootstrap import bootstrap

COMPETITOR = r"""
import os, sys, torch
os.nice(int(sys.argv[1]))
torch.set_num_threads(1)
a = torch.randn(512, 576, dtype=torch.bfloat16); b = torch.randn(576, 1536, dtype=torch.bfloat16)
print("ready", flush=True)
while True:
    (a @ b).sum()
"""


def _prompts(tokenizer, n_prompts: int, data: str):
    from megatron_cegrpo.data import encode_prompt

    rows = [json.loads(x) for x in open(data) if x.strip()][:n_prompts]
    return [encode_prompt(tokenizer, r["input"], "answer_is") for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--nice", type=int, default=10, help="the competitor's nice in the 'niced' rows")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--data", default=None,
                    help="MAWPS jsonl (default: mawps/singleop.jsonl under $CEGRPO_DATA_ROOT or ../shared/data)")
    args = ap.parse_args(argv)
    bootstrap()
    if args.data is None:
        from megatron_cegrpo.data.datasets import dataset_path
        args.data = dataset_path("mawps/singleop")

    import torch

    from megatron_cegrpo.models import load_tokenizer
    from megatron_cegrpo.models.hf_config import resolve_model
    from megatron_cegrpo.models.loader import load_hf_state_dict
    from megatron_cegrpo.rollout.base import get_rollout_engine

    source = resolve_model("smollm2-135m-instruct")
    hf_config, sd = load_hf_state_dict(source)
    tok = load_tokenizer(source)
    prompts = [p for p in _prompts(tok, 4, args.data) for _ in range(8)]
    engines = {d: get_rollout_engine("hf", hf_config=hf_config, hf_state_dict=sd, tokenizer=tok, dtype=d)
               for d in args.dtypes}

    def gen(dtype: str, threads: int) -> float:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        engines[dtype].generate(prompts, max_new_tokens=args.max_new_tokens, temperature=0.7, generator_seed=1)
        return time.perf_counter() - t0

    cells = [(d, th) for d in args.dtypes for th in args.threads]
    results = {}
    for load in ("quiet", "beside anchor (nice 0)", f"beside anchor (nice {args.nice})"):
        comp = None
        if load != "quiet":
            nice = 0 if "nice 0" in load else args.nice
            comp = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(nice)], stdout=subprocess.PIPE, text=True)
            comp.stdout.readline()
        try:
            for d, th in cells:
                gen(d, th)  # warm-up
            times = {c: [] for c in cells}
            for r in range(args.repeats):
                for c in cells:
                    times[c].append(gen(*c))
                    print(f"[bench_threads] {load}: {c[0]} {c[1]} thread(s), run {r + 1}: {times[c][-1]:.2f} s",
                          flush=True)
            for c in cells:
                results[(load,) + c] = statistics.median(times[c])
        finally:
            if comp is not None:
                comp.kill()
                comp.wait()
    print(f"\nHF generate, 32 x {args.max_new_tokens} tokens, median of {args.repeats} (s; ratio to the quiet "
          f"{max(args.threads)}-thread cell of the dtype)")
    print(f"{'load':<28} {'dtype':<6} {'threads':>7} {'s':>8} {'ratio':>7}")
    for (load, d, th), s in results.items():
        base = results[("quiet", d, max(args.threads))]
        print(f"{load:<28} {d:<6} {th:>7} {s:>8.2f} {s / base:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
