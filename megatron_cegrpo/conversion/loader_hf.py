"""Loader: a Hugging Face llama / qwen2 model directory (config.json + *.safetensors).

``--load-dir`` also accepts the random test models ``tiny-llama`` / ``tiny-qwen2``.  The
tokenizer is carried along when the directory has tokenizer files.
"""

from megatron_cegrpo.conversion.plugin_common import ModelPayload, to_fp32, tokenizer_source_for
from megatron_cegrpo.models import load_hf_state_dict, resolve_model


def add_arguments(parser):
    pass


def load_checkpoint(args) -> ModelPayload:
    source = resolve_model(args.load_dir)
    if source.kind not in ("hf_dir", "tiny"):
        raise ValueError(f"--loader hf: {args.load_dir} is a GGUF file; use --loader gguf")
    hf_config, sd = load_hf_state_dict(source)
    tok = tokenizer_source_for(args.load_dir)  # tiny-*: SmolLM2's tokenizer, as they use
    return ModelPayload(hf_config, to_fp32(sd), tokenizer_source=tok, model_name=args.load_dir)
