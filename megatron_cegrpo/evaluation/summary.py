"""The JSON summary of an evaluation, its console table, and reading summaries back.

Summary layout (``schema`` = :data:`SCHEMA`)::

    {
      "schema": "megatron_cegrpo.eval/1",
      "meta": {"label": ..., "model": ..., "created": ..., ...},   # free-form, caller's
      "settings": {"max_new_tokens": ..., "template": ..., "seed": ..., ...},
      "metrics": {"val/mawps/acc": 0.41, "val/mawps/num_rows": 32, ...},   # flat, as logged
      "datasets": {
        "mawps": {"mode": "greedy", "k": 1, "temperature": null, "num_rows": 32,
                  "acc": 0.41, "acc_stderr": 0.09, "pass_at_k": 0.41, "seconds": 12.3,
                  "rows": [{"row": 1, "scores": [1.0]}, ...],
                  "examples": [{"row": 1, "question": ..., "ground_truth": ..., "responses": [...],
                                "scores": [...]}, ...]}
      }
    }

Non-finite floats are written as strings ("nan") so the file stays valid JSON.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any, Dict, Mapping, Optional

from megatron_cegrpo.checkpointing.atomic import write_text_atomic
from megatron_cegrpo.evaluation.core import EvalReport

__all__ = ["SCHEMA", "summary_dict", "write_summary", "load_summary", "format_table"]

SCHEMA = "megatron_cegrpo.eval/1"


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def summary_dict(report: EvalReport, meta: Optional[Mapping[str, Any]] = None,
                 num_examples: int = 3) -> Dict[str, Any]:
    """The summary of ``report`` as a JSON-ready dict (``num_examples`` responses per data
    set are kept in full; -1 keeps all)."""
    meta = dict(meta or {})
    meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    ds = {}
    for name, r in report.datasets.items():
        keep = r.num_rows if num_examples is None or num_examples < 0 else min(num_examples, r.num_rows)
        ds[name] = {
            **r.mode.to_dict(),
            "num_rows": r.num_rows,
            "acc": r.acc,
            "acc_stderr": r.acc_stderr,
            "pass_at_k": r.pass_at_k,
            "seconds": r.seconds,
            "rows": [{"row": getattr(rec, "row", i + 1), "scores": s}
                     for i, (rec, s) in enumerate(zip(r.records, r.scores))],
            "examples": [{"row": getattr(rec, "row", i + 1), "question": rec.question,
                          "ground_truth": rec.ground_truth, "verifier": rec.verifier,
                          "responses": r.texts[i], "scores": r.scores[i]}
                         for i, rec in enumerate(r.records[:keep])],
        }
    return _clean({"schema": SCHEMA, "meta": meta, "settings": dict(report.settings),
                   "metrics": dict(report.metrics), "datasets": ds})


def write_summary(path: str, report: EvalReport, meta: Optional[Mapping[str, Any]] = None,
                  num_examples: int = 3) -> str:
    """Write :func:`summary_dict` to ``path`` atomically (parent folders created). Returns the path."""
    data = summary_dict(report, meta, num_examples)
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return path


def as_float(v) -> Optional[float]:
    """A logged value as float: numbers, bools and numeric strings (MetricsWriter writes
    non-finite floats as "nan"/"inf"); None for anything else."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)  # "nan", "inf"
        except ValueError:
            return None
    return None


def load_summary(path: str) -> Dict[str, Any]:
    """Read an evaluation result for plotting/comparison.

    Accepts this module's summaries, a flat ``{"val/<name>/acc": ...}`` dict, or the
    trainer's ``summary.json`` (its ``"final"`` entry, else ``"initial"``).

    Returns ``{"label": str, "path": str, "acc": {name: float}, "stderr": {name: float},
    "modes": {name: "greedy" | "avg@8 T=0.7"}, "metrics": {...}}``; ``label`` is ``meta.label`` if set, else the file name without
    ``.json``. ValueError if the file holds no ``val/<name>/acc`` value.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    if isinstance(data.get("metrics"), dict):
        metrics = data["metrics"]
    elif any(k.startswith("val/") for k in data):
        metrics = data
    elif isinstance(data.get("final"), dict):
        metrics = data["final"]
    elif isinstance(data.get("initial"), dict):
        metrics = data["initial"]
    else:
        metrics = {}
    acc, err = {}, {}
    for k, v in metrics.items():
        m = re.match(r"^val/(.+)/acc$", k)
        if m:
            x = as_float(v)
            if x is not None:
                acc[m.group(1)] = x
        m = re.match(r"^val/(.+)/acc_stderr$", k)
        if m:
            x = as_float(v)
            if x is not None:
                err[m.group(1)] = x
    if not acc:
        raise ValueError(f"{path}: no 'val/<data set>/acc' values found (not an evaluation summary?)")
    modes = {}
    if isinstance(data.get("datasets"), dict):
        for n, d in data["datasets"].items():
            if isinstance(d, dict) and isinstance(d.get("mode"), str):
                t = d.get("temperature")
                modes[n] = d["mode"] + (f" T={t:g}" if isinstance(t, (int, float)) else "")
    base = os.path.basename(path)
    label = meta.get("label") or (base[:-5] if base.endswith(".json") else base)
    return {"label": str(label), "path": path, "acc": acc, "stderr": err, "modes": modes, "metrics": metrics}


def format_table(report: EvalReport) -> str:
    """A plain-text table: one line per data set."""
    head = f"{'dataset':<16} {'mode':<14} {'rows':>5} {'acc':>7} {'± se':>7} {'pass@k':>7} " \
           f"{'len':>6} {'trunc':>6} {'time s':>8}"
    lines = [head, "-" * len(head)]
    for name, r in report.datasets.items():
        lens = [x for row in r.response_lengths for x in row]
        trunc = [x for row in r.truncated for x in row]
        lines.append(
            f"{name:<16} {r.mode.describe():<14} {r.num_rows:>5} {r.acc:>7.4f} {r.acc_stderr:>7.4f} "
            f"{(r.pass_at_k if not r.mode.greedy else float('nan')):>7.4f} "
            f"{(sum(lens) / len(lens) if lens else 0):>6.1f} {(sum(trunc) / len(trunc) if trunc else 0):>6.3f} "
            f"{r.seconds:>8.1f}")
    lines.append(f"total time {report.metrics.get('timing_s/eval', 0.0):.1f} s")
    return "\n".join(lines).replace(" nan", "   -")
