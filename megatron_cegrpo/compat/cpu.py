"""CPU compatibility layer for megatron-core 0.16.1.

megatron-core assumes a CUDA device: it allocates tensors with ``device="cuda"`` or
``device=torch.cuda.current_device()``, calls ``torch.cuda.synchronize()`` after batched
p2p ops, and keeps its dropout/initialisation RNG streams (``CudaRNGStatesTracker``) as
CUDA generator states.  On a CPU-only torch build every one of those calls raises
``AssertionError: Torch not compiled with CUDA enabled`` (or, for the lazily queued RNG
setters, silently queues a callback that never runs).

:func:`apply_cpu_compat` installs the smallest set of patches under which megatron-core's
model code (GPTModel with the local spec), its parallel state and its
``P2PCommunicator``-based 1F1B schedule run on CPU with the gloo backend.  "The device"
becomes the CPU and "the device RNG" becomes the CPU default generator (the one every CPU
random op draws from, exactly as CUDA ops draw from the CUDA default generator).

The layer is a no-op (returns ``False``) when ``torch.cuda.is_available()``; it never
changes behaviour on a machine with a GPU.  It is idempotent.

A side effect found and removed (2026-12-04, transformers 5.24): when the layer was installed
before torch first used a device context, ``AutoModelForCausalLM.from_pretrained`` left the rotary
embedding's non-persistent ``inv_freq`` buffers uninitialised (garbage values, logits off by ~1 %
on tiny-llama, NaN on SmolLM2): torch caches the set of factory functions a ``with
torch.device(...)`` context redirects on first use, and a set built after patch 3 held the
wrappers, not the ``torch.tensor`` they call. :func:`apply_cpu_compat` now builds that set before it
patches (``tests/compat/test_cpu_compat.py`` loads a model with from_pretrained in a process whose
first act is to install the layer). ``tests/conftest.py`` still stops a test session whose
collection installed the layer (the rest of a session should not run with megatron's CUDA calls
patched because of an import).

Patch list (each: what megatron calls -> why it fails on CPU -> what it now does)
-------------------------------------------------------------------------------
1. ``torch.cuda.current_device()``
   Called for ``device=`` arguments and ``.to(...)`` targets: p2p_communication
   (shape / receive buffers), ``GlobalMemoryBuffer.get_tensor`` (attention score buffer),
   ``RotaryEmbedding.get_emb`` (``inv_freq.to(torch.cuda.current_device())`` on every
   forward), tensor_parallel layers (weight allocation when
   ``use_cpu_initialization=False``).  Raises on CPU.
   -> returns ``torch.device("cpu")`` so every such call allocates / moves to CPU.
2. ``torch.cuda.synchronize()``
   Called by ``p2p_communication`` after ``batch_isend_irecv``.  Raises on CPU.
   -> no-op (gloo ops are complete once ``wait()`` returns).
3. ``torch.zeros`` / ``torch.ones`` / ``torch.tensor`` with ``device="cuda"``
   Literal ``device="cuda"`` allocations: ``torch.zeros`` in schedules
   (``total_num_tokens``) and clip_grads, ``torch.ones`` in
   ``transformer.utils.get_default_causal_mask`` (the causal mask of the local spec's
   ``DotProductAttention`` when ``attention_mask`` is None), ``torch.tensor`` in the
   optimizer (``found_inf``), clip_grads and ``tensor_parallel.broadcast_data``.
   -> thin wrappers that rewrite a CUDA ``device`` argument (``"cuda"``, ``"cuda:N"``,
   ``torch.device("cuda")`` or an int ordinal) to ``"cpu"`` and otherwise call through
   unchanged.  They are registered as TorchScript builtins for ``aten::zeros`` etc. so
   ``torch.jit.script`` code that calls them still compiles (to the unpatched op).
4. ``torch.Tensor.cuda``
   ``LanguageModule.setup_embeddings_and_output_layer`` runs
   ``weight.data = weight.data.cuda()`` before all-reducing the tied embedding over the
   embedding group (pp > 1, ``share_embeddings_and_output_weights``); also
   ``tensor_parallel.broadcast_data``.  Raises on CPU.
   -> returns the tensor itself (it already lives on "the device").
5. CUDA RNG: ``torch.cuda.manual_seed``, ``torch.cuda.get_rng_state`` and megatron's
   ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
   ``model_parallel_cuda_manual_seed`` and ``CudaRNGStatesTracker.add`` / ``.fork``
   (used around dropout and GPU-side weight init) read, seed and swap CUDA generator
   states.  ``get_rng_state`` raises on CPU; ``manual_seed`` and ``_set_cuda_rng_state``
   go through ``torch.cuda._lazy_call`` and would queue callbacks forever (never applied,
   growing without bound).
   -> all four act on the CPU default generator (``torch.default_generator``), so
   ``fork()`` really switches the stream CPU random ops draw from and is deterministic
   for a given seed.  Side effect, as on GPU: ``model_parallel_cuda_manual_seed(seed)``
   reseeds the default stream.  Note: megatron's ``fork()`` logs
   "CPU RNG state changed within GPU RNG context" when random numbers are drawn inside
   the fork; on CPU that warning is expected (the CPU RNG *is* the device RNG) and only
   appears with dropout > 0 or GPU-style init inside ``fork()``.

Everything else (``torch.cuda.is_available()``, streams, autocast, nvtx) is left alone:
megatron's model / schedule paths used by this project do not reach them on CPU.
"""

