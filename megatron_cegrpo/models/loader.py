"""Load HF weights (safetensors dir, GGUF, or tiny random init) and put them into stages.

``load_hf_state_dict`` returns the *canonical* HF state dict: fp32 tensors named as in
``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, without ``lm_head.weight`` when the embeddings
are tied (as HF writes them to disk).

GGUF: transformers dequantises the file (SmolLM2 Q4_1: ~12 s on one core); the fp32 result
is cached as ``model.safetensors`` next to the cached config/tokenizer (see
:func:`megatron_cegrpo.models.hf_config.gguf_cache_dir`), so later loads take well under a
second.
"""

from __future__ import annotations

import copy
import glob
import os
from typing import Dict, Tuple

import torch

from megatron_cegrpo.models.hf_config import (
    ModelSource,
    gguf_cache_dir,
    load_hf_config,
    write_to_cache,
)
from megatron_cegrpo.models.name_map import is_ignored_key

TINY_SEED = 1234
_WEIGHTS_FILE = "model.safetensors"


def _canonical(sd, hf_config) -> Dict[str, torch.Tensor]:
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out = {}
    for k, v in sd.items():
        if tied and k == "lm_head.weight":
            continue
        if k.endswith("rotary_emb.inv_freq"):
            continue
        out[k] = v.detach().to(torch.float32).contiguous()
    return out


def hf_model_class(hf_config):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}
    if hf_config.model_type not in classes:
        raise ValueError(
            f"unsupported model_type {hf_config.model_type!r}; supported: {', '.join(classes)}"
        )
    return classes[hf_config.model_type]


def tiny_random_state_dict(hf_config, seed: int = TINY_SEED) -> Dict[str, torch.Tensor]:
    """Seeded random init through the HF model class (global RNG left untouched).

    After HF's own init (normal(0, initializer_range) matrices, unit norms, zero biases)
    the norm weights become ``1 + 0.1 * N(0, 1)`` and the biases ``0.02 * N(0, 1)`` so that
    every tensor carries signal (an interleaving bug in the qwen2 qkv bias would otherwise
    be invisible).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf_model_class(hf_config)(hf_config)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif name.endswith(".bias"):
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        return _canonical(model.state_dict(), hf_config)


def _load_safetensors_dir(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    sd: Dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def _load_gguf(source: ModelSource, hf_config) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    cdir = gguf_cache_dir(source)
    cached = os.path.join(cdir, _WEIGHTS_FILE)
    if os.path.isfile(cached):
        return load_file(cached)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32
    )
    sd = _canonical(model.state_dict(), hf_config)
    del model
    write_to_cache(cdir, _WEIGHTS_FILE, lambda d: save_file(sd, os.path.join(d, _WEIGHTS_FILE)))
    return sd


def load_hf_state_dict(source: ModelSource, *, seed: int = TINY_SEED) -> Tuple[object, Dict[str, torch.Tensor]]:
    """(hf_config, canonical fp32 HF state dict) for a model source."""
    hf_config = load_hf_config(source)
    if source.kind == "tiny":
        return hf_config, tiny_random_state_dict(hf_config, seed)
    if source.kind == "hf_dir":
        return hf_config, _canonical(_load_safetensors_dir(source.path), hf_config)
    if source.kind == "gguf":
        return hf_config, _canonical(_load_gguf(source, hf_config), hf_config)
    raise ValueError(f"unknown ModelSource kind {source.kind!r}")


def build_hf_model(hf_config, hf_state_dict, attn_implementation: str = "eager"):
    """The HF reference model (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``) with these weights."""
    cfg = copy.deepcopy(hf_config)
    cfg._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):  # HF's throwaway init must not move the RNG
        model = hf_model_class(cfg)(cfg)
    missing, unexpected = model.load_state_dict(hf_state_dict, strict=False)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise KeyError(f"HF model load: missing {missing}, unexpected {unexpected}")
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def load_stage_weights(model, stage_sd: Dict[str, torch.Tensor]) -> None:
    """Copy ``stage_sd`` into a megatron stage, with strict key and shape checking.

    Expected keys are the model's state-dict entries minus non-parameter
    ``*._extra_state``.  Raises KeyError naming every missing / unexpected key and
    ValueError for shape mismatches; nothing is copied unless everything matches.
    """
    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "decoder"):
        inner = inner.module
    target = {k: v for k, v in inner.state_dict(keep_vars=True).items() if not is_ignored_key(k)}
    given = {k: v for k, v in stage_sd.items() if not is_ignored_key(k)}
    missing = sorted(set(target) - set(given))
    unexpected = sorted(set(given) - set(target))
    if missing or unexpected:
        raise KeyError(
            f"load_stage_weights: missing keys {missing}; unexpected keys {unexpected}"
        )
    bad = [
        f"{k}: model {tuple(target[k].shape)} vs given {tuple(given[k].shape)}"
        for k in target
        if tuple(target[k].shape) != tuple(given[k].shape)
    ]
    if bad:
        raise ValueError("load_stage_weights: shape mismatch: " + "; ".join(bad))
    with torch.no_grad():
        for k, dst in target.items():
            dst.copy_(given[k].to(dtype=dst.dtype, device=dst.device))
