"""Capture and restore every RNG a run draws from, as checkpoint-safe plain objects.

python ``random``, numpy's global generator, torch's CPU generator (and CUDA's when
present) and megatron-core's model-parallel RNG tracker. The result holds only
tensors, ints, strings, tuples and lists, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> Dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
