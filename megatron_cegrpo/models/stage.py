"""A policy stage (and its frozen reference) from a model source: the one recipe used by the
trainer's stages, the anchor's dense replica (PP = 1) and the link benchmark.

HF weights -> megatron names -> a megatron-core ``GPTModel`` holding layers
``stage_layer_range(tf_config, pp_rank, pp_size)`` (``models/builder.py``, ``name_map.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from megatron_cegrpo.models.builder import build_stage, transformer_config_from_hf
from megatron_cegrpo.models.hf_config import ModelSource, resolve_model
from megatron_cegrpo.models.loader import load_hf_state_dict, load_stage_weights
from megatron_cegrpo.models.name_map import hf_to_megatron
from megatron_cegrpo.models.tp_shard import shard_stage_state_dict
from megatron_cegrpo.optim.mixed_precision import attach_mixed_precision

__all__ = ["PARAMS_DTYPES", "PRECISIONS", "PolicyStage", "build_policy_stage"]

#: ``--params-dtype`` -> torch dtype
PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: ``ModelConfig.precision`` -> (parameter dtype, compute and pipeline dtype, fp32 masters under a
#: bf16 compute view): the one place a stage's dtypes are decided (``optim/mixed_precision.py``)
PRECISIONS = {"fp32": (torch.float32, torch.float32, False),
              "bf16": (torch.bfloat16, torch.bfloat16, False),
              "bf16-mixed": (torch.float32, torch.bfloat16, True)}


@dataclass
class PolicyStage:
    """What :func:`build_policy_stage` returns.

    Attributes:
        source: the resolved model source (tokenizer files, GGUF path).
        hf_config: the HF config.
        hf_state_dict: the full HF state dict when ``keep_hf_state_dict`` (the driver's
            sampler is built from it), else None.
        tf_config: megatron-core TransformerConfig of the pipeline.
        model: this rank's stage (trainable).
        ref_model: the frozen reference copy (eval mode, no grad) or None.
    """

    source: ModelSource
    hf_config: Any
    hf_state_dict: Optional[Dict[str, torch.Tensor]]
    tf_config: Any
    model: torch.nn.Module
    ref_model: Optional[torch.nn.Module]


def build_policy_stage(model: str, *, pp_rank: int = 0, pp_size: int = 1, params_dtype: str = "fp32",
                       num_layers_in_first: Optional[int] = None, num_layers_in_last: Optional[int] = None,
                       pg_collection=None, with_reference: bool = False, per_token_loss: bool = True,
                       keep_hf_state_dict: bool = False, tp_rank: int = 0, tp_size: int = 1) -> PolicyStage:
    """Build pipeline stage ``pp_rank`` of ``pp_size`` of ``model`` with its weights loaded.

    Args:
        model: ``--model`` (an HF directory, a .gguf file, ``smollm2-135m-instruct``,
            ``tiny-llama`` / ``tiny-qwen2``).
        params_dtype: a key of :data:`PRECISIONS`: ``fp32``, ``bf16`` (``--params-dtype bf16``) or
            ``bf16-mixed`` (``--bf16``: fp32 parameters, bf16 passes and boundary tensors, with
            ``optim.mixed_precision.attach_mixed_precision`` on the stage and its reference).
        num_layers_in_first, num_layers_in_last: an uneven split (Megatron's flags).
        pg_collection: the process groups the stage uses (``DistContext.pg_collection``).
        with_reference: also build a frozen reference copy with the same weights.
        per_token_loss: the pipeline schedule divides by the token count the loss function
            returns (megatron-core's ``calculate_per_token_loss``).
        keep_hf_state_dict: return the HF state dict as well (else it is freed).
        tp_rank, tp_size: this rank's place in its tensor-parallel group (``--tensor-model-parallel-size``;
            ``pg_collection.tp`` must be that group): the stage loads its TP shard (``tp_shard.py``).

    Raises:
        ConfigError (ValueError): an unknown model or an impossible split.
    """
    source = resolve_model(model)
    hf_config, hf_sd = load_hf_state_dict(source)
    p_dtype, c_dtype, masters = PRECISIONS[params_dtype]
    tf_config = transformer_config_from_hf(
        hf_config, pipeline_model_parallel_size=pp_size, tensor_model_parallel_size=tp_size, params_dtype=p_dtype,
        num_layers_in_first_pipeline_stage=num_layers_in_first, num_layers_in_last_pipeline_stage=num_layers_in_last,
        calculate_per_token_loss=per_token_loss, pipeline_dtype=c_dtype, bf16=c_dtype == torch.bfloat16)
    stage_sd = shard_stage_state_dict(hf_to_megatron(hf_sd, hf_config, tf_config, pp_rank, pp_size), tp_rank, tp_size)
    policy = build_stage(hf_config, tf_config, pp_rank=pp_rank, pp_size=pp_size, pg_collection=pg_collection)
    load_stage_weights(policy, stage_sd)
    ref = None
    if with_reference:
        ref = build_stage(hf_config, tf_config, pp_rank=pp_rank, pp_size=pp_size, pg_collection=pg_collection)
        load_stage_weights(ref, stage_sd)
        ref.requires_grad_(False)
        ref.eval()
    del stage_sd
    if masters:
        for m in (policy, ref):
            if m is not None:
                attach_mixed_precision(m, c_dtype)
    return PolicyStage(source=source, hf_config=hf_config, hf_state_dict=hf_sd if keep_hf_state_dict else None,
                       tf_config=tf_config, model=policy, ref_model=ref)
