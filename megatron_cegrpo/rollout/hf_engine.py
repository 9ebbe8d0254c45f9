"""HF transformers sampler (CPU default): dense generation with the trainer's synced weights."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from megatron_cegrpo.compat.placement import compute_device
from megatron_cegrpo.rollout.base import RolloutEngine, RolloutOutput, register_rollout_engine

__all__ = ["HFRolloutEngine"]


@register_rollout_engine("hf")
class HFRolloutEngine(RolloutEngine):
    """Generate with ``transformers``' ``generate`` on a dense HF causal LM.

    Args:
        hf_config: a transformers ``PretrainedConfig`` (llama or qwen2).
        hf_state_dict: weights with HF names (what ``update_weights`` takes too), any float dtype:
            copied into the model's dtype (round-to-nearest-even for bf16).
        tokenizer: the model's tokenizer (decodes responses; gives pad/eos ids).
        eos_token_ids: token ids that end a response (default: the tokenizer's eos).
        dtype: ``fp32`` or ``bf16`` (``--rollout-dtype``): the values the sampler's weights hold
            (bf16: every weight rounded to bf16, round-to-nearest-even, as the bf16 delta sync
            delivers them).
        compute_dtype: ``fp32`` or ``bf16`` (``--rollout-compute-dtype``; None: ``dtype``): the
            dtype the model is stored and run in. bf16 is what a GPU rollout engine does; fp32 with
            ``dtype="bf16"`` holds the same bf16 values exactly (every bf16 number is an fp32
            number) and runs at fp32 speed on a CPU without native bf16 matmuls
            (``compat/precision.py``). Logits are upcast to fp32 for the log-probs either way.
        device: where the model runs (default ``compat.placement.compute_device()``: this rank's GPU
            where CUDA is available). Prompts go there; the returned tensors are on the CPU.

    Raises:
        ValueError: ``dtype="fp32"`` with ``compute_dtype="bf16"`` (the weights would be rounded
            after all; pass ``--rollout-dtype bf16``).
    """

    DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def __init__(self, hf_config, hf_state_dict: Dict[str, torch.Tensor], tokenizer,
                 eos_token_ids: Optional[Sequence[int]] = None, dtype: str = "fp32",
                 compute_dtype: Optional[str] = None, device: Optional[torch.device] = None):
        from transformers import AutoModelForCausalLM

        compute_dtype = compute_dtype or dtype
        if dtype == "fp32" and compute_dtype == "bf16":
            raise ValueError("--rollout-compute-dtype bf16 needs --rollout-dtype bf16 (the weights are rounded "
                             "to bf16 to compute in it); fix: pass --rollout-dtype bf16")
        self.tokenizer = tokenizer
        self.weight_dtype = self.DTYPES[dtype]
        # the compute device (compat/placement.py): the GPU of this rank where CUDA is available
        self.device = compute_device() if device is None else torch.device(device)
        self.model = AutoModelForCausalLM.from_config(hf_config, dtype=self.DTYPES[compute_dtype]).to(self.device)
        self.model.eval()
        self.update_weights(hf_state_dict)
        eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
        self.eos_token_ids = [int(e) for e in eos if e is not None]
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]

    @torch.no_grad()
    def update_weights(self, hf_state_dict: Dict[str, torch.Tensor]) -> None:
        """Copy weights in place, rounded to the ``dtype`` the sampler holds (then stored in the
        compute dtype, exactly). Raises KeyError naming missing/unexpected keys."""
        own = self.model.state_dict()  # on self.device: copy_ moves each weight there
        missing = [k for k in own if k not in hf_state_dict and not _is_tied_alias(self.model, k)]
        unexpected = [k for k in hf_state_dict if k not in own]
        if missing or unexpected:
            raise KeyError(f"rollout weight sync: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for k, v in hf_state_dict.items():
            own[k].copy_(v.to(self.weight_dtype) if v.is_floating_point() else v)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()

    @torch.no_grad()
    def generate(self, prompt_ids: List[torch.Tensor], *, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, greedy: bool = False, generator_seed: Optional[int] = None,
                 batch_size: Optional[int] = None, return_logprobs: bool = True) -> RolloutOutput:
        """Sample one response per prompt (pass each prompt G times for a group).

        Prompts are left-padded into one batch (``batch_size`` rows at a time).
        Sampling is reproducible: the global torch RNG is forked and seeded with
        ``generator_seed`` for the call, so a resumed run draws the same tokens.

        Returns:
            RolloutOutput; ``response_logprobs`` are log softmax(logits / T) of
            the drawn tokens (T = 1 when greedy), or empty tensors when
            ``return_logprobs`` is False (evaluation: no per-step vocabulary scores are kept).
        """
        n = len(prompt_ids)
        bs = batch_size or n
        out = RolloutOutput([], [], [], [], torch.zeros(n, dtype=torch.bool))
        # the device's generator draws the tokens: fork (and so restore) it too on a GPU
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if generator_seed is not None:
                torch.manual_seed(generator_seed)
            for start in range(0, n, bs):
                chunk = prompt_ids[start:start + bs]
                self._generate_chunk(chunk, out, start, max_new_tokens, temperature, top_p, greedy,
                                     return_logprobs)
        return out

    def _generate_chunk(self, chunk, out, offset, max_new_tokens, temperature, top_p, greedy, return_logprobs):
        plen = max(int(p.numel()) for p in chunk)
        ids = torch.full((len(chunk), plen), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), plen), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, plen - p.numel():] = p
            attn[i, plen - p.numel():] = 1
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=self.eos_token_ids,
                      pad_token_id=self.pad_token_id, return_dict_in_generate=True,
                      output_logits=return_logprobs)
        if greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), **kwargs)
        drawn = gen.sequences[:, plen:]
        resp = drawn.cpu()  # the rollout's tensors stay on the CPU (RolloutOutput)
        if return_logprobs:
            # one step at a time: gen.logits is T raw (unprocessed) [n, V] tensors; stacking them
            # and a log-softmax copy would hold 2 more [n, T, V] buffers at the peak
            temp = 1.0 if greedy else float(temperature)
            logp = torch.stack([torch.log_softmax(step.float() / temp, dim=-1).gather(-1, drawn[:, i:i + 1]).squeeze(-1)
                                for i, step in enumerate(gen.logits)], dim=1).cpu()
            del gen
        else:
            logp = torch.zeros(resp.shape, dtype=torch.float32)
        eos = torch.zeros_like(resp, dtype=torch.bool)
        for e in self.eos_token_ids:
            eos |= resp == e
        for i, p in enumerate(chunk):
            hits = eos[i].nonzero()
            finished = hits.numel() > 0
            length = int(hits[0]) + 1 if finished else resp.shape[1]
            r = resp[i, :length].clone()
            out.prompt_ids.append(p.clone())
            out.response_ids.append(r)
            out.response_logprobs.append(logp[i, :length].clone() if return_logprobs else torch.zeros(0))
            out.texts.append(self.tokenizer.decode(r, skip_special_tokens=True))
            out.finished[offset + i] = finished


def _is_tied_alias(model, key: str) -> bool:
    return key == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)
