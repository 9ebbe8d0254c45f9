#!/usr/bin/env python
"""Per-token reconstruction error of boundary codecs on SmolLM2's own boundary activations.

A seconds-long probe beside ``tools/codec_fidelity.py`` (which measures what matters, the gradient,
in the real pipeline, in minutes a batch): the forward half of each codec spec encodes and decodes
the hidden states after layer ``L = layers / 2`` (the PP = 2 boundary) of SmolLM2-135M-Instruct on
MAWPS prompts, micro-batch by micro-batch as the pipeline sends them, in fp32 and in bf16 (the
wire dtype sets the byte budget: 5 % of 2 bytes a value is half the bits of 5 % of 4). Printed per
spec and dtype: the mean over real tokens of ``||x_hat_i - x_i|| / ||x_i||`` (padding and position
0, the attention sink, left out: its norm is ~165x the median and every pcaq spec sends it whole)
and the mean payload bytes of the step's messages (one step: a per-step basis rides on the first,
so it is amortised over ``prompts / 4`` messages, and ``every=R`` has nothing to hold it over).
Prompts only, no responses: shorter micro-batches than the trainer's, so a basis weighs more here.
No gradient, no training: a codec that is close here may still train worse (a held basis keeps
its error's direction: ``docs/codecs.md``, "A held basis").

    python tools/codec_error.py --specs pcaq:lrq pcaq/basis_bits=8:lrq --prompts 8
"""

import argparse
import json
import os
import sys
from typing import Dict, Optional, Sequence

import torch

from megatron_cegrpo.bootstrap import bootstrap


def token_errors(x: torch.Tensor, specs: Sequence[str], keep_ratio: float = 0.05, micro_batch: int = 4,
                 skip_positions: int = 1, valid: Optional[torch.Tensor] = None) -> Dict[str, Dict[str, float]]:
    """Forward-half reconstruction error of each spec on ``x`` [s, b, d] (the pipeline's
    sequence-major layout, any float dtype: it is the wire dtype), coded ``micro_batch``
    sequences at a time as step 0, boundary 0 (padding is coded too, as the pipeline sends it).

    Returns ``{spec: {"err": mean over the tokens at positions >= skip_positions where ``valid``
    [s, b] (bool; default all) is True of ||x_hat - x|| / ||x|| (fp32 arithmetic; zero-norm tokens
    left out), "bytes": mean payload bytes of the messages}}``. Raises ValueError for a malformed
    spec (``build_codec``), a ``micro_batch`` < 1 or a ``valid`` of another shape.
    """
    from megatron_cegrpo.compression import BoundaryContext, build_codec

    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    s, b, d = x.shape
    valid = torch.ones(s, b, dtype=torch.bool) if valid is None else valid.bool()
    if tuple(valid.shape) != (s, b):
        raise ValueError(f"valid has shape {tuple(valid.shape)}, x's tokens are {(s, b)}")
    out = {}
    for spec in specs:
        codec = build_codec(spec, keep_ratio, warn=False)
        errs, sizes = [], []
        for lo in range(0, b, micro_batch):
            t = x[:, lo:lo + micro_batch].contiguous()
            ctx = BoundaryContext(seed=1, boundary=0, step=0, sample_ids=torch.arange(lo, lo + t.shape[1]))
            payload = codec.encode_forward(t, ctx)
            y = codec.decode_forward(payload, ctx, tuple(t.shape)).float()
            ref = t.float()[skip_positions:].reshape(-1, d)
            norm = ref.norm(dim=-1)
            keep = (norm > 0) & valid[skip_positions:, lo:lo + micro_batch].reshape(-1)
            errs.append(((y[skip_positions:].reshape(-1, d) - ref).norm(dim=-1)[keep] / norm[keep]))
            sizes.append(payload.numel() * payload.element_size())
        out[spec] = {"err": torch.cat(errs).mean().item(), "bytes": sum(sizes) / len(sizes)}
    return out


def boundary_states(questions: Sequence[str]):
    """(hidden states [s, b, d] fp32, real-token mask [s, b] bool, L): the states after layer
    L = layers / 2 of SmolLM2-135M-Instruct on ``questions`` (b of them), chat template, padded on
    the right."""
    from megatron_cegrpo.models.hf_config import load_tokenizer, resolve_model
    from megatron_cegrpo.models.loader import build_hf_model, load_hf_state_dict

    src = resolve_model("smollm2-135m-instruct")
    cfg, sd = load_hf_state_dict(src)
    model = build_hf_model(cfg, sd, attn_implementation="sdpa").eval()
    tok = load_tokenizer(src)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in questions]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="right")
    with torch.no_grad():
        layer = cfg.num_hidden_layers // 2
        h = model(**enc, output_hidden_states=True).hidden_states[layer]
    return h.transpose(0, 1).contiguous(), enc["attention_mask"].t().bool(), layer


def main(argv=None) -> int:
    bootstrap()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="+", default=["mask", "pcaq:lrq"], help="--boundary-codec specs")
    ap.add_argument("--prompts", type=int, default=8, help="MAWPS prompts (sequences), in micro-batches of 4")
    ap.add_argument("--keep-ratio", type=float, default=0.05)
    ap.add_argument("--data", default=None,
                    help="MAWPS jsonl (default: mawps/singleop.jsonl under $CEGRPO_DATA_ROOT or ../shared/data)")
    ap.add_argument("--out", help="also write the numbers as JSON here")
    a = ap.parse_args(argv)
    from megatron_cegrpo.data.datasets import DatasetError, dataset_file, load_prompts
    if a.data is None:
        a.data = dataset_file("mawps/singleop")
    if not os.path.isfile(a.data):
        print(f"error: --data {a.data}: no such file; fix: pass a MAWPS jsonl (../shared/data/mawps/singleop.jsonl)",
              file=sys.stderr)
        return 2
    try:
        questions = [r.question for r in load_prompts(a.data, limit=a.prompts)]
    except DatasetError as e:
        print(f"error: --data {e}", file=sys.stderr)
        return 2
    x, valid, layer = boundary_states(questions)
    print(f"boundary states {tuple(x.shape)} (s, b, d) after layer {layer}; per-token relative error "
          "(position 0 left out), bytes a message")
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        try:
            r = token_errors(x.to(dtype), a.specs, a.keep_ratio, valid=valid)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        result[str(dtype).replace("torch.", "")] = r
        for spec, v in r.items():
            print(f"  {str(dtype).replace('torch.', ''):9s} {spec:45s} err {v['err']:.4f}  {v['bytes']:.0f} B")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"shape": list(x.shape), "keep_ratio": a.keep_ratio, "results": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
