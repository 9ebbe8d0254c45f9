#!/usr/bin/env python
"""Starting greedy pass@1 of a model on tuning rows, to choose the study's data and template (issue 11).

    python tools/study_baseline.py --combos mawps/singleop:answer_is,mawps/addsub:plain --rows 40 \\
        --out /work/study-runs/baseline/b.json

For each ``set:template`` pair: ``split_holdout(records, H, seed)`` (the same split ``train.py
--num-holdout H --holdout-seed seed`` makes), then ``--rows`` rows drawn with ``random.Random(7)``
from the TRAINING part only, never from the held-out rows, evaluated greedily
(``megatron_cegrpo.evaluation.evaluate_detailed``) with the dense HF sampler. Prints one line per
pair (accuracy +- standard error, share of responses cut at ``--max-new-tokens``, mean response
length in tokens) and writes the rows, with every sample's text, to ``--out`` (JSON list).

Templates: every registered one (``plain``, ``answer_is``, ``boxed``, ...) plus the candidates
tried for the study and not kept, registered here only: ``brief``, ``equation`` and ``oneshot``.
docs/study.md lists what they scored.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from megatron_cegrpo.bootstrap import bootstrap

#: candidate user-message templates tried for the study (docs/study.md), not part of the package
CANDIDATES = {
    "brief": lambda q: q + "\nAnswer briefly: write the calculation, then 'The answer is N.'",
    "equation": lambda q: q + "\nWrite a single equation that solves the problem, then give the answer.",
    "oneshot": lambda q: ("Solve the word problem with one calculation, then state the answer.\n\n"
                          "Question: Tom has 5 apples and buys 7 more. How many apples does he have now?\n"
                          "Answer: 5 + 7 = 12. The answer is 12.\n\nQuestion: " + q + "\nAnswer:"),
}


def main(argv=None) -> int:
    bootstrap()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--combos", required=True, help="comma-separated set:template pairs")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=40, help="tuning rows per pair (from the training part)")
    p.add_argument("--num-holdout", type=int, default=300, help="rows held out, as train.py --num-holdout")
    p.add_argument("--holdout-seed", type=int, default=1234, help="as train.py --holdout-seed")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args(argv)

    from megatron_cegrpo.data import load_dataset, split_holdout
    from megatron_cegrpo.data.templates import available_templates, register_template
    from megatron_cegrpo.evaluation import evaluate_detailed
    from megatron_cegrpo.models import load_hf_state_dict, load_tokenizer, resolve_model
    from megatron_cegrpo.rollout.hf_engine import HFRolloutEngine

    for name, fn in CANDIDATES.items():
        if name not in available_templates():
            register_template(name)(fn)
    combos = []
    for c in a.combos.split(","):
        if c.count(":") != 1:
            print(f"error: --combos entry {c!r} is not set:template; fix: e.g. mawps/singleop:plain", file=sys.stderr)
            return 2
        combos.append(tuple(c.split(":")))
    src = resolve_model(a.model)
    cfg, sd = load_hf_state_dict(src)
    tok = load_tokenizer(src)
    engine = HFRolloutEngine(cfg, sd, tok)
    results = []
    for name, template in combos:
        records = load_dataset(name)
        train, _held = split_holdout(records, min(a.num_holdout, len(records) - a.rows), a.holdout_seed)
        rows = random.Random(7).sample(train, min(a.rows, len(train)))
        c0 = time.process_time()
        rep = evaluate_detailed(engine, tok, {name: rows}, modes="greedy", max_new_tokens=a.max_new_tokens,
                                batch_size=a.batch_size, template=template, progress=False)
        r = rep.datasets[name]
        trunc = sum(x[0] for x in r.truncated) / r.num_rows
        row = dict(set=name, template=template, rows=r.num_rows, acc=r.acc, se=r.acc_stderr, trunc=trunc,
                   mean_len=sum(x[0] for x in r.response_lengths) / r.num_rows, seconds=r.seconds,
                   cpu_s=time.process_time() - c0, max_new_tokens=a.max_new_tokens,
                   samples=[dict(row=rec.row, gt=rec.ground_truth, score=s[0], trunc=tr[0], text=tx[0])
                            for rec, s, tr, tx in zip(r.records, r.scores, r.truncated, r.texts)])
        results.append(row)
        print(f"{name:18s} {template:10s} acc {r.acc:.3f} ± {r.acc_stderr:.3f}  cut {trunc:.2f}  "
              f"len {row['mean_len']:.0f} tokens  {r.seconds:.0f} s", flush=True)
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
