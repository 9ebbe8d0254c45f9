"""TRL's side of bench_peer: ``trl.GRPOTrainer`` on the peer benchmark's job (started by
benchmarks/bench_peer.py, one process per dtype).

    python -m benchmarks._peer_trl_worker --model-dir DIR --dtype fp32 --steps 6 --log-dir DIR [job flags]

The job is this project's: the prompts are ``--train-data``'s training rows rendered by the
project's ``build_prompt`` (the tokenizer's chat template around the ``--template`` user
message, the trainer's exact prompt text), and the reward is the project's
``score_responses`` with the data set's verifier (``numeric`` for MAWPS), the trainer's
reward path. The model is an HF directory written by the project's converter
(``tools/checkpoint/convert.py --loader gguf --saver hf``).

One optimizer step per batch of ``--rollout-batch`` prompts x ``--group`` completions:
``per_device_train_batch_size`` = ``--micro-batch`` and ``gradient_accumulation_steps`` =
prompts x group / micro-batch, so TRL's generation batch (per-device batch x
``steps_per_generation``, which defaults to the accumulation steps) is the whole batch, and
``num_iterations`` = 1 (TRL then skips its old-log-prob pass). ``beta`` = ``--kl-coef`` (0: no
reference model). Seconds per step: a callback's ``on_step_begin`` -> ``on_step_end``
(generation, reward, forward+backward of every micro-batch, clipping, the optimizer step);
generation alone: the wall time of ``GRPOTrainer._generate``. Every step is one JSON line in
``<log-dir>/metrics.jsonl`` with the trainer's key names (``step``, ``timing_s/step``,
``timing_s/gen``, ``response_length/mean``, ``critic/score/mean``), so that bench_peer reads
both sides the same way.

Importing this module needs neither torch nor trl (the tests import :func:`verifier_reward`
and :func:`grpo_config_kwargs`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Dict, List

from megatron_cegrpo.bootstrap import bootstrap


def verifier_reward(completions: List[str], ground_truth: List[str], verifier: List[str], **_) -> List[float]:
    """TRL reward function: the project's checked scoring (``score_responses`` with the data set's
    verifier), the same path the trainer's driver scores its responses with."""
    from megatron_cegrpo.rewards import get_verifier, score_responses

    records = [SimpleNamespace(question="", ground_truth=g, verifier=v) for g, v in zip(ground_truth, verifier)]
    return [float(s) for s in score_responses(get_verifier, None, records, list(completions)).tolist()]


def grpo_config_kwargs(*, dtype: str, steps: int, rollout_batch: int, group: int, micro_batch: int,
                       max_new_tokens: int, temperature: float, lr: float, kl_coef: float, seed: int,
                       output_dir: str) -> Dict:
    """``trl.GRPOConfig`` keyword arguments for the peer job (a dict, so tests need no trl)."""
    sequences = rollout_batch * group
    if sequences % micro_batch:
        raise ValueError(f"--micro-batch {micro_batch} must divide the batch's {sequences} sequences")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"--dtype {dtype}: fp32 or bf16")
    return dict(
        output_dir=output_dir, use_cpu=True, seed=seed, max_steps=steps,
        # GRPOConfig's default is bf16=True: fp32 must say so; bf16 is mixed precision (fp32
        # weights, autocast), as the trainer's --bf16
        bf16=dtype == "bf16", fp16=False,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=sequences // micro_batch,
        num_generations=group, num_iterations=1, max_completion_length=max_new_tokens,
        temperature=temperature, top_p=1.0, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        beta=kl_coef, use_vllm=False,
        # the trainer's optimizer (ds_configs/cpu_adamw.json): AdamW, no weight decay, clip 1.0
        weight_decay=0.0, max_grad_norm=1.0,
        # neither side recomputes activations (GRPOConfig's default is True)
        gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )


def _prompt_dataset(args, tokenizer):
    from datasets import Dataset

    from megatron_cegrpo.data import build_prompt, load_train_split

    split = load_train_split(args.train_data, num_holdout=args.num_holdout, seed=args.holdout_seed)
    rows = [{"prompt": build_prompt(tokenizer, r.question, args.template), "ground_truth": r.ground_truth,
             "verifier": r.verifier} for r in split.train]
    print(f"[trl] data {split.path}: {len(rows)} train prompts, template {args.template!r}", flush=True)
    return Dataset.from_list(rows)


def _timing_callback(gen: dict, path: str, steps: int):
    """A TrainerCallback writing one metrics line per optimizer step (see the module docstring)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0, self.pending, self.out = 0.0, None, open(path, "w")

        def on_step_begin(self, args, state, control, **kw):
            gen["s"] = 0.0
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.pending = {"step": state.global_step, "timing_s/step": time.perf_counter() - self.t0,
                            "timing_s/gen": gen["s"]}

        def on_log(self, args, state, control, logs=None, **kw):
            if self.pending is None or not logs or "loss" not in logs:  # not a training step's log
                return
            self.pending.update({"response_length/mean": logs.get("completions/mean_length"),
                                 "critic/score/mean": logs.get("reward"), "loss": logs.get("loss")})
            self._flush()

        def on_train_end(self, args, state, control, **kw):
            self._flush()
            self.out.close()

        def _flush(self):
            if self.pending is None:
                return
            r, self.pending = self.pending, None
            self.out.write(json.dumps(r) + "\n")
            self.out.flush()
            print(f"[trl] step {r['step']}/{steps}: {r['timing_s/step']:.1f} s (generation {r['timing_s/gen']:.1f} s)",
                  flush=True)

    return StepTimer()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="HF directory (the project's converter's output)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--train-data", default="mawps/singleop")
    p.add_argument("--template", default="answer_is")
    p.add_argument("--num-holdout", type=int, default=0)
    p.add_argument("--holdout-seed", type=int, default=1234)
    p.add_argument("--rollout-batch", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, help="torch.set_num_threads outside generation (default: torch's, "
                   "all cores); generation always uses every core, as the trainer's driver does")
    args = p.parse_args(argv)
    bootstrap(num_threads=args.threads)
    os.makedirs(args.log_dir, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory; nothing to fetch

    t_start = time.perf_counter()
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    kwargs = grpo_config_kwargs(dtype=args.dtype, steps=args.steps, rollout_batch=args.rollout_batch,
                                group=args.group, micro_batch=args.micro_batch, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, lr=args.lr, kl_coef=args.kl_coef, seed=args.seed,
                                output_dir=os.path.join(args.log_dir, "trl_output"))
    config = GRPOConfig(**kwargs)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=verifier_reward, args=config,
                          train_dataset=_prompt_dataset(args, tokenizer), processing_class=tokenizer)
    gen = {"s": 0.0}
    generate = trainer._generate

    def timed_generate(*a, **k):
        t, threads = time.perf_counter(), torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or threads)  # as the trainer's driver generates (all_cores)
        try:
            return generate(*a, **k)
        finally:
            torch.set_num_threads(threads)
            gen["s"] += time.perf_counter() - t

    trainer._generate = timed_generate
    trainer.add_callback(_timing_callback(gen, os.path.join(args.log_dir, "metrics.jsonl"), args.steps))
    info = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "generation_batch_size": config.generation_batch_size,
            "steps_per_generation": config.steps_per_generation,
            "gradient_accumulation_steps": config.gradient_accumulation_steps, "bf16": config.bf16,
            "model_dtype": str(trainer.model.dtype), "startup_s": time.perf_counter() - t_start}
    print(f"[trl] {json.dumps(info)}", flush=True)
    with open(os.path.join(args.log_dir, "trl_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
