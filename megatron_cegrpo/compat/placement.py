"""Where every tensor lives: the one place that decides the device of what meets a parameter or
crosses a process (issue 29 item 4).

Three rules, on CPU hosts and GPU hosts alike:

1. **Compute device** (:func:`compute_device`): the current CUDA device where CUDA is available
   (``initialize.py`` sets it to ``LOCAL_RANK``), else the CPU. The stage's parameters
   (``models/builder.py`` moves them there), its optimizer state, the HF sampler and every batch a
   stage trains on (:func:`place_batch`) live on it. The anchor's M stays on the CPU
   (``anchor/memory.py`` moves each gradient to it).
2. **Process groups carry two backends on GPU hosts** (:func:`process_group_backend`):
   ``"cpu:gloo,cuda:nccl"``, PyTorch's device-mapped backend, so that a collective routes by the
   tensor's device: the control plane (pickled batches, scalar flags, fp64 norms and metric sums,
   the anchor's byte frames), which this project keeps on the CPU, goes through gloo; the data plane
   (boundary activations and gradients in megatron-core's p2p, DP gradient all-reduces of CUDA
   gradients) goes through NCCL. Every ``dist.new_group`` without a backend inherits both. On CPU
   hosts it is plain gloo. No call site has to move a tensor for a collective, which is what makes
   the CUDA path correct by construction: a CPU tensor never reaches NCCL (which would raise "No
   backend type associated with device type cpu").
3. **Where a tensor meets another** (:func:`like`): a tensor received on the CPU (a sign(M) frame, a
   sampler weight) is moved to the device and dtype of the tensor it is combined with, at the point
   of use.

``tests/compat/test_placement.py`` checks the backend choice and rules 1 and 3 on CPU;
``tests/gpu/test_cuda_paths.py`` runs the CUDA side where a GPU is present (``tools/device_check.sh``;
what ran on an H200 and what has not: ``docs/gpu.md``). Rule 2 across ranks has not run on GPUs
(one was lent): it is PyTorch's own routing, used as documented.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

import torch

__all__ = ["compute_device", "process_group_backend", "place_batch", "like", "cuda_available", "usable_cores",
           "trainer_threads"]


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (``taskset``, a container's cpuset, a
    launcher's core binding) where the OS reports one, else ``os.cpu_count()``; at least 1. A cpuset
    of 2 on a 64-core host gives 2, not 64 threads that would share 2 cores. Used for the trainer
    ranks' threads (``initialize.py``: this count over the host's ranks) and the driver's
    generation and evaluation threads (``training/driver.py``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call (macOS, Windows)
        return os.cpu_count() or 1


def trainer_threads(local_world_size: int) -> int:
    """Threads of one trainer rank: the process's usable cores (:func:`usable_cores`) shared by the
    ``local_world_size`` ranks of its host (``LOCAL_WORLD_SIZE``), at least 1."""
    return max(1, usable_cores() // max(1, int(local_world_size)))


def cuda_available() -> bool:
    """Whether this process computes on a GPU (``torch.cuda.is_available()``; the CPU compat layer,
    ``compat/cpu.py``, applies exactly when this is False)."""
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device of this rank's parameters, optimizer state and batches.

    Returns:
        ``cuda:<torch.cuda.current_device()>`` where CUDA is available, else ``cpu``.
    """
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def process_group_backend() -> str:
    """The default process group's backend string (rule 2 of the module docstring).

    Returns:
        ``"cpu:gloo,cuda:nccl"`` where CUDA is available (CPU tensors through gloo, CUDA tensors
        through NCCL, per collective), else ``"gloo"``.
    """
    return "cpu:gloo,cuda:nccl" if cuda_available() else "gloo"


def place_batch(batch: Optional[Mapping[str, Any]], device: Optional[torch.device] = None) -> Optional[Dict[str, Any]]:
    """The batch a stage trains on, every tensor on the compute device (rule 1).

    Args:
        batch: the packed rollout batch (``grpo/batch.py``: ``tokens`` int64 [N, S], ``loss_mask``,
            ``advantages``, ``sampler_logprobs`` fp32 [N, S], ``sample_ids`` int64 [N], ...), as
            the driver packed it or a broadcast delivered it (CPU tensors), or None.
        device: default :func:`compute_device`.
    Returns:
        a new dict with the same keys: tensors moved (no copy when already there), other values as
        they are; None for None. The dtypes are kept: the batch's floats stay fp32 (advantages and
        log-probs enter the loss in fp32 under ``--bf16`` too).
    """
    if batch is None:
        return None
    device = compute_device() if device is None else torch.device(device)
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def like(t: torch.Tensor, ref: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t`` on ``ref``'s device, in ``dtype`` (default ``ref``'s) (rule 3): a sign tensor before it
    multiplies a gradient, a received weight before it is copied into a parameter.

    Args:
        t: any tensor.
        ref: the tensor ``t`` is combined with.
        dtype: the result's dtype; default ``ref.dtype``.
    Returns:
        ``t`` itself when nothing changes, else a converted copy.
    """
    return t.to(device=ref.device, dtype=ref.dtype if dtype is None else dtype)
