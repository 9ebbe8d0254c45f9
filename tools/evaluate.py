#!/usr/bin/env python
"""Evaluate a model on the math benchmarks with a dense sampler; print a table, write JSON.

    python tools/evaluate.py --model smollm2-135m-instruct --datasets mawps,gsm8k/test \\
        --limit 50 --out results.json

``--model``: an HF model directory, a ``.gguf`` file, ``smollm2-135m-instruct`` or a
random-init test model (``tiny-llama``, ``tiny-qwen2``).

``--datasets``: comma-separated short names (``megatron_cegrpo.data.available_datasets()``),
each optionally with its mode: ``mawps``, ``amc23:avg@8``, ``aime24:avg@8:0.7``,
``gsm8k/test:greedy``.  ``default`` = the seeds' suite (greedy for gsm8k/test, mawps,
minerva_math, olympiadbench; avg@8 at T=0.7 for amc23, aime24).  A data set without a
mode takes ``--mode`` if given, else its suite mode, else greedy.

``--load CKPT_DIR``: a trained megatron_cegrpo checkpoint instead (a save directory,
whose ``latest`` is followed, or one ``iter_XXXXXXX`` directory; any PP size).  It is read
with the checkpoint tools' loader, ``megatron_cegrpo/conversion/loader_megatron.py``
(sha256-verified, stages merged to one HF state dict); the tokenizer is the checkpoint's ``tokenizer/`` directory, else that of its
``model_name``, else ``--model``'s.

``--engine``: ``hf`` (transformers' generate, the default) or ``vllm`` (vLLM in this process,
``--kv-cache-mb``; the engine ``--rollout-engine vllm`` trains with; ``docs/vllm.md``), at
``--dtype`` fp32 (default) or bf16.

Weights come from :func:`load_model`, which returns ``(hf_config, hf_state_dict,
tokenizer, meta)``: the one place that knows where weights come from.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from megatron_cegrpo.bootstrap import bootstrap
from megatron_cegrpo.conversion import loader_megatron
from megatron_cegrpo.conversion.plugin_common import load_tokenizer_from_source
from megatron_cegrpo.data import DEFAULT_TEMPLATE, available_templates
from megatron_cegrpo.errors import ConfigError, one_line
from megatron_cegrpo.evaluation import (
    evaluate_detailed,
    format_table,
    load_eval_datasets,
    parse_dataset_specs,
    write_summary,
)
from megatron_cegrpo.models import load_hf_state_dict, load_tokenizer, resolve_model
from megatron_cegrpo.rollout.hf_engine import HFRolloutEngine


def load_model(args):
    """(hf_config, fp32 HF state dict, tokenizer, meta) for ``--load`` or ``--model``."""
    if args.load:
        return _load_checkpoint(args)
    source = resolve_model(args.model)
    hf_config, hf_sd = load_hf_state_dict(source)
    tokenizer = load_tokenizer(source)
    meta = {"model": args.model, "model_kind": source.kind, "model_type": hf_config.model_type,
            "num_parameters": int(sum(v.numel() for v in hf_sd.values()))}
    return hf_config, hf_sd, tokenizer, meta


def _load_checkpoint(args):
    """A megatron_cegrpo checkpoint through the checkpoint tools' own loader."""
    payload = loader_megatron.load_checkpoint(argparse.Namespace(load_dir=args.load, no_verify=False))
    tok_source = payload.tokenizer_source or args.model
    if not tok_source:
        raise SystemExit(f"error: --load {args.load}: the checkpoint has no tokenizer/ and no resolvable "
                         "model_name; pass --model to name the tokenizer's model")
    tokenizer = load_tokenizer_from_source(tok_source)
    src = payload.source_meta or {}
    meta = {"model": payload.model_name or args.model, "load": os.path.abspath(args.load),
            "checkpoint_dir": payload.info.get("checkpoint_dir"), "iteration": payload.info.get("iteration"),
            "codec": src.get("codec"), "model_type": payload.hf_config.model_type,
            "num_parameters": int(sum(v.numel() for v in payload.state_dict.values()))}
    return payload.hf_config, payload.state_dict, tokenizer, meta


