"""User reward functions loaded from a file (verl's ``custom_reward_function.path/name``).

``--custom-reward-function path/to/file.py:name`` replaces the data set's verifier with
``name(response: str, ground_truth: str) -> float`` defined in that file.  Score a
batch with it through :func:`megatron_cegrpo.rewards.score_responses`, which checks
every value it returns.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Callable

from megatron_cegrpo.rewards.scoring import RewardError

__all__ = ["load_custom_reward_function"]

_FLAG = "--custom-reward-function"


def load_custom_reward_function(spec: str) -> Callable[[str, str], float]:
    """Load ``FILE.py:FUNCTION`` and return the function.

    The file is imported as a fresh module (its top-level code runs once).
    The spec is split at its last ':', so ``FILE`` may itself contain colons.

    Raises:
        RewardError (a ValueError), with one line naming ``--custom-reward-function``
        and the fix, when: the spec is not ``FILE.py:FUNCTION``; the file does not
        exist or is not a ``.py`` file; importing it fails (the import error is
        chained as ``__cause__``); it defines no ``FUNCTION``; ``FUNCTION`` is not
        callable; or it cannot be called as ``FUNCTION(response, ground_truth)``.
    """
    spec = str(spec).strip()
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.strip():
        raise RewardError(
            f"{_FLAG} must be FILE.py:FUNCTION (e.g. my_rewards.py:score), got {spec!r}; "
            "name the file and, after a colon, the function in it"
        )
    path, name = path.strip(), name.strip()
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise RewardError(
            f"{_FLAG} {spec!r}: {path!r} {what} (working directory {os.getcwd()!r}); "
            "give the path of a .py file"
        )
    if not path.endswith(".py"):
        raise RewardError(f"{_FLAG} {spec!r}: {path!r} is not a Python file; give a .py file")
    mod_spec = importlib.util.spec_from_file_location(f"cegrpo_custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        detail = " ".join(f"{type(e).__name__}: {e}".split())
        raise RewardError(f"{_FLAG} {spec!r}: importing {path!r} failed with {detail}; fix the file") from e
    if not hasattr(module, name):
        defined = sorted(
            k for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise RewardError(
            f"{_FLAG} {spec!r}: {path!r} defines no {name!r} "
            f"(functions defined there: {', '.join(defined) or 'none'}); name one of them after the colon"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(
            f"{_FLAG} {spec!r}: {name!r} is an object of type {type(fn).__name__}, not a function; "
            f"name a function (response, ground_truth) -> float"
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: accept them
        return fn
    try:
        sig.bind("response", "ground_truth")
    except TypeError:
        raise RewardError(
            f"{_FLAG} {spec!r}: {name}{sig} cannot be called as {name}(response, ground_truth); "
            "give it two positional parameters"
        ) from None
    return fn
