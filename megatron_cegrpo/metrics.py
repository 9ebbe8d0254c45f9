"""Metrics: named phase timers and the JSONL log (one object per iteration).

(Not called ``logging.py``: the deepspeed launcher runs ``megatron_cegrpo/train.py``
as a script, which puts this folder first on ``sys.path`` where a
``logging.py`` would shadow the standard library.)
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from typing import Dict, Optional

__all__ = ["PhaseTimers", "MetricsWriter", "format_progress"]


class PhaseTimers:
    """Wall-clock seconds per named phase of one iteration (``timing_s/<phase>``)."""

    def __init__(self):
        self.times: Dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def snapshot_and_reset(self) -> Dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        self.times = {}
        return out


class MetricsWriter:
    """Appends one JSON object per call to ``<log_dir>/metrics.jsonl`` (driver rank only).

    Non-finite floats are written as strings ("nan", "inf") so every line stays valid JSON.
    """

    def __init__(self, log_dir: str, resume: bool = False):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "metrics.jsonl")
        if not resume and os.path.exists(self.path):
            os.remove(self.path)

    def write(self, record: Dict) -> None:
        clean = {}
        for k, v in record.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = str(v)
            clean[k] = v
        with open(self.path, "a") as f:
            f.write(json.dumps(clean, sort_keys=False) + "\n")
            f.flush()


def format_progress(m: Dict, total_iters: int) -> str:
    """One console line per iteration."""
    def g(k, fmt="{:.3f}"):
        v = m.get(k)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    return (
        f"iter {m['step']:>4}/{total_iters} | score {g('critic/score/mean')} | "
        f"pg_loss {g('actor/pg_loss', '{:+.4f}')} | kl {g('actor/kl_loss', '{:.4f}')} | "
        f"ent {g('actor/entropy', '{:.2f}')} | gnorm {g('actor/grad_norm', '{:.3f}')} | "
        f"mismatch {g('mismatch/abs_logprob_diff_mean', '{:.3f}')} | "
        f"resp_len {g('response_length/mean', '{:.0f}')} | bytes_ratio {g('comm/bytes_ratio', '{:.4f}')} | "
        f"{g('timing_s/step', '{:.1f}')} s"
    )
