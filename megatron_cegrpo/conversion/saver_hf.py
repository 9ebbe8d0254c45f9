"""Saver: a Hugging Face model directory loadable with ``AutoModelForCausalLM.from_pretrained``.

Writes ``config.json`` (dtype float32), ``model.safetensors`` (the canonical fp32 state
dict; no ``lm_head.weight`` when the embeddings are tied, as HF stores tied models) and the
tokenizer files when the source had a tokenizer.
"""

import copy
import glob
import os

import torch
from safetensors.torch import save_file

from megatron_cegrpo.conversion.plugin_common import load_tokenizer_from_source


def add_arguments(parser):
    pass


def preflight(args):
    out = os.path.abspath(args.save_dir)
    if os.path.isfile(os.path.join(out, "config.json")) or glob.glob(os.path.join(out, "*.safetensors")):
        raise FileExistsError(f"--save-dir {args.save_dir} already holds an HF model; choose an empty directory")


def save_checkpoint(payload, args) -> str:
    preflight(args)
    out = os.path.abspath(args.save_dir)
    os.makedirs(out, exist_ok=True)
    cfg = copy.deepcopy(payload.hf_config)
    cfg.dtype = torch.float32
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.model_type]]
    tmp = os.path.join(out, "model.safetensors.tmp")
    save_file({k: v.contiguous() for k, v in payload.state_dict.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out, "model.safetensors"))
    if payload.tokenizer_source:
        load_tokenizer_from_source(payload.tokenizer_source).save_pretrained(out)
    cfg.save_pretrained(out)
    return out
