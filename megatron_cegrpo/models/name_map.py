"""Parameter name / layout mapping between HF llama|qwen2 and megatron GPTModel stages.

HF (per layer L, global index)           megatron stage (local index i = L - stage start)
---------------------------------------  ------------------------------------------------
model.embed_tokens.weight                embedding.word_embeddings.weight        (first stage)
model.layers.L.input_layernorm.weight    decoder.layers.i.input_layernorm.weight
model.layers.L.self_attn.{q,k,v}_proj.*  decoder.layers.i.self_attention.linear_qkv.{weight,bias}
model.layers.L.self_attn.o_proj.weight   decoder.layers.i.self_attention.linear_proj.weight
model.layers.L.post_attention_layernorm  decoder.layers.i.pre_mlp_layernorm.weight
model.layers.L.mlp.{gate,up}_proj.weight decoder.layers.i.mlp.linear_fc1.weight = cat[gate, up]
model.layers.L.mlp.down_proj.weight      decoder.layers.i.mlp.linear_fc2.weight
model.norm.weight                        decoder.final_layernorm.weight           (last stage)
lm_head.weight                           output_layer.weight                      (last stage)
                                         (tied: the last stage's copy of embed_tokens when
                                          pp > 1; absent when pp == 1)

linear_qkv is grouped per query group g (num_query_groups groups, heads_per_group =
num_heads / num_query_groups): rows ``[q heads of g (heads_per_group*head_dim) | k_g
(head_dim) | v_g (head_dim)]`` for g = 0..G-1, the layout megatron's
``SelfAttention.get_query_key_value_tensors`` splits.  HF's query head h uses kv head
``h // heads_per_group`` (``repeat_kv``), megatron's ``repeat_interleave`` does the same,
so q heads are taken in order.  The qwen2 q/k/v biases follow the same interleaving.
RoPE needs no permutation: HF's rotate_half matches megatron's ``rotary_interleaved=False``
(transformers' GGUF loader already undoes llama.cpp's q/k permutation).

Canonical HF state dicts (as returned by :mod:`megatron_cegrpo.models.loader`) have no
``lm_head.weight`` when embeddings are tied.  Non-parameter entries of megatron state
dicts (``*._extra_state``) are ignored.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Union

import torch

from megatron_cegrpo.models.builder import head_dim, stage_layer_range

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# megatron per-layer suffix -> HF per-layer suffix for the 1:1 tensors
_SIMPLE_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def is_ignored_key(key: str) -> bool:
    """Non-parameter megatron state-dict entries that carry no weights."""
    return key.endswith("_extra_state")


def _tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _qkv_dims(hf_config):
    n_heads = int(hf_config.num_attention_heads)
    n_groups = int(getattr(hf_config, "num_key_value_heads", None) or n_heads)
    if n_heads % n_groups:
        raise ValueError(f"num_attention_heads {n_heads} not divisible by kv heads {n_groups}")
    return n_groups, n_heads // n_groups, head_dim(hf_config)


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> megatron grouped linear_qkv."""
    g, hpg, hd = _qkv_dims(hf_config)
    tail = q.shape[1:]
    q = q.reshape(g, hpg * hd, *tail)
    k = k.reshape(g, hd, *tail)
    v = v.reshape(g, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(g * (hpg + 2) * hd, *tail)


def unpack_qkv(qkv: torch.Tensor, hf_config):
    """Inverse of :func:`pack_qkv`: megatron linear_qkv -> (q, k, v) in HF layout."""
    g, hpg, hd = _qkv_dims(hf_config)
    tail = qkv.shape[1:]
    if qkv.shape[0] != g * (hpg + 2) * hd:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, expected {g * (hpg + 2) * hd}")
    grouped = qkv.reshape(g, (hpg + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
    return (
        q.reshape(g * hpg * hd, *tail),
        k.reshape(g * hd, *tail),
        v.reshape(g * hd, *tail),
    )


def _get(hf_sd, key):
    try:
        return hf_sd[key]
    except KeyError:
        raise KeyError(f"HF state dict has no {key!r}") from None


def hf_to_megatron(hf_state_dict, hf_config, tf_config, pp_rank: int, pp_size: int) -> Dict[str, torch.Tensor]:
    """Exactly the parameters of megatron stage ``pp_rank`` (stage-local layer indices)."""
    start, end = stage_layer_range(tf_config, pp_rank, pp_size)
    pre, post = pp_rank == 0, pp_rank == pp_size - 1
    has_bias = bool(tf_config.add_qkv_bias)
    out: Dict[str, torch.Tensor] = {}
    if pre:
        out["embedding.word_embeddings.weight"] = _get(hf_state_dict, "model.embed_tokens.weight")
    for i, L in enumerate(range(start, end)):
        hp, mp = f"model.layers.{L}.", f"decoder.layers.{i}."
        for m_suffix, h_suffix in _SIMPLE_LAYER.items():
            out[mp + m_suffix] = _get(hf_state_dict, hp + h_suffix)
        out[mp + "self_attention.linear_qkv.weight"] = pack_qkv(
            *(_get(hf_state_dict, f"{hp}self_attn.{n}_proj.weight") for n in "qkv"), hf_config
        )
        if has_bias:
            out[mp + "self_attention.linear_qkv.bias"] = pack_qkv(
                *(_get(hf_state_dict, f"{hp}self_attn.{n}_proj.bias") for n in "qkv"), hf_config
            )
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [_get(hf_state_dict, hp + "mlp.gate_proj.weight"), _get(hf_state_dict, hp + "mlp.up_proj.weight")],
            dim=0,
        )
    if post:
        out["decoder.final_layernorm.weight"] = _get(hf_state_dict, "model.norm.weight")
        if not _tied(hf_config):
            out["output_layer.weight"] = _get(hf_state_dict, "lm_head.weight")
        elif not pre:
            # Last stage's own copy of the tied weight (pp > 1): same values as the embedding.
            out["output_layer.weight"] = _get(hf_state_dict, "model.embed_tokens.weight")
    return out


def _strip_prefix(key: str) -> str:
    while key.startswith("module."):
        key = key[len("module.") :]
    return key


def _stage_to_hf(sd, hf_config, tf_config, pp_rank: int, pp_size: int) -> Dict[str, torch.Tensor]:
    start, end = stage_layer_range(tf_config, pp_rank, pp_size)
    pre, post = pp_rank == 0, pp_rank == pp_size - 1
    out: Dict[str, torch.Tensor] = {}
    for raw_key, t in sd.items():
        key = _strip_prefix(raw_key)
        if is_ignored_key(key):
            continue
        m = _LAYER_RE.match(key)
        if m:
            i, suffix = int(m.group(1)), m.group(2)
            if not 0 <= i < end - start:
                raise KeyError(f"stage {pp_rank} has layers 0..{end - start - 1}, got {raw_key!r}")
            hp = f"model.layers.{start + i}."
            if suffix in _SIMPLE_LAYER:
                out[hp + _SIMPLE_LAYER[suffix]] = t
            elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
                kind = suffix.rsplit(".", 1)[1]
                q, k, v = unpack_qkv(t, hf_config)
                for n, part in zip("qkv", (q, k, v)):
                    out[f"{hp}self_attn.{n}_proj.{kind}"] = part
            elif suffix == "mlp.linear_fc1.weight":
                gate, up = torch.chunk(t, 2, dim=0)
                out[hp + "mlp.gate_proj.weight"] = gate
                out[hp + "mlp.up_proj.weight"] = up
            else:
                raise KeyError(f"unknown megatron parameter {raw_key!r}")
        elif key == "embedding.word_embeddings.weight" and pre:
            out["model.embed_tokens.weight"] = t
        elif key == "decoder.final_layernorm.weight" and post:
            out["model.norm.weight"] = t
        elif key == "output_layer.weight" and post:
            if not _tied(hf_config):
                out["lm_head.weight"] = t
            # tied: the last stage's copy duplicates model.embed_tokens.weight -> dropped
        else:
            raise KeyError(f"unexpected megatron parameter {raw_key!r} for stage {pp_rank}/{pp_size}")
    return out


def megatron_to_hf(
    stage_state_dicts: Union[List[dict], dict],
    hf_config,
    tf_config,
    pp_size: Optional[int] = None,
    *,
    pp_rank: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_megatron`.

    * ``stage_state_dicts`` a list of all ``pp_size`` stage state dicts (index = pp rank):
      the full canonical HF state dict.
    * a single stage dict plus ``pp_rank`` (and ``pp_size``): that stage's HF tensors
      (with tied embeddings the last stage's output copy is dropped; the first stage
      provides ``model.embed_tokens.weight``).

    Tensors are views of the inputs where the layout allows (no copies of 1:1 tensors).
    """
    if isinstance(stage_state_dicts, dict):
        if pp_rank is None:
            raise ValueError("megatron_to_hf with a single stage dict needs pp_rank")
        pp_size = pp_size if pp_size is not None else tf_config.pipeline_model_parallel_size
        return _stage_to_hf(stage_state_dicts, hf_config, tf_config, pp_rank, pp_size)
    sds = list(stage_state_dicts)
    if pp_size is None:
        pp_size = len(sds)
    if len(sds) != pp_size:
        raise ValueError(f"got {len(sds)} stage state dicts for pp_size={pp_size}")
    out: Dict[str, torch.Tensor] = {}
    for r, sd in enumerate(sds):
        part = _stage_to_hf(sd, hf_config, tf_config, r, pp_size)
        dup = set(out) & set(part)
        if dup:
            raise KeyError(f"stage {r} duplicates HF keys {sorted(dup)[:5]}")
        out.update(part)
    return out
