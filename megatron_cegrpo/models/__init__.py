"""megatron-core GPTModel pipeline stages built from Hugging Face llama / qwen2 models."""

from megatron_cegrpo.models.builder import (
    SUPPORTED_MODEL_TYPES,
    StageRankGroup,
    allreduce_tied_embedding_grads,
    build_stage,
    destroy_single_process_megatron,
    init_single_process_megatron,
    stage_layer_range,
    stage_pg_collection,
    transformer_config_from_hf,
)
from megatron_cegrpo.models.hf_config import (
    ModelSource,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)
from megatron_cegrpo.models.loader import (
    build_hf_model,
    load_hf_state_dict,
    load_stage_weights,
)
from megatron_cegrpo.models.name_map import hf_to_megatron, megatron_to_hf

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelSource",
    "StageRankGroup",
    "allreduce_tied_embedding_grads",
    "build_hf_model",
    "build_stage",
    "destroy_single_process_megatron",
    "hf_to_megatron",
    "init_single_process_megatron",
    "load_hf_config",
    "load_hf_state_dict",
    "load_stage_weights",
    "load_tokenizer",
    "megatron_to_hf",
    "resolve_model",
    "stage_layer_range",
    "stage_pg_collection",
    "transformer_config_from_hf",
]
