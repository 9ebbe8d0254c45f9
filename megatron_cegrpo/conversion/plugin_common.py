"""What loaders hand to savers, and helpers shared by the convert.py plugins.

Plugin protocol (Megatron-LM ``tools/checkpoint`` style, without the queue: the models
here fit in host memory):

* ``loader_<name>.py``: ``add_arguments(parser)`` and ``load_checkpoint(args) -> ModelPayload``;
* ``saver_<name>.py``:  ``add_arguments(parser)``, ``preflight(args)`` (cheap checks of the
  target, run before the source is loaded) and ``save_checkpoint(payload, args) -> str``
  (the path written).

:func:`megatron_cegrpo.conversion.plugin` checks that a plugin module has these functions.

Conversions are pure name / layout maps (:func:`megatron_cegrpo.models.hf_to_megatron` and
:func:`~megatron_cegrpo.models.megatron_to_hf`); no torch.distributed, no model is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from transformers import AutoTokenizer

from megatron_cegrpo.models import load_tokenizer, resolve_model, transformer_config_from_hf

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class ModelPayload:
    """A whole model in canonical HF form.

    hf_config: ``transformers`` config (llama / qwen2).
    state_dict: HF parameter names -> fp32 CPU tensors, without ``lm_head.weight`` when the
        embeddings are tied (as :func:`megatron_cegrpo.models.load_hf_state_dict` returns).
    tokenizer_source: None (no tokenizer), a directory holding tokenizer files, or anything
        :func:`megatron_cegrpo.models.resolve_model` accepts (a .gguf path, a model name).
    model_name: the source's name, recorded in the megatron meta.json.
    source_meta: the source checkpoint's meta.json (megatron loader only).
    """

    hf_config: object
    state_dict: Dict[str, torch.Tensor]
    tokenizer_source: Optional[str] = None
    model_name: Optional[str] = None
    source_meta: Optional[dict] = None
    info: dict = field(default_factory=dict)


def has_tokenizer_files(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def tokenizer_source_for(model_name: Optional[str]) -> Optional[str]:
    """A tokenizer source for a ``--model`` style name, or None if it has no tokenizer."""
    if not model_name:
        return None
    try:
        src = resolve_model(model_name)
    except ValueError:
        return None
    if src.kind == "hf_dir":
        return src.path if has_tokenizer_files(src.path) else None
    return model_name


def load_tokenizer_from_source(source: str):
    """The tokenizer a :class:`ModelPayload` points to."""
    if has_tokenizer_files(source):
        return AutoTokenizer.from_pretrained(source)
    return load_tokenizer(resolve_model(source))


def to_fp32(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().to(device="cpu", dtype=torch.float32).contiguous() for k, v in sd.items()}


def tf_config_for(hf_config, pp_size: int, first: Optional[int], last: Optional[int], flag_prefix: str = ""):
    """TransformerConfig for a layer split (a pure config object; no process group needed).

    ``flag_prefix`` (e.g. ``"--target-"``) is mentioned in errors so they name the tool's flags.
    """
    try:
        return transformer_config_from_hf(
            hf_config,
            pipeline_model_parallel_size=int(pp_size),
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
            perform_initialization=False,
        )
    except ValueError as e:
        if flag_prefix:
            raise ValueError(
                f"{e} (in this tool the flags are {flag_prefix}pp-size, "
                f"{flag_prefix}decoder-first-pipeline-num-layers and "
                f"{flag_prefix}decoder-last-pipeline-num-layers)"
            ) from None
        raise