def build_engine(args, hf_config, hf_sd, tokenizer):
    """The sampler of ``--engine`` (``--dtype``) holding these weights. Raises ConfigError
    (vLLM not installed, its KV cache too small for ``--max-prompt-length + --max-new-tokens``)."""
    if args.engine == "hf":
        return HFRolloutEngine(hf_config, hf_sd, tokenizer, dtype=args.dtype)
    from megatron_cegrpo.rollout.vllm_config import check_kv_cache, check_vllm_installed, max_model_len

    check_vllm_installed("--engine")
    length = max_model_len(args.max_prompt_length, args.max_new_tokens, args.max_new_tokens,
                           int(getattr(hf_config, "max_position_embeddings", 0) or 0))
    check_kv_cache(hf_config, args.dtype, args.kv_cache_mb, length, flag="--kv-cache-mb",
                   lengths="--max-prompt-length / --max-new-tokens")
    from megatron_cegrpo.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(hf_config, hf_sd, tokenizer, dtype=args.dtype, max_model_len=length,
                             kv_cache_mb=args.kv_cache_mb, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF model dir | .gguf file | smollm2-135m-instruct | tiny-llama | tiny-qwen2")
    p.add_argument("--load", default=None, metavar="CKPT_DIR",
                   help="a megatron_cegrpo checkpoint (save dir or iter_XXXXXXX dir) instead of --model")
    p.add_argument("--datasets", default="default",
                   help="comma-separated NAME[:MODE] (MODE = greedy | avg@K | avg@K:T), or 'default'")
    p.add_argument("--mode", default=None, help="mode for data sets given without one (greedy | avg@K | avg@K:T)")
    p.add_argument("--limit", type=int, default=None, help="first N rows of each data set")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per generate call")
    p.add_argument("--template", default=DEFAULT_TEMPLATE, choices=available_templates())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--engine", default="hf", choices=("hf", "vllm"),
                   help="the sampler: hf (transformers' generate) or vllm (vLLM in this process; docs/vllm.md)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the sampler's weights and compute dtype")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="--engine vllm: its KV cache in MiB")
    p.add_argument("--max-prompt-length", type=int, default=1024,
                   help="--engine vllm: longest prompt in tokens (sizes the engine's sequences)")
    p.add_argument("--out", default=None, help="write the JSON summary here")
    p.add_argument("--label", default=None, help="name of this model in plots (default: --model / --load)")
    p.add_argument("--num-examples", type=int, default=3,
                   help="responses kept in the JSON per data set (-1 = all)")
    p.add_argument("--data-root", default=None, help="folder holding gsm8k/, mawps/, ... ($CEGRPO_DATA_ROOT)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    bootstrap(num_threads=args.threads)  # first thing after parsing the flags (it needs --threads)
    if not args.model and not args.load:
        parser.error("give --model or --load")
    if args.data_root:
        os.environ["CEGRPO_DATA_ROOT"] = os.path.abspath(args.data_root)
    if args.limit is not None and args.limit < 1:
        raise SystemExit("--limit must be >= 1")
    try:
        specs = parse_dataset_specs(args.datasets, args.mode)
    except ValueError as e:
        raise SystemExit(f"error: --datasets/--mode: {e}")

    t0 = time.perf_counter()
    datasets = load_eval_datasets(list(specs), limit=args.limit)
    hf_config, hf_sd, tokenizer, meta = load_model(args)
    try:
        engine = build_engine(args, hf_config, hf_sd, tokenizer)
    except ConfigError as e:
        raise SystemExit(f"error: {one_line(e)}")
    del hf_sd
    load_s = time.perf_counter() - t0
    what = f"{args.load} (iteration {meta.get('iteration')})" if args.load else args.model
    print(f"[evaluate] {what}: loaded in {load_s:.1f} s; "
          + ", ".join(f"{n} {len(r)} rows {specs[n].describe()}" for n, r in datasets.items()), flush=True)

    report = evaluate_detailed(engine, tokenizer, datasets, modes=specs, max_new_tokens=args.max_new_tokens,
                               batch_size=args.batch_size, template=args.template, progress=args.progress,
                               seed=args.seed)
    print(format_table(report), flush=True)
    if args.out:
        meta.update(label=args.label or args.model or os.path.basename(os.path.normpath(args.load)), limit=args.limit, load_seconds=load_s,
                    engine=args.engine, dtype=args.dtype,
                    torch_threads=torch.get_num_threads(), command=" ".join(sys.argv))
        path = write_summary(args.out, report, meta, num_examples=args.num_examples)
        print(f"[evaluate] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
