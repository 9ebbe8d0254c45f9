"""The training data of a run: ``--train-data`` resolved, loaded, split and length-filtered.

The trainer's driver calls :func:`load_train_split` and :func:`select_prompts`; the
start-up checks (``megatron_cegrpo.train.preflight``, on every rank before any process
group exists) call :func:`check_train_data` and :func:`check_eval_data`, so a missing
file, a bad row, a hold-out that leaves nothing to train on, or prompts that never fit
stop the launch at once with one line naming the flag and the fix
(:class:`~megatron_cegrpo.errors.ConfigError`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from megatron_cegrpo.data.datasets import (
    DATA_ROOT_ENV,
    DATASETS,
    PromptRecord,
    available_datasets,
    dataset_file,
    dataset_path,
    load_prompts,
    resolve_data_root,
    split_holdout,
)
from megatron_cegrpo.errors import ConfigError, one_line

__all__ = [
    "TrainSplit",
    "check_eval_data",
    "check_train_data",
    "load_train_split",
    "question_key",
    "resolve_train_data",
    "select_prompts",
]


@dataclass
class TrainSplit:
    """``--train-data`` loaded: the file, the training rows and the held-out rows."""

    path: str
    train: List[PromptRecord]
    holdout: List[PromptRecord]
    #: training rows dropped because their question is also a held-out row's (a file's duplicates)
    duplicates_dropped: int = 0


def question_key(question: str) -> str:
    """The identity of a question for the held-out split: lower case, whitespace collapsed."""
    return " ".join(question.lower().split())


def _root_hint(data_root: Optional[str]) -> str:
    return f"the data root is {resolve_data_root(data_root)} (--data-root, or ${DATA_ROOT_ENV})"


def resolve_train_data(spec: str, data_root: Optional[str] = None) -> str:
    """The absolute path of the JSONL file ``--train-data spec`` names.

    ``spec`` is an existing file, or a short name from :data:`DATASETS` resolved under
    ``data_root`` (default: ``$CEGRPO_DATA_ROOT`` or ``../shared/data``).

    Raises:
        ConfigError: a directory; a path that does not exist (names the path); a name
            that is neither a file nor a known short name (lists the names); a short name
            whose file is missing under the data root (names the root).
    """
    names = ", ".join(available_datasets())
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isfile(path):
        return path
    if os.path.isdir(path) and spec not in DATASETS:
        raise ConfigError(f"--train-data {spec}: is a directory, not a .jsonl file; fix: pass one file inside it "
                          f"(e.g. {os.path.join(spec, 'train.jsonl')}) or a short name ({names})")
    if spec in DATASETS:
        try:
            return dataset_path(spec, root=data_root)
        except FileNotFoundError:
            where = dataset_file(spec, root=data_root)
            raise ConfigError(f"--train-data {spec}: the data set file {where} does not exist; "
                              f"{_root_hint(data_root)}; fix: point --data-root at the folder holding "
                              "gsm8k/, mawps/, ...") from None
    looks_like_path = spec.endswith((".jsonl", ".json")) or os.path.isabs(spec) or spec.startswith((".", "~"))
    if looks_like_path:
        raise ConfigError(f"--train-data {spec}: no such file ({path}); fix: check the path, or pass a short "
                          f"name ({names})")
    raise ConfigError(f"--train-data {spec!r} is neither an existing file nor a known data set name; fix: pass "
                      f"a .jsonl path or one of {names}")


def load_train_split(spec: str, *, format: Optional[str] = None, num_holdout: int = 0, seed: int = 0,
                     data_root: Optional[str] = None) -> TrainSplit:
    """Resolve ``--train-data``, load every row and hold ``--num-holdout`` rows out.

    The split is :func:`~megatron_cegrpo.data.split_holdout` (``random.Random(seed)``); then
    every training row whose question (:func:`question_key`) is also a held-out row's is
    dropped (MAWPS files repeat some questions), so the held-out rows are unseen in training.

    Raises:
        ConfigError: the file cannot be resolved (:func:`resolve_train_data`), a row is
            malformed (:class:`~megatron_cegrpo.data.DatasetError`, file + line + field),
            ``--train-data-format`` is unknown, or ``num_holdout`` leaves no training row
            (also after dropping the held-out questions' duplicates).
    """
    path = resolve_train_data(spec, data_root)
    try:
        records = load_prompts(path, format=format)
    except ConfigError:
        raise
    except ValueError as e:  # an unknown format name
        raise ConfigError(f"--train-data-format {format!r}: {one_line(e)}; fix: drop --train-data-format "
                          "to detect the format from the fields") from None
    n = len(records)
    if num_holdout >= n:
        raise ConfigError(f"--num-holdout {num_holdout} leaves no training prompt: {path} has {n} rows; "
                          f"fix: pass --num-holdout {max(n - 1, 0)} or less")
    train, holdout = split_holdout(records, num_holdout, seed)
    held = {question_key(r.question) for r in holdout}
    unseen = [r for r in train if question_key(r.question) not in held]
    if not unseen:
        raise ConfigError(f"--num-holdout {num_holdout} leaves no training prompt: every training row of {path} "
                          f"repeats a held-out question; fix: pass a smaller --num-holdout")
    return TrainSplit(path, unseen, holdout, len(train) - len(unseen))


def select_prompts(records: Sequence[PromptRecord], encode: Callable[[str], Sequence[int]],
                   max_prompt_length: int, *, source: str = "--train-data",
                   stop_after: Optional[int] = None) -> Tuple[List[PromptRecord], list, int]:
    """Keep the records whose encoded prompt has at most ``max_prompt_length`` tokens.

    ``encode(question)`` returns the prompt's token ids (template applied). ``stop_after``
    stops once that many prompts fit (the start-up check needs one).

    Returns:
        ``(kept records, their token ids as returned by encode, number skipped as too long)``.
    Raises:
        ConfigError: no prompt fits; names ``--max-prompt-length`` and the shortest prompt.
    """
    kept, ids, too_long, shortest = [], [], 0, None
    for r in records:
        x = encode(r.question)
        n = len(x)
        if n > max_prompt_length:
            too_long += 1
            shortest = n if shortest is None else min(shortest, n)
            continue
        kept.append(r)
        ids.append(x)
        if stop_after is not None and len(kept) >= stop_after:
            break
    if not kept:
        raise ConfigError(f"{source}: every one of the {len(records)} training prompts is longer than "
                          f"--max-prompt-length={max_prompt_length} tokens (the shortest has {shortest}); "
                          f"fix: pass --max-prompt-length {shortest} or more")
    return kept, ids, too_long


def check_train_data(spec: str, *, format: Optional[str] = None, num_holdout: int = 0, seed: int = 0,
                     data_root: Optional[str] = None, encode: Optional[Callable[[str], Sequence[int]]] = None,
                     max_prompt_length: Optional[int] = None) -> TrainSplit:
    """The start-up check of the training data: :func:`load_train_split`, then (given
    ``encode``) that at least one training prompt fits ``max_prompt_length``. Returns the
    split. Raises ConfigError as those two do."""
    split = load_train_split(spec, format=format, num_holdout=num_holdout, seed=seed, data_root=data_root)
    if encode is not None and max_prompt_length is not None:
        select_prompts(split.train, encode, max_prompt_length, source=f"--train-data {spec}", stop_after=1)
    return split


def check_eval_data(names: Sequence[str], data_root: Optional[str] = None) -> None:
    """Every ``--eval-datasets`` name has its file under the data root.

    Raises:
        ConfigError: names the data set, the missing file and the data root.
    """
    for name in names:
        try:
            dataset_path(name, root=data_root)
        except FileNotFoundError:
            where = dataset_file(name, root=data_root)
            raise ConfigError(f"--eval-datasets: the file of {name!r} ({where}) does not exist; "
                              f"{_root_hint(data_root)}; fix: point --data-root at the folder holding "
                              f"gsm8k/, mawps/, ... or drop {name} from --eval-datasets") from None
