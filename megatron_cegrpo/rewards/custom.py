"""User reward functions loaded from a file (verl's ``custom_reward_function.path/name``).

``--custom-reward-function path/to/file.py:name`` replaces the data set's verifier with
``name(response: str, ground_truth: str) -> float`` defined in that file.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

__all__ = ["load_custom_reward_function"]


def load_custom_reward_function(spec: str) -> Callable[[str, str], float]:
    """Load ``FILE.py:FUNCTION``.

    Raises:
        ValueError: malformed spec, missing file, or a missing / non-callable attribute.
    """
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"--custom-reward-function must be FILE.py:FUNCTION, got {spec!r}")
    if not os.path.isfile(path):
        raise ValueError(f"--custom-reward-function: no such file {path!r}")
    mod_spec = importlib.util.spec_from_file_location(f"cegrpo_custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--custom-reward-function: {path!r} has no callable {name!r}")
    return fn
