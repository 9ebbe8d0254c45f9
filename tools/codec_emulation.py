"""Gradient fidelity of boundary codec specs on SmolLM2-135M: a single-process emulation.

A fast prototype bench (issue 10; after /work/shared/tools/grad_fidelity_emulation.py), not
the pipeline: the REAL codec of each spec (``compression.build_codec``) is applied with its
``forward_map`` (forward half's encode/decode, backward half's encode/decode of the gradient)
at the output of decoder layer L = layers / 2 (the PP=2 boundary) of the HF model, micro-batch
by micro-batch (4 sequences each, the pipeline's micro-batch, so a per-step basis comes from the first
micro-batch as in the pipeline). Policy-gradient loss with random +-1 sequence advantages at
T = 0.7 on sampled MAWPS responses. Per spec it prints and writes (``--out``) the mean |log-prob
difference| to the dense model on response tokens (nats/token), cos(G, G_dense) over all
parameters and over layers < L (stage 0's decoder layers), sign agreement, and the documented
wire bytes of one demo iteration (3 forward passes, 1 backward) over dense.

    flock /tmp/smollm2.lock python tools/codec_emulation.py --specs mask,pcaq:lrq \\
        --batch /tmp/batch.pt --out /tmp/emu.json
"""

import argparse
import json
import math
import os
import time

import torch

from megatron_cegrpo.bootstrap import bootstrap


def make_batch(model, tok, questions, samples, max_new):
    """Sample ``samples`` responses at T = 0.7 to each question (chat template, no answer instruction)."""
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) for q in questions]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    pad = tok.pad_token_id or tok.eos_token_id
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=True, temperature=0.7,
                             num_return_sequences=samples, pad_token_id=pad)
    attn = (out != pad).long()
    p = enc["input_ids"].shape[1]
    attn[:, :p] = enc["attention_mask"].repeat_interleave(samples, 0)
    resp = torch.zeros_like(out, dtype=torch.float)
    resp[:, p:] = attn[:, p:].float()
    return dict(out=out, attn=attn, resp_mask=resp, adv=torch.randn(out.shape[0]).sign(), P=p)


def run(model, batch, codec, step, mbs, layer, first_ids):
    """Forward+backward micro-batch by micro-batch; returns (logprobs, grad all, grad stage 0)."""
    from megatron_cegrpo.compression import BoundaryContext

    state = {}

    def hook(mod, inp, output):
        h = output[0] if isinstance(output, tuple) else output
        if codec is None:
            return output
        ctx = BoundaryContext(seed=1234, boundary=0, step=step, sample_ids=state["ids"])
        h2 = codec.forward_map(h.transpose(0, 1).contiguous(), ctx).transpose(0, 1)
        return (h2,) + tuple(output[1:]) if isinstance(output, tuple) else h2

    handle = model.model.layers[layer - 1].register_forward_hook(hook)
    model.zero_grad(set_to_none=True)
    out, attn, m_all = batch["out"], batch["attn"], batch["resp_mask"][:, 1:]
    lps = []
    for i in range(0, out.shape[0], mbs):
        state["ids"] = torch.arange(i, min(i + mbs, out.shape[0]))  # a ragged last micro-batch too
        logits = model(input_ids=out[i:i + mbs], attention_mask=attn[i:i + mbs]).logits[:, :-1].float() / 0.7
        lp = torch.log_softmax(logits, -1).gather(-1, out[i:i + mbs, 1:, None])[..., 0]
        m = m_all[i:i + mbs]
        (-(batch["adv"][i:i + mbs, None] * lp * m).sum() / m_all.sum()).backward()
        lps.append(lp.detach())
    handle.remove()
    params = list(model.named_parameters())
    g = torch.cat([p.grad.reshape(-1) for _, p in params if p.grad is not None])
    g1 = torch.cat([p.grad.reshape(-1) for n, p in params if p.grad is not None and n in first_ids])
    return torch.cat(lps), g, g1


def iteration_bytes_ratio(codec, shape, mbs_per_pass):
    """Documented bytes of one demo iteration (3 forward passes, 1 backward) over dense."""
    from megatron_cegrpo.compression.spec import spec_bytes

    s, b, d = shape
    dense = 4 * mbs_per_pass * s * b * d * 4
    if codec is not None and not codec.claims_budget:  # dense
        return 1.0
    f, bw = spec_bytes(codec, shape, 4, 3 * mbs_per_pass, mbs_per_pass)
    return (f + bw) / dense


def main():
    bootstrap()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--specs", default="mask,pcaq:lrq")
    ap.add_argument("--keep-ratio", type=float, default=0.05)
    ap.add_argument("--batch", default=None, help="load (or save) the sampled batch here")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draws", type=int, default=1, help="steps per spec (PRF masks differ per step)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from megatron_cegrpo.compression import build_codec
    from megatron_cegrpo.models.hf_config import load_tokenizer, resolve_model
    from megatron_cegrpo.models.loader import build_hf_model, load_hf_state_dict

    torch.manual_seed(0)
    t0 = time.time()
    src = resolve_model("smollm2-135m-instruct")
    cfg, sd = load_hf_state_dict(src)
    model = build_hf_model(cfg, sd, attn_implementation="sdpa")
    if a.batch and os.path.exists(a.batch):
        batch = torch.load(a.batch)
    else:
        from megatron_cegrpo.data.datasets import load_dataset
        questions = [r.question for r in load_dataset("mawps/singleop", limit=a.prompts)]
        batch = make_batch(model, load_tokenizer(src), questions, a.samples, a.max_new_tokens)
        if a.batch:
            torch.save(batch, a.batch)
    layer, mbs = cfg.num_hidden_layers // 2, 4
    first = {n for n, _ in model.named_parameters() if n.startswith("model.layers.") and int(n.split(".")[2]) < layer}
    lp0, g0, g10 = run(model, batch, None, 0, mbs, layer, first)
    m = batch["resp_mask"][:, 1:]
    shape = (batch["out"].shape[1], mbs, cfg.hidden_size)
    rows = []
    for spec in a.specs.split(","):
        acc = []
        for draw in range(a.draws):
            codec = build_codec(spec, a.keep_ratio)
            lp, g, g1 = run(model, batch, codec, 100 + draw, mbs, layer, first)
            cos = float(torch.nn.functional.cosine_similarity(g, g0, dim=0))
            cos1 = float(torch.nn.functional.cosine_similarity(g1, g10, dim=0))
            sign = float(((g.sign() == g0.sign()) & (g0 != 0)).float().sum() / (g0 != 0).float().sum())
            acc.append((float(((lp - lp0).abs() * m).sum() / m.sum()), cos, cos1, sign, float(g.norm() / g0.norm())))
        mean = [sum(x[i] for x in acc) / len(acc) for i in range(5)]
        row = dict(codec=spec, bytes_ratio=iteration_bytes_ratio(build_codec(spec, a.keep_ratio), shape,
                                                                 math.ceil(batch["out"].shape[0] / mbs)),
                   mismatch=mean[0], cos=mean[1], cos_stage0=mean[2], sign_agreement=mean[3], norm_ratio=mean[4])
        rows.append(row)
        print(f"{spec:34s} bytes {row['bytes_ratio']:.4f}  mismatch {mean[0]:7.3f}  cos {mean[1]:.3f}  "
              f"cos_stage0 {mean[2]:.3f}  sign {mean[3]:.3f}  norm_ratio {mean[4]:.2f}", flush=True)
    print(f"shape {shape} seqs {batch['out'].shape[0]} tokens {int(m.sum())} {time.time() - t0:.0f}s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
