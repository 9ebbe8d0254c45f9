"""Saver: a megatron_cegrpo checkpoint (see megatron_cegrpo/checkpointing/format.py) of any PP and TP size.

Writes ``<save-dir>/iter_XXXXXXX`` (iteration ``--target-iteration``, default 0) with one
``stage_XX/model.safetensors`` per stage (fp32, :func:`megatron_cegrpo.models.hf_to_megatron`
names), meta.json (no codec: the checkpoint fits any ``--boundary-codec``), ``latest``, and
``tokenizer/`` when the source had one.  ``--target-pp-size`` defaults to the source's PP
size for ``--loader megatron`` and to 1 otherwise; ``--target-tp-size`` likewise: with TP > 1 each
stage gets one ``model_tpRR.safetensors`` shard per TP rank (``models/tp_shard.py``).
"""

import os

from megatron_cegrpo import checkpointing as ckpt
from megatron_cegrpo.conversion.plugin_common import load_tokenizer_from_source, tf_config_for
from megatron_cegrpo.models import hf_to_megatron
from megatron_cegrpo.models.builder import check_tensor_parallel
from megatron_cegrpo.models.tp_shard import shard_stage_state_dict


def add_arguments(parser):
    parser.add_argument("--target-pp-size", type=int, default=None,
                        help="pipeline-model-parallel size of the output (default: the source's, or 1)")
    parser.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None,
                        help="layers of the first stage (uneven split)")
    parser.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None,
                        help="layers of the last stage (uneven split)")
    parser.add_argument("--target-tp-size", type=int, default=None,
                        help="tensor-model-parallel size of the output (default: the source's, or 1)")
    parser.add_argument("--target-iteration", type=int, default=0, help="iteration recorded (default 0)")


def preflight(args):
    if ckpt.has_checkpoint(args.save_dir):
        raise FileExistsError(f"--save-dir {args.save_dir} already holds a checkpoint; choose an empty directory")


def save_checkpoint(payload, args) -> str:
    preflight(args)
    pp = args.target_pp_size
    first, last = args.target_decoder_first_pipeline_num_layers, args.target_decoder_last_pipeline_num_layers
    if pp is None:
        src = payload.source_meta or {}
        pp = int(src.get("pp_size", 1))
        if first is None and last is None and src:
            first, last = src.get("num_layers_in_first"), src.get("num_layers_in_last")
    tp = args.target_tp_size or int((payload.source_meta or {}).get("tp_size", 1))
    try:
        check_tensor_parallel(payload.hf_config, tp)
    except ValueError as e:
        raise ValueError(str(e).replace("--tensor-model-parallel-size", "--target-tp-size")) from None
    tf = tf_config_for(payload.hf_config, pp, first, last, flag_prefix="--target-")
    tmp = ckpt.begin_save(args.save_dir, args.target_iteration)
    for r in range(pp):
        stage = hf_to_megatron(payload.state_dict, payload.hf_config, tf, r, pp)
        for t in range(tp):
            ckpt.write_stage_file(tmp, r, ckpt.model_file_name(t, tp), shard_stage_state_dict(stage, t, tp))
    if payload.tokenizer_source:
        load_tokenizer_from_source(payload.tokenizer_source).save_pretrained(os.path.join(tmp, ckpt.TOKENIZER_DIR))
    extra = {"converted_from": os.path.abspath(args.load_dir) if os.path.exists(args.load_dir) else args.load_dir,
             "loader": args.loader}
    if payload.source_meta:
        extra["source_iteration"] = payload.source_meta.get("iteration")
        extra["source_pp_size"] = payload.source_meta.get("pp_size")
        extra["source_tp_size"] = payload.source_meta.get("tp_size", 1)
    meta = ckpt.make_meta(hf_config=payload.hf_config, pp_size=pp, num_layers_in_first=first,
                          num_layers_in_last=last, codec=None, model_name=payload.model_name,
                          params_dtype="float32", extra=extra, tp_size=tp)
    return ckpt.commit_save(args.save_dir, tmp, args.target_iteration, meta)
