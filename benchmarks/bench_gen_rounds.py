"""bench_gen_rounds: what a generation round of more prompts costs (``--gen-batch-size``, issue 33 item 2).

    python -m benchmarks.bench_gen_rounds [--engine hf:fp32] [--rounds 4,8,12] [--repeats 2]
                                          [--max-new-tokens 64] [--threads 2] [--out rounds.json]

``--filter-groups`` draws rounds of prompts until B groups with mixed scores are drawn
(``docs/dynamic_sampling.md``). ``--gen-batch-size`` makes each round larger: fewer sampler calls
for the same prompts, which pays where a call's cost grows less than its size (a GPU's
memory-bound decode). This benchmark builds one sampler (SmolLM2-135M-Instruct, the main job's
sampling: ``answer_is`` template, 8 samples a prompt, T 0.7, up to 64 new tokens) and times one
round of each size in ``--rounds`` (prompts; the first is the baseline, B = 4 in the main job),
``--repeats`` times in turn after a warm-up call, and prints the fastest call of each size and
its ratio to the first size's (a ratio below size / first size means larger rounds save time per
sequence). Tokens generated are printed beside it (a round runs until its longest answer ends).
The machine's load before and after is printed for the record (``bench_rollout.machine_load``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from megatron_cegrpo.bootstrap import bootstrap

from benchmarks.bench_rollout import GROUP, HOLDOUT, HOLDOUT_SEED, MAX_NEW_TOKENS, TEMPERATURE, TEMPLATE, machine_load


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="hf:fp32", help="ENGINE:DTYPE of the sampler (hf | vllm, fp32 | bf16)")
    p.add_argument("--rounds", default="4,8,12", help="comma-separated prompts per round; the first is the baseline")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per size (after one warm-up call)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="the longest answer (the main job: 64)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (the trainer's sampler: all)")
    p.add_argument("--out", default=None, help="write the rows and the machine's load as JSON here")
    args = p.parse_args(argv)
    bootstrap(num_threads=args.threads)
    sizes = [int(s) for s in args.rounds.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        p.error(f"--rounds must list sizes >= 1, got {args.rounds!r}")
    if args.repeats < 1 or args.max_new_tokens < 1:
        p.error("--repeats and --max-new-tokens must be >= 1")

    import torch

    from benchmarks.bench_rollout import build_engine
    from megatron_cegrpo.data import encode_prompt, load_train_split
    from megatron_cegrpo.models import load_hf_state_dict, load_tokenizer, resolve_model

    load_before = machine_load()
    src = resolve_model("smollm2-135m-instruct")
    cfg, sd = load_hf_state_dict(src)
    tokenizer = load_tokenizer(src)
    split = load_train_split("mawps/singleop", num_holdout=HOLDOUT, seed=HOLDOUT_SEED)
    if max(sizes) > len(split.train):
        p.error(f"--rounds asks for {max(sizes)} prompts, the training split has {len(split.train)}")
    ids = [encode_prompt(tokenizer, r.question, TEMPLATE) for r in split.train[:max(sizes)]]
    kind, dtype = args.engine.split(":")
    engine = build_engine(kind, dtype, cfg, sd, tokenizer)
    print(f"[bench_gen_rounds] {args.engine}, {torch.get_num_threads()} threads, load before "
          f"{load_before['loadavg_1_5_15']}; rounds of {sizes} prompts x {GROUP} samples, <= {args.max_new_tokens} "
          f"tokens at T {TEMPERATURE}", flush=True)

    def call(n: int, seed: int):
        t0 = time.perf_counter()
        out = engine.generate([ids[i] for i in range(n) for _ in range(GROUP)], max_new_tokens=args.max_new_tokens,
                              temperature=TEMPERATURE, top_p=1.0, generator_seed=seed)
        return time.perf_counter() - t0, sum(int(r.numel()) for r in out.response_ids)

    call(sizes[0], 0)  # warm-up
    times = {n: [] for n in sizes}
    tokens = {n: [] for n in sizes}
    for rep in range(args.repeats):
        for n in sizes:
            dt, tok = call(n, 1 + rep)
            times[n].append(dt)
            tokens[n].append(tok)
            print(f"[bench_gen_rounds] repeat {rep}: {n} prompts ({n * GROUP} sequences) {dt:.1f} s, {tok} tokens",
                  flush=True)
    base = min(times[sizes[0]])
    rows = [{"prompts": n, "sequences": n * GROUP, "fastest_s": min(times[n]), "times_s": times[n],
             "tokens": tokens[n], "ratio": min(times[n]) / base, "size_ratio": n / sizes[0]} for n in sizes]
    print("| prompts a round | sequences | fastest call (s) | ratio to the first | size ratio | tokens per call |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompts']} | {r['sequences']} | {r['fastest_s']:.1f} | {r['ratio']:.2f} | "
              f"{r['size_ratio']:.2f} | {', '.join(map(str, r['tokens']))} |")
    load_after = machine_load()
    print(f"[bench_gen_rounds] load average (1, 5, 15 min) before {load_before['loadavg_1_5_15']}, after "
          f"{load_after['loadavg_1_5_15']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"engine": args.engine, "max_new_tokens": args.max_new_tokens, "rows": rows, "load_before": load_before, "load_after": load_after,
                       "threads": torch.get_num_threads()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
