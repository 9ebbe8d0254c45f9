"""Per-row correctness of an evaluation, one small JSONL file per evaluation (issue 33).

The trainer's driver writes one file per evaluation into ``<log dir>/eval_rows/``: the
held-out greedy evaluation before and after training (``holdout-step0.jsonl``,
``holdout-step<N>.jsonl``) and every ``--eval-datasets`` evaluation
(``mawps,multiarith-step0.jsonl``: a data set name's ``/`` becomes ``,``). Paired statistics
(``tools/study_report.py``: the same rows before and after, two arms on the same rows) are
computed from them; ``metrics.jsonl`` keeps only each evaluation's mean and standard error.

File layout: a header line, then one line per row in evaluation order::

    {"schema": "megatron_cegrpo.eval_rows/1", "eval": "holdout", "step": 0, "mode": "greedy",
     "k": 1, "num_rows": 300, "acc": 0.0766..., "rows_digest": "1a2b3c4d"}
    {"row":17,"score":0}
    {"row":23,"score":1}

``row`` is the row's 1-based line number in its source file (``PromptRecord.row``): the same
problem has the same id at every evaluation of a run, and in every run of the same
``--train-data`` and ``--holdout-seed`` (the held-out rows) or of the same data set and
``--eval-limit`` (a suite). ``score`` is the row's correctness: 0 or 1 for a greedy
evaluation, the mean verifier score of its k samples for avg@k. ``rows_digest`` identifies
the set of rows (CRC-32 of every id and question, :func:`rows_digest`), so that two files
can be checked to hold the same problems. About 22 bytes a row: the study's 300 held-out
MAWPS rows take 6.7 kB a file, its four evaluations an arm about 27 kB.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron_cegrpo.checkpointing.atomic import write_text_atomic
from megatron_cegrpo.evaluation.core import DatasetResult

__all__ = ["ROWS_DIR", "ROWS_SCHEMA", "EvalRows", "EvalRowsError", "find_eval_rows", "read_eval_rows",
           "rows_digest", "rows_file_name", "write_eval_rows"]

ROWS_SCHEMA = "megatron_cegrpo.eval_rows/1"

#: The folder of the per-row files inside a run's log dir.
ROWS_DIR = "eval_rows"


class EvalRowsError(ValueError):
    """A per-row file that cannot be read or does not match its run; the message is one line
    naming the file and the fix."""


@dataclass
class EvalRows:
    """One evaluation's per-row file read back: ``header`` (the first line), ``ids`` (row ids,
    evaluation order) and ``scores`` (each row's correctness in [0, 1], same order)."""

    path: str
    header: Dict
    ids: List[int]
    scores: List[float]

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def acc(self) -> float:
        """Mean score, summed in file order (the order ``DatasetResult.acc`` sums in)."""
        return sum(self.scores) / len(self.scores)

    def by_id(self) -> Dict[int, float]:
        return dict(zip(self.ids, self.scores))


def rows_file_name(name: str, step: int) -> str:
    """The file name of data set ``name``'s evaluation at training step ``step``
    (``holdout-step0.jsonl``; ``mawps/multiarith`` -> ``mawps,multiarith-step48.jsonl``)."""
    return f"{name.replace('/', ',')}-step{int(step)}.jsonl"


def rows_digest(records: Sequence) -> str:
    """CRC-32 (8 hex digits) of the set of rows: every ``(row, question)`` pair, sorted by
    row, question lower-cased with whitespace collapsed (``train_data.question_key``). Equal
    digests: the same problems under the same ids, in any order."""
    from megatron_cegrpo.data.train_data import question_key

    text = "\n".join(f"{row}\t{q}" for row, q in sorted((int(r.row), question_key(r.question)) for r in records))
    return f"{zlib.crc32(text.encode('utf-8')):08x}"


def _num(x: float):
    return int(x) if float(x).is_integer() else float(x)


def write_eval_rows(log_dir: str, result: DatasetResult, step: int) -> str:
    """Write ``result``'s per-row correctness (``result.per_problem``: 0/1 for greedy, the mean
    of k sample scores for avg@k) to ``<log_dir>/eval_rows/<rows_file_name(name, step)>``,
    atomically (a file of the same evaluation is replaced). ``step``: the training iteration
    the evaluation ran at (0: before training). Returns the path; OSError when it cannot be
    written."""
    d = os.path.join(log_dir, ROWS_DIR)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, rows_file_name(result.name, step))
    header = {"schema": ROWS_SCHEMA, "eval": result.name, "step": int(step), "mode": result.mode.name,
              "k": result.mode.k, "num_rows": result.num_rows, "acc": result.acc,
              "rows_digest": rows_digest(result.records)}
    lines = [json.dumps(header)]
    lines += [json.dumps({"row": int(r.row), "score": _num(s)}, separators=(",", ":"))
              for r, s in zip(result.records, result.per_problem)]
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def read_eval_rows(path: str) -> EvalRows:
    """Read a file :func:`write_eval_rows` wrote. Raises FileNotFoundError when it is missing
    and :class:`EvalRowsError` (one line naming the file and the fix) when it is not such a
    file: no header of schema :data:`ROWS_SCHEMA`, a malformed line, a row id given twice, a
    score outside [0, 1], or a row count other than the header's ``num_rows``."""
    fix = "fix: delete it (the report then shows the paired statistics as not available) or rerun the evaluation"
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    try:
        header = json.loads(lines[0]) if lines else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("schema") != ROWS_SCHEMA:
        raise EvalRowsError(f"{path}: not a per-row evaluation file (first line is not a {ROWS_SCHEMA} header); {fix}")
    ids, scores, seen = [], [], set()
    for i, ln in enumerate(lines[1:], start=2):
        try:
            r = json.loads(ln)
            row, score = int(r["row"]), float(r["score"])
        except (ValueError, KeyError, TypeError):
            raise EvalRowsError(f"{path}, line {i}: not a {{\"row\", \"score\"}} object (cut short?); {fix}") from None
        if row in seen or not 0.0 <= score <= 1.0:
            what = f"row {row} appears twice" if row in seen else f"score {score} is outside [0, 1]"
            raise EvalRowsError(f"{path}, line {i}: {what}; {fix}")
        seen.add(row)
        ids.append(row)
        scores.append(score)
    if not ids or len(ids) != header.get("num_rows"):
        raise EvalRowsError(f"{path}: {len(ids)} rows, the header says {header.get('num_rows')} (cut short?); {fix}")
    return EvalRows(path, header, ids, scores)


def find_eval_rows(log_dir: str) -> Dict[Tuple[str, int], str]:
    """``{(data set, step): path}`` of the per-row files under ``<log_dir>/eval_rows/`` (by
    file name; {} when there is no such folder)."""
    d = os.path.join(log_dir, ROWS_DIR)
    out = {}
    if not os.path.isdir(d):
        return out
    for fn in sorted(os.listdir(d)):
        stem, sep, step = fn[:-len(".jsonl")].rpartition("-step") if fn.endswith(".jsonl") else ("", "", "")
        if sep and step.isdigit():
            out[(stem.replace(",", "/"), int(step))] = os.path.join(d, fn)
    return out
