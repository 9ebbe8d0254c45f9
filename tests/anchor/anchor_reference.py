"""Independent reference for the anchor's G_anc (run as a subprocess by test_anchor_e2e.py).

Loads one anchor dump (forecast weights in megatron names, the replayed batch, G_anc),
converts the weights to HF names, evaluates the GRPO objective with the *HF* model and
the loss written out here (ratio against its own detached log-probs: -A * exp(lp - lp.detach()),
k3 KL to the reference = tiny-llama's initial weights, token mean), and saves the HF
gradients mapped back to megatron names.
"""

import sys

import torch

from megatron_cegrpo.models import (build_hf_model, hf_to_megatron, load_hf_state_dict, megatron_to_hf,
                                    resolve_model, transformer_config_from_hf)

dump_path, out_path, kl_coef = sys.argv[1], sys.argv[2], float(sys.argv[3])
torch.set_num_threads(1)
d = torch.load(dump_path, weights_only=True)
hf_config, init_sd = load_hf_state_dict(resolve_model("tiny-llama"))
tf = transformer_config_from_hf(hf_config, pipeline_model_parallel_size=1)
policy = build_hf_model(hf_config, megatron_to_hf([d["weights"]], hf_config, tf, 1))
# HF builds nn.Embedding(padding_idx=pad_token_id), which drops the gradient of that row;
# here the pad id is <|im_end|>, a real input token of every chat prompt, so undo it
policy.get_input_embeddings().padding_idx = None
ref = build_hf_model(hf_config, init_sd)
b = d["batch"]
mask = b["loss_mask"]
logits = policy(input_ids=b["tokens"]).logits.float()
lp = torch.log_softmax(logits, -1).gather(-1, b["labels"].unsqueeze(-1)).squeeze(-1)
with torch.no_grad():
    ref_lp = torch.log_softmax(ref(input_ids=b["tokens"]).logits.float(), -1).gather(
        -1, b["labels"].unsqueeze(-1)).squeeze(-1)
pg = -b["advantages"] * torch.exp(lp - lp.detach())
kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1
loss = ((pg + kl_coef * kl) * mask).sum() / mask.sum()
loss.backward()
grads = {k: p.grad for k, p in policy.named_parameters()}
if "lm_head.weight" in grads and getattr(hf_config, "tie_word_embeddings", False):
    grads.pop("lm_head.weight")
torch.save(hf_to_megatron(grads, hf_config, tf, 0, 1), out_path)
