"""Build megatron-core ``GPTModel`` pipeline stages from a Hugging Face config.

Stage / layer-offset mechanism (megatron-core 0.16.1)
-----------------------------------------------------
``TransformerBlock`` decides how many layers to build and their global numbering from
``get_num_layers_to_build(config, vp_stage, pp_rank)`` and
``get_transformer_layer_offset(config, vp_stage, pp_rank)``, where ``pp_rank`` is
``megatron.core.utils.get_pg_rank(pg_collection.pp)`` (i.e. ``pg_collection.pp.rank()``);
``LanguageModule`` likewise asks ``is_pp_first_stage/is_pp_last_stage(pg_collection.pp)``
(``rank()`` / ``size()``) when it sets up tied embeddings.  The global
``parallel_state`` pipeline rank is *not* consulted once a ``pg_collection`` is passed.

:func:`build_stage` therefore always passes an explicit ``ProcessGroupCollection``:

* inside a real pipeline group whose rank/size equal ``(pp_rank, pp_size)`` it is
  megatron's default collection (``ProcessGroupCollection.use_mpu_process_groups()``), so
  the embedding group, p2p etc. are the real ones;
* otherwise (one process building every stage, e.g. tests or conversion tools, with
  ``parallel_state`` initialised with PP=1) it is a copy of that collection whose ``pp`` is a
  :class:`StageRankGroup` that only answers ``rank() -> pp_rank`` and
  ``size() -> pp_size`` (the only calls megatron makes on it while building and running a
  GPTModel stage) and whose ``embd`` is ``None`` (no cross-stage weight sync in one
  process; :func:`~megatron_cegrpo.models.loader.load_stage_weights` sets both tied copies
  from the same HF tensor).

Tied embeddings under PP: with ``share_embeddings_and_output_weights`` and pp > 1 the last
stage owns a separate ``output_layer.weight``.  Megatron zero-fills it and all-reduces it
over the embedding group at construction; loading HF weights then sets the first stage's
``embedding.word_embeddings.weight`` and the last stage's ``output_layer.weight`` to the same
tensor (``model.embed_tokens.weight``).  During training either call
:func:`allreduce_tied_embedding_grads` (sum of both grads) before the optimizer step so both
copies receive identical updates (``--tied-embedding-sync allreduce``), or let the last stage
own W and exchange only the rows of the batch's tokens
(``megatron_cegrpo/pipeline/tied_embedding.py``, the default).

Forward: ``stage(input_ids [b, s], position_ids [b, s], attention_mask) -> logits [b, s, V]``
on the last stage (``labels=None``), hidden states ``[s, b, h]`` on the others (feed them to
the next stage with ``set_input_tensor``; pass ``input_ids=None`` there).  With the local
spec ``attention_mask=None`` means causal attention (megatron builds the upper-triangular
mask), which is all right-padded batches need: padding sits after every real token.  An
explicit mask is a bool tensor broadcastable to ``[b, 1, s, s]`` with True = masked out.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

PP_FLAG = "--pipeline-model-parallel-size"
TP_FLAG = "--tensor-model-parallel-size"
UNEVEN_FLAGS = "--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers"


# ----------------------------------------------------------------------------- config


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(
            f"rope_type {rope_type!r} of model_type {hf_config.model_type!r} is not supported "
            "(only 'default' RoPE)"
        )
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if legacy_scaling and legacy_scaling.get("rope_type", legacy_scaling.get("type")) not in (
        None,
        "default",
    ):
        raise ValueError(f"rope_scaling {legacy_scaling!r} is not supported")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"cannot find rope_theta in the {hf_config.model_type!r} config")
    return float(theta)


def _check_supported(hf_config) -> None:
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {mt!r}; supported model types: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
    if mt == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        raise ValueError("llama configs with attention_bias/mlp_bias are not supported")
    if mt == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("qwen2 with use_sliding_window=True is not supported")
    _rope_theta(hf_config)  # unsupported RoPE variants fail here, before any model is built


def check_model_config(hf_config, pipeline_model_parallel_size: int, num_layers_in_first: Optional[int] = None,
                       num_layers_in_last: Optional[int] = None, tensor_model_parallel_size: int = 1) -> None:
    """The start-up check of a model against the parallel flags, before anything is built:
    a supported architecture, a layer split ``--pipeline-model-parallel-size`` (with
    ``--decoder-first/last-pipeline-num-layers``) can place, and head / KV-head / FFN / vocab
    counts ``--tensor-model-parallel-size`` divides (:func:`check_tensor_parallel`).

    Raises:
        ConfigError: naming the flag (or the model's config field) and the fix.
    """
    from megatron_cegrpo.errors import ConfigError, one_line

    try:
        _check_supported(hf_config)
    except ValueError as e:
        raise ConfigError(f"--model: {one_line(e)}; fix: use a llama or qwen2 model with the default RoPE "
                          "(see docs/launching.md, --model)") from None
    try:
        _validate_split(int(hf_config.num_hidden_layers), pipeline_model_parallel_size, num_layers_in_first,
                        num_layers_in_last)
        check_tensor_parallel(hf_config, tensor_model_parallel_size)
    except ValueError as e:
        raise ConfigError(one_line(e)) from None


def check_tensor_parallel(hf_config, tp_size: int) -> None:
    """Whether megatron-core's tensor-parallel layers can split this model ``tp_size`` ways.

    Each TP rank holds ``heads / tp`` query heads and ``kv_heads / tp`` KV heads (megatron's
    ``SelfAttention`` divides ``num_attention_heads`` and ``num_query_groups`` by the TP size),
    ``ffn / tp`` rows of the MLP and ``vocab / tp`` rows of the embedding and output layer
    (``VocabParallelEmbedding`` / ``ColumnParallelLinear`` do not pad). Issue 14.

    Raises:
        ValueError: one line naming ``--tensor-model-parallel-size``, the model's counts and the fix.
    """
    if tp_size < 1:
        raise ValueError(f"{TP_FLAG} must be >= 1, got {tp_size}")
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    ffn, vocab = int(hf_config.intermediate_size), int(hf_config.vocab_size)
    if heads % tp_size or kv % tp_size:
        divisors = [d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0]
        raise ValueError(
            f"{TP_FLAG}={tp_size} does not divide the model's {heads} attention heads and {kv} KV heads "
            f"(num_attention_heads, num_key_value_heads: each TP rank holds whole heads); fix: choose one of "
            f"{', '.join(map(str, divisors))}")
    for what, n in (("intermediate_size", ffn), ("vocab_size", vocab)):
        if n % tp_size:
            raise ValueError(f"{TP_FLAG}={tp_size} does not divide the model's {what} {n}; fix: choose a "
                             f"TP size that divides {n}")


def head_dim(hf_config) -> int:
    hd = getattr(hf_config, "head_dim", None)
    return int(hd) if hd else hf_config.hidden_size // hf_config.num_attention_heads


def _validate_split(num_layers: int, pp_size: int, first: Optional[int], last: Optional[int]):
    if pp_size < 1:
        raise ValueError(f"{PP_FLAG} must be >= 1, got {pp_size}")
    if first is None and last is None:
        if num_layers % pp_size:
            raise ValueError(
                f"{PP_FLAG}={pp_size} does not divide the model's {num_layers} layers; choose a "
                f"divisor of {num_layers} or give an uneven split with {UNEVEN_FLAGS}"
            )
        return
    if pp_size < 2:
        raise ValueError(f"{UNEVEN_FLAGS} need {PP_FLAG} >= 2 (got {pp_size})")
    rest, stages = num_layers, pp_size
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is not None:
            if n <= 0:
                raise ValueError(f"{flag} must be > 0, got {n}")
            rest -= n
            stages -= 1
    if rest < 0 or bool(rest) != bool(stages) or (stages and rest % stages):
        raise ValueError(
            f"uneven split {UNEVEN_FLAGS}={first}/{last} with {PP_FLAG}={pp_size} cannot place "
            f"{num_layers} layers: {rest} layer(s) would be left for {stages} middle stage(s) "
            "(they must divide evenly, and first + last must equal the layer count when there "
            f"are no middle stages); fix: choose first/last layer counts that leave each of the {stages} "
            f"other stage(s) the same number of the model's {num_layers} layers (at least one)"
        )


def transformer_config_from_hf(
    hf_config,
    *,
    pipeline_model_parallel_size: int = 1,
    tensor_model_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    num_layers_in_first_pipeline_stage: Optional[int] = None,
    num_layers_in_last_pipeline_stage: Optional[int] = None,
    **overrides,
):
    """megatron ``TransformerConfig`` equivalent to a llama / qwen2 HF config.

    ``overrides`` are applied last (any TransformerConfig field).  Raises ValueError for
    unsupported architectures, an impossible layer split or a TP size that does not divide the
    heads (:func:`check_tensor_parallel`). Sequence parallelism stays off: every TP rank holds
    the full hidden state ``[s, b, h]`` between layers (what crosses a stage boundary).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check_supported(hf_config)
    n_layers = int(hf_config.num_hidden_layers)
    _validate_split(
        n_layers,
        pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage,
    )
    check_tensor_parallel(hf_config, tensor_model_parallel_size)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    kwargs = dict(
        num_layers=n_layers,
        hidden_size=int(hf_config.hidden_size),
        num_attention_heads=int(hf_config.num_attention_heads),
        num_query_groups=int(kv_heads),
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=int(hf_config.intermediate_size),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        variable_seq_lengths=False,
        tensor_model_parallel_size=tensor_model_parallel_size,
        sequence_parallel=False,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
        # Weights are created on the host and (on CPU) stay there; this also keeps the
        # initialisation out of the CUDA-RNG tracker's fork().
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def stage_layer_range(tf_config, pp_rank: int, pp_size: int) -> Tuple[int, int]:
    """Global ``[start, end)`` decoder-layer indices held by pipeline stage ``pp_rank``."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if tf_config.pipeline_model_parallel_size != pp_size:
        raise ValueError(
            f"tf_config.pipeline_model_parallel_size={tf_config.pipeline_model_parallel_size} "
            f"!= pp_size={pp_size}"
        )
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    start = get_transformer_layer_offset(tf_config, vp_stage=None, pp_rank=pp_rank)
    n = get_num_layers_to_build(tf_config, vp_stage=None, pp_rank=pp_rank)
    return start, start + n


# ----------------------------------------------------------------------------- stages


class StageRankGroup:
    """Stand-in for the pipeline process group when all stages live in one process.

    megatron-core only calls ``rank()`` and ``size()`` on ``pg_collection.pp`` while
    building / running a GPTModel stage (layer count, layer offset, first/last stage).
    Any other use (p2p, collectives) fails loudly with AttributeError.
    """

    def __init__(self, rank: int, size: int):
        self._rank, self._size = int(rank), int(size)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"StageRankGroup(rank={self._rank}, size={self._size})"


def stage_pg_collection(pp_rank: int, pp_size: int):
    """The ProcessGroupCollection :func:`build_stage` passes to GPTModel (see module doc)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_pg_rank, get_pg_size

    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        raise RuntimeError(
            "build_stage needs torch.distributed and megatron's parallel_state initialised "
            "(see init_single_process_megatron() for a one-process setup)"
        )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    real_rank, real_size = get_pg_rank(pgs.pp), get_pg_size(pgs.pp)
    if (real_rank, real_size) == (pp_rank, pp_size):
        return pgs
    if real_size != 1:
        raise ValueError(
            f"build_stage(pp_rank={pp_rank}, pp_size={pp_size}) called in a process whose "
            f"pipeline group is rank {real_rank} of {real_size}"
        )
    virtual = ProcessGroupCollection()
    for f in dataclasses.fields(ProcessGroupCollection):
        if hasattr(pgs, f.name):
            setattr(virtual, f.name, getattr(pgs, f.name))
    virtual.pp = StageRankGroup(pp_rank, pp_size)
    virtual.embd = None
    virtual.pos_embd = None
    return virtual


def build_stage(hf_config, tf_config, *, pp_rank: int, pp_size: int, pg_collection=None):
    """Build the GPTModel for pipeline stage ``pp_rank`` of ``pp_size`` (local spec, RoPE).

    Works both inside a real pipeline group and in a single process building every stage
    (see module docstring).  Weights are megatron-initialised; load HF weights with
    :func:`megatron_cegrpo.models.loader.load_stage_weights`.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_cegrpo.compat.placement import compute_device

    _check_supported(hf_config)
    stage_layer_range(tf_config, pp_rank, pp_size)  # validates rank/size vs. config
    if pg_collection is None:
        pg_collection = stage_pg_collection(pp_rank, pp_size)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=spec,
        vocab_size=int(hf_config.vocab_size),
        max_sequence_length=int(hf_config.max_position_embeddings),
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        # TP > 1: the last stage all-gathers the vocab-parallel logits (megatron's
        # gather_from_tensor_model_parallel_region; backward: each rank keeps its vocab slice), so
        # every loss function sees full-vocabulary logits [b, s, V] on every TP rank
        parallel_output=tf_config.tensor_model_parallel_size == 1,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
        pg_collection=pg_collection,
    )
    # onto this rank's device, as megatron's get_model does (model.cuda()): the local spec's torch
    # RMSNorm (no Apex / Transformer Engine) creates its weights on the CPU even on a GPU host
    return model.to(compute_device())


def allreduce_tied_embedding_grads(model, embedding_group) -> None:
    """Sum the grads of the tied embedding / output weight over ``embedding_group``.

    No-op when the model does not tie its embeddings, when ``embedding_group`` is None,
    when this rank is not in the group, or for a middle stage (no copy of the weight).
    Handles megatron DDP's ``main_grad`` as well as plain ``.grad``.
    """
    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "shared_embedding_or_output_weight"):
        inner = inner.module
    if not getattr(inner, "share_embeddings_and_output_weights", False) or embedding_group is None:
        return
    if not torch.distributed.is_initialized():
        return
    ranks = torch.distributed.get_process_group_ranks(embedding_group)
    if torch.distributed.get_rank() not in ranks or len(ranks) < 2:
        return
    weight = inner.shared_embedding_or_output_weight()
    if weight is None:
        return
    grad_attr = "main_grad" if getattr(weight, "main_grad", None) is not None else "grad"
    grad = getattr(weight, grad_attr)
    if grad is None:
        grad = torch.zeros_like(weight)
        setattr(weight, grad_attr, grad)
    torch.distributed.all_reduce(grad, group=embedding_group)


# ----------------------------------------------------------------------------- process setup


def init_single_process_megatron(seed: int = 1234, init_file: Optional[str] = None) -> bool:
    """World-size-1 gloo process group + megatron parallel_state (TP=PP=1) + RNG seed.

    Applies the CPU compat layer first (no-op with CUDA).  Uses a FileStore at
    ``init_file`` (a fresh temp file by default).  Returns True if it created the process
    group (and should tear it down with :func:`destroy_single_process_megatron`).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_cegrpo.compat.cpu import apply_cpu_compat
    from megatron_cegrpo.compat.placement import process_group_backend

    apply_cpu_compat()
    created = False
    if not torch.distributed.is_initialized():
        if init_file is None:
            fd, init_file = tempfile.mkstemp(prefix="megatron_cegrpo_pg_")
            os.close(fd)
            os.unlink(init_file)
        torch.distributed.init_process_group(
            process_group_backend(), init_method=f"file://{init_file}", rank=0, world_size=1
        )
        created = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1
        )
    model_parallel_cuda_manual_seed(seed)
    return created


def destroy_single_process_megatron(destroy_process_group: bool = True) -> None:
    """Undo :func:`init_single_process_megatron`."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if destroy_process_group and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
