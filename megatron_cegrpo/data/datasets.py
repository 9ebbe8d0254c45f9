"""Prompt data sets: JSONL loaders for the math sets in ``shared/data``.

Each line of a data file is one JSON object.  :func:`load_prompts` turns it
into a :class:`PromptRecord` holding the question, the ground truth in the
form its verifier expects (see :mod:`megatron_cegrpo.rewards.verifiers`), the
verifier's name and the 1-based line number it came from.

Formats (detected from the fields of the first row, or named explicitly):

============== ============================================ ============== =========================
format         fields                                       verifier       ground truth
============== ============================================ ============== =========================
mawps          input, target (number)                       numeric        str(target)
gsm8k          question, answer ending in ``#### N``        gsm8k          N (commas removed)
olympiadbench  question, final_answer (list)                olympiad_list  json.dumps(final_answer)
competition    problem|question, answer (no ``####``)       boxed          answer (27.0 -> "27")
minerva        problem, solution with ``\\boxed{}``         boxed          last \\boxed{} of solution
============== ============================================ ============== =========================

Bad rows are never dropped: invalid JSON, a missing or empty field or a
ground truth the verifier cannot read raises :class:`DatasetError` naming the
file, the line and the field.  The data itself is not part of the repository;
:func:`default_data_root` finds it (``$CEGRPO_DATA_ROOT`` or
``<repo>/../shared/data``).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.rewards.verifiers import extract_boxed, get_verifier

__all__ = [
    "DATA_ROOT_ENV",
    "DATASETS",
    "DatasetError",
    "DatasetFormat",
    "PromptRecord",
    "available_datasets",
    "available_formats",
    "dataset_path",
    "default_data_root",
    "detect_format",
    "get_format",
    "load_dataset",
    "load_prompts",
    "register_format",
    "split_holdout",
]

#: Environment variable that overrides the data root.
DATA_ROOT_ENV = "CEGRPO_DATA_ROOT"


class DatasetError(ConfigError):
    """A data file or row that cannot be turned into :class:`PromptRecord` s (the message
    names the file, the line, the field and the fix)."""


@dataclass
class PromptRecord:
    """One training / evaluation prompt."""

    question: str
    ground_truth: str
    verifier: str
    dataset: str
    row: int  # 1-based line number in the source file


# --------------------------------------------------------------------------
# Data root and short names
# --------------------------------------------------------------------------
def default_data_root() -> str:
    """``$CEGRPO_DATA_ROOT`` if set, else ``<repo root>/../shared/data``
    (repo root = the folder holding the ``megatron_cegrpo`` package)."""
    env = os.environ.get(DATA_ROOT_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    pkg_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo_root = os.path.dirname(pkg_dir)
    return os.path.abspath(os.path.join(repo_root, "..", "shared", "data"))


#: Short data set names -> file paths relative to :func:`default_data_root`.
DATASETS: Dict[str, str] = {
    "mawps": "mawps/singleop.jsonl",
    "mawps/singleop": "mawps/singleop.jsonl",
    "mawps/addsub": "mawps/addsub.jsonl",
    "mawps/multiarith": "mawps/multiarith.jsonl",
    "mawps/singleeq": "mawps/singleeq.jsonl",
    "gsm8k/train": "gsm8k/train.jsonl",
    "gsm8k/test": "gsm8k/test.jsonl",
    "minerva_math": "minerva_math/test.jsonl",
    "aime24": "aime24/test.jsonl",
    "amc23": "amc23/test.jsonl",
    "olympiadbench": "olympiadbench/test.jsonl",
}


def available_datasets() -> List[str]:
    return sorted(DATASETS)


def dataset_file(name: str, root: Optional[str] = None) -> str:
    """Absolute path where the file behind short name ``name`` (see :data:`DATASETS`) belongs under
    ``root`` (default: :func:`default_data_root`), whether or not it exists: what an error about a
    missing data set names. Unknown name -> ``ValueError`` listing the names."""
    if name not in DATASETS:
        raise ValueError(
            f"unknown data set {name!r}; valid names: {', '.join(available_datasets())}"
        )
    return os.path.join(resolve_data_root(root), DATASETS[name])


def resolve_data_root(root: Optional[str] = None) -> str:
    """``root`` (``--data-root``) as an absolute path, ``~`` expanded, or :func:`default_data_root`
    when it is None or empty."""
    return os.path.abspath(os.path.expanduser(root)) if root else default_data_root()


def dataset_path(name: str, root: Optional[str] = None) -> str:
    """Absolute path of the file behind short name ``name`` (see :data:`DATASETS`) under
    ``root`` (default: :func:`default_data_root`), checked to exist (:func:`dataset_file`).

    Unknown name -> ``ValueError`` listing the names; a missing file ->
    ``FileNotFoundError`` naming the path and ``$CEGRPO_DATA_ROOT``.
    """
    path = dataset_file(name, root)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data set {name!r} not found at {path}; the data root is {resolve_data_root(root)} "
            f"(set ${DATA_ROOT_ENV} to the folder holding gsm8k/, mawps/, ...)"
        )
    return path


# --------------------------------------------------------------------------
# Formats registry
# --------------------------------------------------------------------------
class _RowError(Exception):
    """Raised by converters; load_prompts adds file and line."""

    def __init__(self, field: str, problem: str, fix: str):
        super().__init__(field, problem, fix)
        self.field, self.problem, self.fix = field, problem, fix


Converter = Callable[[dict], Tuple[str, str]]


@dataclass(frozen=True)
class DatasetFormat:
    name: str
    verifier: str
    fields: Tuple[str, ...]  # documentation: the fields the format reads
    detect: Callable[[dict], bool]
    convert: Converter  # row -> (question, ground_truth); raises _RowError


_FORMATS: Dict[str, DatasetFormat] = {}


def register_format(
    name: str, *, verifier: str, fields: Sequence[str], detect: Callable[[dict], bool]
) -> Callable[[Converter], Converter]:
    """Decorator registering a row converter as format ``name``.

    ``detect(first_row)`` says whether a file is in this format; formats are
    tried in registration order.  The converter returns
    ``(question, ground_truth)`` and signals bad rows by raising ``_RowError``.
    """

    def deco(fn: Converter) -> Converter:
        if name in _FORMATS:
            raise ValueError(f"format {name!r} is already registered")
        _FORMATS[name] = DatasetFormat(name, verifier, tuple(fields), detect, fn)
        return fn

    return deco


def get_format(name: str) -> DatasetFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown data format {name!r}; valid formats: {', '.join(available_formats())}"
        ) from None


def available_formats() -> List[str]:
    return sorted(_FORMATS)


def detect_format(row: dict) -> Optional[str]:
    """Name of the first registered format whose detector accepts ``row``."""
    for fmt in _FORMATS.values():
        try:
            if fmt.detect(row):
                return fmt.name
        except Exception:
            continue
    return None


# ---- field helpers --------------------------------------------------------
def _text_field(row: dict, *names: str) -> str:
    """First present field among ``names`` as a non-empty stripped string."""
    for name in names:
        if name in row and row[name] is not None:
            val = row[name]
            if not isinstance(val, str):
                raise _RowError(name, f"is {type(val).__name__}, not text",
                                f"write the {name!r} field as a JSON string")
            if not val.strip():
                raise _RowError(name, "is empty", f"put the text in the {name!r} field")
            return val.strip()
    label = " or ".join(repr(n) for n in names)
    raise _RowError(names[0], "is missing", f"add the field {label} to this row")


def _number_text(value, field: str) -> str:
    """A JSON number (or numeric string) as its shortest exact text: 27.0 -> '27'."""
    if isinstance(value, bool) or value is None:
        raise _RowError(field, f"is {value!r}, not a number", f"write a number in {field!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise _RowError(field, f"is {value!r}", f"write a finite number in {field!r}")
        if float(value).is_integer():
            return str(int(value))
        return repr(float(value))
    if isinstance(value, str):
        s = value.strip().replace(",", "")
        try:
            f = float(s)
        except ValueError:
            return value.strip()  # not numeric: leave LaTeX answers alone
        if math.isfinite(f) and f.is_integer() and "e" not in s.lower():
            return str(int(f))
        return s
    raise _RowError(field, f"is {type(value).__name__}", f"write {field!r} as a number or string")


# ---- the formats (registration order = detection order) -------------------
@register_format(
    "mawps",
    verifier="numeric",
    fields=("input", "target"),
    detect=lambda r: "input" in r and "target" in r,
)
def _mawps(row: dict) -> Tuple[str, str]:
    question = _text_field(row, "input")
    if "target" not in row:
        raise _RowError("target", "is missing", "add the numeric answer as 'target'")
    target = row["target"]
    if isinstance(target, bool) or not isinstance(target, (int, float, str)):
        raise _RowError("target", f"is {target!r}, not a number", "write 'target' as a number, e.g. 43.0")
    return question, str(target).strip()


@register_format(
    "gsm8k",
    verifier="gsm8k",
    fields=("question", "answer"),
    detect=lambda r: "question" in r and isinstance(r.get("answer"), str) and "####" in r["answer"],
)
def _gsm8k(row: dict) -> Tuple[str, str]:
    question = _text_field(row, "question")
    answer = _text_field(row, "answer")
    if "####" not in answer:
        raise _RowError("answer", "has no '#### N' final-answer line",
                        "end the 'answer' field with '#### <number>'")
    return question, answer.rsplit("####", 1)[1].strip().replace(",", "")


@register_format(
    "olympiadbench",
    verifier="olympiad_list",
    fields=("question", "final_answer", "context"),
    detect=lambda r: "question" in r and isinstance(r.get("final_answer"), list),
)
def _olympiadbench(row: dict) -> Tuple[str, str]:
    question = _text_field(row, "question")
    context = row.get("context")
    if isinstance(context, str) and context.strip():
        question = context.strip() + "\n\n" + question
    if "final_answer" not in row:
        raise _RowError("final_answer", "is missing", "add 'final_answer' as a JSON list of answers")
    answers = row["final_answer"]
    if not isinstance(answers, list) or not answers:
        raise _RowError("final_answer", f"is {answers!r}, not a non-empty list",
                        "write 'final_answer' as a JSON list, e.g. [\"$2n$\"]")
    if not all(isinstance(a, (str, int, float)) and str(a).strip() for a in answers):
        raise _RowError("final_answer", f"has an empty or non-text element: {answers!r}",
                        "make every element of 'final_answer' a non-empty string")
    return question, json.dumps([str(a) for a in answers], ensure_ascii=False)


@register_format(
    "competition",
    verifier="boxed",
    fields=("problem", "question", "answer"),
    detect=lambda r: ("problem" in r or "question" in r)
    and "answer" in r
    and "####" not in str(r["answer"]),
)
def _competition(row: dict) -> Tuple[str, str]:
    question = _text_field(row, "problem", "question")
    if "answer" not in row or row["answer"] is None or str(row["answer"]).strip() == "":
        raise _RowError("answer", "is missing or empty", "add the final answer as 'answer'")
    return question, _number_text(row["answer"], "answer")


@register_format(
    "minerva",
    verifier="boxed",
    fields=("problem", "solution"),
    detect=lambda r: "problem" in r and isinstance(r.get("solution"), str) and "answer" not in r,
)
def _minerva(row: dict) -> Tuple[str, str]:
    question = _text_field(row, "problem")
    solution = _text_field(row, "solution")
    boxes = extract_boxed(solution)
    if not boxes or not boxes[-1]:
        raise _RowError("solution", "has no \\boxed{...} answer",
                        "mark the final answer in 'solution' with \\boxed{...}")
    return question, boxes[-1]


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------
def _err(path: str, line: int, field: str, problem: str, fix: str) -> DatasetError:
    return DatasetError(f"{path}, line {line}: field {field!r} {problem}; fix: {fix}")


def load_prompts(path: str, format: Optional[str] = None, limit: Optional[int] = None) -> List[PromptRecord]:
    """Load a JSONL file into :class:`PromptRecord` s.

    ``format=None`` detects the format from the first row's fields.  ``limit``
    keeps the first ``limit`` rows (all rows are still validated up to there).
    Every ground truth is checked by its verifier, so a malformed answer fails
    here, at load time, with the file and line, not mid-training.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} does not exist; fix: give the path of a JSONL file, one problem "
                                f"a line (the known data sets lie under {default_data_root()}, ${DATA_ROOT_ENV})")
    fmt = get_format(format) if format is not None else None
    verifier = None
    name = os.path.splitext(os.path.basename(path))[0]
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    dataset = f"{parent}/{name}" if parent else name

    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    while lines and not lines[-1].strip():  # trailing blank lines are not rows
        lines.pop()
    if not lines:
        raise DatasetError(f"{path} is empty; fix: one JSON object per line")

    records: List[PromptRecord] = []
    for lineno, line in enumerate(lines, start=1):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            raise _err(path, lineno, "<line>", "is a blank line inside the file",
                       "delete the blank line (every line must be one JSON object)")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise _err(path, lineno, "<line>", f"is not valid JSON ({e.msg} at column {e.colno})",
                       "write the line as one JSON object") from None
        if not isinstance(row, dict):
            raise _err(path, lineno, "<line>", f"is a JSON {type(row).__name__}, not an object",
                       "write the line as one JSON object with named fields")
        if fmt is None:
            detected = detect_format(row)
            if detected is None:
                raise DatasetError(
                    f"{path}, line {lineno}: cannot detect the data format from fields "
                    f"{sorted(row)}; fix: name the format (--train-data-format, or format=) as one of "
                    f"{', '.join(available_formats())}, or use the fields of a known format"
                )
            fmt = get_format(detected)
        if verifier is None:
            verifier = get_verifier(fmt.verifier)
        try:
            question, gt = fmt.convert(row)
        except _RowError as e:
            raise _err(path, lineno, e.field, e.problem, e.fix) from None
        try:
            verifier("", gt)  # raises ValueError on a malformed ground truth
        except ValueError as e:
            gt_field = {"mawps": "target", "gsm8k": "answer", "olympiadbench": "final_answer",
                        "minerva": "solution"}.get(fmt.name, "answer")
            raise _err(path, lineno, gt_field, f"holds an unusable ground truth: {e}",
                       f"write an answer the {fmt.verifier!r} verifier can read") from None
        records.append(PromptRecord(question, gt, fmt.verifier, dataset, lineno))
    return records


def load_dataset(name: str, limit: Optional[int] = None, root: Optional[str] = None) -> List[PromptRecord]:
    """``load_prompts(dataset_path(name, root), limit=limit)`` with the short name as ``dataset``."""
    records = load_prompts(dataset_path(name, root), limit=limit)
    for r in records:
        r.dataset = name
    return records


def split_holdout(
    records: Sequence[PromptRecord], num_holdout: int, seed: int
) -> Tuple[List[PromptRecord], List[PromptRecord]]:
    """Deterministic split into ``(train, holdout)``.

    ``num_holdout`` records are drawn with ``random.Random(seed)``; both parts
    keep the file order.  Same records + seed -> same split.
    """
    n = len(records)
    if not 0 <= num_holdout <= n:
        raise ValueError(f"num_holdout must be in [0, {n}], got {num_holdout}")
    held = set(random.Random(seed).sample(range(n), num_holdout))
    train = [r for i, r in enumerate(records) if i not in held]
    holdout = [r for i, r in enumerate(records) if i in held]
    return train, holdout