from __future__ import annotations

import functools
import threading

import torch

__all__ = ["apply_cpu_compat", "is_active", "PATCHED"]

_lock = threading.Lock()
_active = False

#: Names of the patched callables (filled by :func:`apply_cpu_compat`), for logs/tests.
PATCHED: list[str] = []


def is_active() -> bool:
    """True once :func:`apply_cpu_compat` has installed the CPU patches in this process."""
    return _active


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    # On a CPU-only build a bare int ordinal can only mean a CUDA device.
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return False


def _redirect_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapper.__megatron_cegrpo_cpu_compat__ = fn  # the original, for introspection
    return wrapper


def _register_torchscript_builtin(fn, op: str) -> None:
    try:
        from torch.jit._builtins import _register_builtin

        _register_builtin(fn, op)
    except Exception:  # private API; losing it only affects torch.jit.script users
        pass


def _current_device():
    return torch.device("cpu")


def _synchronize(device=None):
    return None


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _cuda_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _cuda_get_rng_state(device="cuda"):
    return torch.default_generator.get_state()


def _megatron_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.default_generator.get_state()


def _megatron_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    torch.default_generator.set_state(new_state)


def apply_cpu_compat() -> bool:
    """Install the CPU patches listed in the module docstring.

    Returns True if the layer is (now) active, False if CUDA is available (nothing is
    patched then).  Safe to call any number of times, from any module.
    """
    global _active
    if torch.cuda.is_available():
        return False
    with _lock:
        if _active:
            return True

        # 1. + 2.
        torch.cuda.current_device = _current_device
        torch.cuda.synchronize = _synchronize
        PATCHED.extend(["torch.cuda.current_device", "torch.cuda.synchronize"])

        # 3. torch's device contexts (``with torch.device(...)``, which transformers' from_pretrained
        # uses) redirect a factory call by looking the called function up in a set of the factories
        # that is built once, on first use; built after the wrappers it would hold them instead of
        # the originals they call, and torch.tensor under such a context would no longer be
        # redirected (from_pretrained then left the rotary ``inv_freq`` buffer uninitialised).
        # Build it now, with the originals.
        from torch.utils import _device as torch_device_context

        torch_device_context._device_constructors()
        for name in ("zeros", "ones", "tensor"):
            wrapper = _redirect_device(getattr(torch, name))
            setattr(torch, name, wrapper)
            PATCHED.append(f"torch.{name}")
            # Keep TorchScript working: scripted code calling torch.<name> compiles to the
            # aten op (as before) instead of trying to compile the Python wrapper.
            _register_torchscript_builtin(wrapper, f"aten::{name}")

        # 4.
        torch.Tensor.cuda = _tensor_cuda
        PATCHED.append("torch.Tensor.cuda")

        # 5.
        torch.cuda.manual_seed = _cuda_manual_seed
        torch.cuda.get_rng_state = _cuda_get_rng_state
        from megatron.core.tensor_parallel import random as mcore_random

        mcore_random._get_cuda_rng_state = _megatron_get_cuda_rng_state
        mcore_random._set_cuda_rng_state = _megatron_set_cuda_rng_state
        PATCHED.extend(
            [
                "torch.cuda.manual_seed",
                "torch.cuda.get_rng_state",
                "megatron.core.tensor_parallel.random._get_cuda_rng_state",
                "megatron.core.tensor_parallel.random._set_cuda_rng_state",
            ]
        )
        _active = True
        return True
