"""Process start-up shared by every entry point: :func:`bootstrap`, called first.

Entry points (``megatron_cegrpo/train.py``, ``tools/*.py``, ``tools/checkpoint/convert.py``,
``benchmarks/*``) call ``bootstrap()`` first in their ``main`` (right after parsing the flags
when it needs ``--threads``; argparse imports nothing). They import megatron-core, and modules
that import it at import time (``megatron_cegrpo.pipeline``, ``benchmarks.link_model``), only
after that call, because megatron-core emits the warnings below while it is being imported;
everything else (``megatron_cegrpo.models`` imports megatron-core lazily) at module top. No entry point edits ``sys.path``:
the package is installed (``pip install -e .``), ``benchmarks`` runs as ``python -m
benchmarks.<name>`` from the repository root, and ``megatron_cegrpo/train.py`` can run as a
script because no module of this package has the name of a standard-library or installed
top-level module (``tests/test_bootstrap.py`` checks that).

What it does, in this order (each step idempotent, so a second call is harmless):

1. warning filters for :data:`KNOWN_WARNINGS` (one list, here only);
2. the CPU compatibility layer (:func:`megatron_cegrpo.compat.apply_cpu_compat`), only when
   ``cpu_compat=True``: the processes that run megatron-core models (a training rank, a
   benchmark rank) ask for it; ``initialize_distributed`` and ``init_single_process_megatron``
   apply it again (idempotent) for library use. It is not applied by default: it patches torch
   process-wide (``torch.tensor`` and friends), which the tools that only run HF models
   (``tools/evaluate.py``, ``convert.py``) do not need (it once broke ``from_pretrained``'s rotary
   buffers; ``compat/cpu.py`` says how and why no longer). With CUDA it is a no-op;
3. ``torch.set_num_threads(num_threads)`` when ``num_threads`` is given.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

__all__ = ["KNOWN_WARNINGS", "bootstrap", "quiet_known_warnings"]

#: (message regex, category, why it is harmless). Matched against the start of the message.
KNOWN_WARNINGS: Tuple[Tuple[str, type, str], ...] = (
    (r"Transformer Engine and Apex are not installed", UserWarning,
     "megatron-core, at import (optimizer, clip_grads, fsdp mixed precision): the fused CUDA "
     "kernels are absent, so it uses its pure-torch multi_tensor_* and torch optimizers; "
     "always true on CPU, and this project uses DeepSpeed's / torch's optimizers anyway"),
    (r"Apex is not installed", UserWarning,
     "megatron-core falls back to torch's LayerNorm / RMSNorm; the local layer spec this "
     "project builds uses those on every machine"),
    (r"When using async grad allreduce it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning,
     "megatron-core's tensor-parallel linear layers at --tensor-model-parallel-size > 1: the variable "
     "orders CUDA streams so that the backward all-reduce overlaps the weight-gradient GEMM; on CPU "
     "(gloo) there are no streams, and on GPU it only affects overlap, not results"),
    (r"`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning,
     "torch 2.13 on megatron-core 0.16.1's tensor-parallel all-gather (the last stage's logits at "
     "--tensor-model-parallel-size > 1): the call works (gloo and NCCL); megatron-core has not moved "
     "to all_gather_single yet"),
    (r"full scope is deprecated", UserWarning,
     "TransformerConfig.__post_init__ with its default cuda_graph_scope='full': CUDA graphs "
     "are never enabled here (no cuda_graph_impl), so the scope is never used"),
)


def quiet_known_warnings() -> None:
    """Install an ``ignore`` filter for each of :data:`KNOWN_WARNINGS` (once per process)."""
    for message, category, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def bootstrap(num_threads: Optional[int] = None, *, cpu_compat: bool = False) -> None:
    """Prepare this process for the project's code: call it first in every entry point.

    Args:
        num_threads: ``torch.set_num_threads`` value; ``None`` or 0 leaves torch's default.
        cpu_compat: apply the CPU compatibility layer (no-op with CUDA): for processes that
            run megatron-core models; see the module docstring for why it is not the default.
    """
    quiet_known_warnings()
    if cpu_compat:
        from megatron_cegrpo.compat import apply_cpu_compat  # imports torch and megatron-core

        apply_cpu_compat()
    if num_threads:
        import torch

        torch.set_num_threads(int(num_threads))
