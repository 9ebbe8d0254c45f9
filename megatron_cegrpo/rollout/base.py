"""The rollout engine interface: a dense sampler that generates responses and takes new weights.

DESIGN.md section 1: the rollout engine is colocated with trainer rank 0 (the
driver); HF transformers (``--rollout-engine hf``, ``hf_engine.py``) or vLLM in the driver's
process (``--rollout-engine vllm``, ``vllm_engine.py``; ``docs/vllm.md``). It always runs the
dense model: compression is applied to the trainer only (status 2026-07-31 section 3).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

__all__ = ["RolloutOutput", "RolloutEngine", "register_rollout_engine", "get_rollout_engine"]


@dataclass
class RolloutOutput:
    """Responses for a list of prompts.

    Attributes:
        prompt_ids: list of N LongTensor [P_i] (unpadded prompt token ids).
        response_ids: list of N LongTensor [R_i] (response tokens, up to and
            including EOS when one was generated; R_i >= 1).
        response_logprobs: list of N fp32 Tensor [R_i]: the sampler's log-prob
            (nats) of each response token at the sampling temperature.
        texts: list of N decoded responses (special tokens skipped).
        finished: BoolTensor [N]: True when the response ended with EOS.
    """

    prompt_ids: List[torch.Tensor]
    response_ids: List[torch.Tensor]
    response_logprobs: List[torch.Tensor]
    texts: List[str]
    finished: torch.Tensor


class RolloutEngine(abc.ABC):
    """Dense sampler: ``generate`` responses, ``update_weights`` after each optimizer step."""

    @abc.abstractmethod
    def generate(
        self,
        prompt_ids: List[torch.Tensor],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        greedy: bool = False,
        generator_seed: Optional[int] = None,
        return_logprobs: bool = True,
    ) -> RolloutOutput:
        """One response per prompt. ``return_logprobs=False`` (evaluation: scoring needs only the
        text) lets the engine skip the sampled tokens' log-probs; ``RolloutOutput.logprobs`` then
        holds empty tensors or whatever the engine computed anyway."""
        ...

    @abc.abstractmethod
    def update_weights(self, hf_state_dict: Dict[str, torch.Tensor]) -> None:
        """Load a full HF-named state dict (the trainer's current weights)."""

    def close(self) -> None:
        """Release what the engine holds beyond its Python objects (worker processes, device
        memory). The in-process HF engine holds nothing more: a no-op."""


_ENGINES = {}


def register_rollout_engine(name: str):
    def deco(cls):
        _ENGINES[name] = cls
        return cls

    return deco


def get_rollout_engine(name: str, **kwargs) -> RolloutEngine:
    """Build a registered engine. Raises ValueError listing the valid names."""
    if name == "hf":
        from megatron_cegrpo.rollout import hf_engine  # noqa: F401  (registers itself)
    if name == "vllm":
        from megatron_cegrpo.rollout import vllm_engine  # noqa: F401  (registers itself; vllm imported when built)
    if name not in _ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; valid: {sorted(_ENGINES)}")
    return _ENGINES[name](**kwargs)
