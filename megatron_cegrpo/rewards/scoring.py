"""Scoring a rollout batch: call the reward for every (record, response) pair
and check every value before it can reach advantages and weights.

A reward that returns ``None``, a string, NaN or +-inf, or that raises, stops
training with one line that names the reward function, the row, the value and
the fix, instead of a NaN loss several steps later.
"""

from __future__ import annotations

import decimal
import math
import numbers
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from megatron_cegrpo.errors import ConfigError

__all__ = ["RewardError", "score_responses"]

#: Largest finite float32; a reward beyond it would become inf in the score tensor.
_FP32_MAX = float(torch.finfo(torch.float32).max)


class RewardError(ConfigError):
    """A reward function cannot be loaded, raised while scoring, or returned a
    value that is not a finite number.  The message is one line naming the
    function, the row and the fix.  A ConfigError (so a ValueError): the entry
    point prints it as one line and exits with status 2, at start-up (loading)
    or during training (scoring)."""


def _one_line(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _row(i: int, record: Any) -> str:
    question = _one_line(getattr(record, "question", ""), 60)
    return f"row {i} of the batch (question {question!r})"


def _as_score(value: Any) -> Tuple[Optional[float], str]:
    """(the value as a float, "") or (None, what is wrong with it).

    Accepts bool (0/1), int, float, Fraction, Decimal, numpy scalars and
    one-element torch/numpy tensors; rejects None, strings, containers,
    complex numbers, NaN and +-inf."""
    if value is None:
        return None, "no value"
    if not isinstance(value, (numbers.Number, decimal.Decimal)) and callable(getattr(value, "item", None)):
        size = value.numel() if isinstance(value, torch.Tensor) else getattr(value, "size", None)
        if size != 1:
            return None, f"a {type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}, not one number"
        value = value.item()
    if isinstance(value, bool):
        return float(value), ""
    if not isinstance(value, (numbers.Real, decimal.Decimal)):
        return None, f"a {type(value).__name__}, not a real number"
    try:
        f = float(value)
    except OverflowError:
        return None, "too large for a float"
    except ValueError:  # Decimal('sNaN')
        return None, "NaN"
    if math.isnan(f):
        return None, "NaN"
    if math.isinf(f):
        return None, "infinite"
    if abs(f) > _FP32_MAX:
        return None, f"beyond the float32 range of +-{_FP32_MAX:.3g}"
    return f, ""


def score_responses(
    get_reward_fn: Callable[[str], Callable[[str, str], Any]],
    fn_name: Optional[str],
    records: Sequence[Any],
    texts: Sequence[str],
) -> torch.Tensor:
    """Reward of every response, checked: ``score[i] = reward(texts[i], records[i].ground_truth)``.

    Args:
        get_reward_fn: maps a record's ``verifier`` name to its reward function
            ``(response: str, ground_truth: str) -> number``: ``get_verifier``
            for the data set's verifiers, or ``lambda _name: fn`` for one
            ``--custom-reward-function`` (the trainer's ``self.get_reward_fn``).
            Called once per distinct verifier name in the batch.
        fn_name: how errors name the reward function, e.g. the
            ``--custom-reward-function`` spec ``"my_rewards.py:score"``; ``None``
            names each row's verifier (``verifier 'numeric'``).
        records: b prompt records (:class:`~megatron_cegrpo.data.PromptRecord`
            or anything with ``.question``, ``.ground_truth``, ``.verifier``),
            one per response.
        texts: b response texts, aligned with ``records``.
    Returns:
        float32 tensor [b] (CPU). ``bool`` rewards count as 0.0 / 1.0; ints,
        floats, Fractions, Decimals, numpy scalars and one-element tensors are
        converted with ``float``.
    Raises:
        ValueError: ``records`` and ``texts`` differ in length.
        RewardError (a ValueError): for the first bad row, in one line naming
            the reward function, the row (its index in the batch and its
            question, cut to 60 characters), the value and the fix, when the
            reward function cannot be resolved, raises (the original exception
            is chained as ``__cause__``), or returns None, a non-number (str,
            list, complex, a tensor of several elements), NaN, +-inf or a value
            beyond the float32 range.
    """
    records, texts = list(records), list(texts)
    if len(records) != len(texts):
        raise ValueError(
            f"score_responses: {len(records)} records but {len(texts)} response texts; "
            "pass one response text per record"
        )
    resolved = {}
    scores = []
    for i, (record, text) in enumerate(zip(records, texts)):
        verifier = getattr(record, "verifier", None)
        name = f"reward function {fn_name!r}" if fn_name else f"verifier {verifier!r}"
        if verifier not in resolved:
            try:
                resolved[verifier] = get_reward_fn(verifier)
            except Exception as e:
                raise RewardError(
                    f"{name} cannot be resolved for {_row(i, record)}: {_one_line(e, 200)}; "
                    "set the record's verifier to a registered one or pass --custom-reward-function"
                ) from e
        try:
            value = resolved[verifier](text, record.ground_truth)
        except Exception as e:
            raise RewardError(
                f"{name} raised {type(e).__name__}: {_one_line(e, 200)} on {_row(i, record)}; "
                "fix the reward function or this row's ground truth (a reward must return a "
                "number for every response, e.g. 0.0 for one it cannot score)"
            ) from e
        score, problem = _as_score(value)
        if score is None:
            raise RewardError(
                f"{name} returned {_one_line(repr(value), 60)} ({problem}) for {_row(i, record)}; "
                "return a finite float for every response (e.g. 0.0 for a wrong or unscorable answer)"
            )
        scores.append(score)
    return torch.tensor(scores, dtype=torch.float32)
