"""Loader: a megatron_cegrpo checkpoint of any pipeline and tensor-parallel size.

``--load-dir`` is a save directory (``latest`` is followed) or an ``iter_XXXXXXX``
directory.  Every file is checked against the sha256 in meta.json first (``--no-verify``
skips that).  A stage's TP shards (meta ``tp_size`` > 1) are merged first
(:func:`~megatron_cegrpo.checkpointing.read_stage_model`).  Stage files are merged back to one HF-named fp32 state dict with
:func:`megatron_cegrpo.models.megatron_to_hf`.  The checkpoint's ``tokenizer/`` directory,
if any, is carried along; otherwise the tokenizer of ``model_name`` when that is a
resolvable model.
"""

import os

import torch

from megatron_cegrpo import checkpointing as ckpt
from megatron_cegrpo.conversion.plugin_common import ModelPayload, tf_config_for, to_fp32, tokenizer_source_for
from megatron_cegrpo.models import megatron_to_hf


def add_arguments(parser):
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the source files")


def load_checkpoint(args) -> ModelPayload:
    ckpt_dir, iteration = ckpt.resolve_load_dir(args.load_dir)
    meta = ckpt.read_meta(ckpt_dir) if args.no_verify else ckpt.verify_checkpoint(ckpt_dir)
    hf_config = ckpt.hf_config_from_meta(meta)
    pp = int(meta["pp_size"])
    tf = tf_config_for(hf_config, pp, meta["num_layers_in_first"], meta["num_layers_in_last"])
    stages = [ckpt.read_stage_model(ckpt_dir, r, verify=False, meta=meta) for r in range(pp)]
    if getattr(hf_config, "tie_word_embeddings", False) and pp > 1:
        emb = stages[0]["embedding.word_embeddings.weight"]
        out = stages[-1]["output_layer.weight"]
        if not torch.equal(emb.float(), out.float()):
            diff = (emb.float() - out.float()).abs().max().item()
            print(f"[convert] warning: tied embedding copies differ (max |diff| {diff:.3g}); the first "
                  "stage's embedding is exported (the trainer must all-reduce the tied grads)", flush=True)
    sd = to_fp32(megatron_to_hf(stages, hf_config, tf, pp))
    tok_dir = os.path.join(ckpt_dir, ckpt.TOKENIZER_DIR)
    tok = None
    if os.path.isdir(tok_dir):
        tok = tok_dir
    else:
        tok = tokenizer_source_for(meta.get("model_name"))
    return ModelPayload(hf_config, sd, tokenizer_source=tok, model_name=meta.get("model_name"),
                        source_meta=meta, info={"iteration": iteration, "checkpoint_dir": ckpt_dir})
