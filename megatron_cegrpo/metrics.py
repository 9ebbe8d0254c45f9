"""Metrics: named phase timers, the JSONL log (one object per iteration) and optional
wandb / TensorBoard backends that receive the same records under the same names.

The trainer's driver builds its writers with :func:`build_writers` and calls
``writer.write(record)`` once per iteration (a record is a flat ``{name: value}`` dict
with an integer ``"step"``), then ``writer.close()`` at the end.

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
from typing import Any, Dict, List, Mapping, Optional

__all__ = [
    "PhaseTimers",
    "parse_record",
    "MetricsWriter",
    "WandbBackend",
    "TensorBoardBackend",
    "MultiWriter",
    "build_writers",
    "format_progress",
    "truncate_metrics",
    "lost_iterations",
]


class PhaseTimers:
    """Wall-clock seconds per named phase of one iteration (``timing_s/<phase>``).

    On a GPU each phase ends with ``torch.cuda.synchronize()``: kernels are queued asynchronously,
    so without it a phase's time would land in whichever later phase first waits for them."""

    def __init__(self):
        import torch  # here: the log-reading tools import this module without torch's start-up

        self.times: Dict[str, float] = {}
        self._sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
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

    def close(self) -> None:
        """Nothing to release (each write opens and closes the file)."""


def parse_record(line: str) -> Optional[dict]:
    """One ``metrics.jsonl`` line as a dict, or None when it is not a complete JSON object
    (e.g. the last line of a run killed mid-write)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) else None


def truncate_metrics(path: str, last_step: int) -> List[str]:
    """Prepare a resumed run's ``metrics.jsonl``: keep the records of steps up to
    ``last_step`` (the checkpoint's iteration), drop those written after it by the run that
    died, and drop lines that are not a JSON object (a write cut short by a kill leaves a
    partial last line). Rewrites the file atomically, every kept line ending in a newline,
    so the resumed log has each step once and the next append starts on its own line.
    A record without ``"step"`` counts as step 0. A missing file is left missing.

    Returns:
        one warning per dropped corrupt line (file, line number, first characters), for the
        caller to print; empty when every line parsed.
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    kept, warnings_out = [], []
    for i, ln in enumerate(lines, start=1):
        if not ln.strip():
            continue
        rec = parse_record(ln)
        if rec is None:
            where = "its last line" if i == len(lines) else f"line {i} of {len(lines)}"
            warnings_out.append(f"{path}: dropped {where}, which is not a complete JSON record "
                                f"({ln[:40]!r}{'...' if len(ln) > 40 else ''}; a write cut short by a kill)")
            continue
        step = rec.get("step", 0)
        if not isinstance(step, (int, float)) or step <= last_step:
            kept.append(ln + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return warnings_out


def _records(path: str) -> List[Dict]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return [r for r in map(parse_record, f.read().splitlines()) if r is not None]


def logged_restarts(path: str) -> int:
    """The newest ``recovery/restarts`` in ``metrics.jsonl`` (0 for none, or a missing file): the
    count of the start that logged last. A restart counts one more (``Driver.resume_log``): on
    several hosts no agent's own count need hold every restart (pytorch/pytorch#108158)."""
    if not os.path.exists(path):
        return 0
    return next((int(r["recovery/restarts"]) for r in reversed(_records(path))
                 if isinstance(r.get("recovery/restarts"), (int, float))), 0)


def lost_iterations(path: str, last_step: int) -> int:
    """The iterations a restarted run recomputes, counted over the run so far: the newest
    ``recovery/lost_iterations`` in ``metrics.jsonl`` (the earlier restarts') plus the steps
    logged after ``last_step`` (the checkpoint it resumes from) by the start that died, each
    once. Call before :func:`truncate_metrics` drops them; 0 for a missing file."""
    if not os.path.exists(path):
        return 0
    records = _records(path)
    before = next((int(r["recovery/lost_iterations"]) for r in reversed(records)
                   if isinstance(r.get("recovery/lost_iterations"), (int, float))), 0)
    return before + len({r["step"] for r in records
                         if isinstance(r.get("step"), (int, float)) and r["step"] > last_step})


# ----------------------------------------------------------------------------- backends


def _scalar(v) -> Optional[float]:
    """A record value as a float for scalar backends, or None to skip it.

    bool/int/float pass (NaN and inf included); the JSONL spellings "nan"/"inf"/"-inf"
    become floats; any other string, list, dict or None is skipped.
    """
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.strip().lower() in ("nan", "inf", "+inf", "-inf", "infinity", "-infinity"):
        return float(v)
    try:  # numpy / torch scalars
        import numbers

        if isinstance(v, numbers.Number):
            return float(v)
        if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
            return float(v.item())
    except (TypeError, ValueError):
        pass
    return None


def _step_of(record: Mapping, fallback: int) -> int:
    step = record.get("step")
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else fallback


class WandbBackend:
    """Log records to Weights & Biases (``wandb.log(values, step=record["step"])``).

    Works offline (``mode="offline"`` or ``WANDB_MODE=offline``): the run is written under
    ``<dir>/wandb/offline-run-*`` and can be uploaded later with ``wandb sync``.  Same
    metric names as the JSONL; numbers (NaN included) and strings are logged, other
    values are skipped.  wandb's service writes the run file asynchronously: it is complete
    once the process exits (or after ``wandb.teardown()``), not necessarily at ``close()``.

    Args:
        project: wandb project name.
        run_name: display name of the run (default: wandb's).
        dir: folder for wandb's files (default: the working directory).
        mode: "online" | "offline" | "disabled" (default: ``$WANDB_MODE``, else wandb's default).
        config: hyper-parameters stored with the run.
        **init_kwargs: passed to ``wandb.init`` (e.g. ``entity``, ``group``, ``tags``, ``resume``).
    """

    def __init__(self, project: str, run_name: Optional[str] = None, dir: Optional[str] = None,
                 mode: Optional[str] = None, config: Optional[Mapping] = None, **init_kwargs):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "WandbBackend needs the 'wandb' package, which is not installed: "
                "pip install 'megatron_cegrpo[logging]' (or pip install wandb), "
                "or drop the wandb option"
            ) from e
        if dir is not None:
            os.makedirs(dir, exist_ok=True)
        kwargs = dict(project=project, name=run_name, dir=dir, config=dict(config) if config else None)
        if mode is not None:
            kwargs["mode"] = mode
        if "settings" not in init_kwargs:
            try:  # no console capture, no system-stats sampler (older wandb may lack a field)
                kwargs["settings"] = wandb.Settings(console="off", silent=True, x_disable_stats=True)
            except Exception:
                pass
        kwargs.update(init_kwargs)
        self._wandb = wandb
        self.run = wandb.init(**kwargs)
        self._last_step = -1

    @property
    def run_dir(self) -> Optional[str]:
        """The run's folder (``.../wandb/offline-run-<date>-<id>`` offline)."""
        files = getattr(self.run, "dir", None)  # <run dir>/files
        return os.path.dirname(files) if files else None

    def write(self, record: Mapping[str, Any]) -> None:
        step = _step_of(record, self._last_step + 1)
        values = {}
        for k, v in record.items():
            if k == "step":
                continue
            x = _scalar(v)
            if x is not None:
                values[k] = x
            elif isinstance(v, str):
                values[k] = v
        # wandb drops rows whose step goes backwards; keep its step monotonic
        step = max(step, self._last_step)
        self.run.log(values, step=step)
        self._last_step = step

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class TensorBoardBackend:
    """Log records as TensorBoard scalars (``torch.utils.tensorboard.SummaryWriter``).

    One scalar per numeric value, tag = the metric name, global step = ``record["step"]``;
    strings and other non-numeric values are skipped.  ``config`` (if given) is stored once
    as a text summary named ``config``.  Flushed after every record.
    """

    def __init__(self, log_dir: str, config: Optional[Mapping] = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "TensorBoardBackend needs the 'tensorboard' package, which is not installed: "
                "pip install 'megatron_cegrpo[logging]' (or pip install tensorboard), "
                "or drop the tensorboard option"
            ) from e
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)
        self._last_step = -1
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(dict(config), indent=2, default=str) + "\n```", 0)

    def write(self, record: Mapping[str, Any]) -> None:
        step = _step_of(record, self._last_step + 1)
        for k, v in record.items():
            if k == "step":
                continue
            x = _scalar(v)
            if x is not None:
                self.writer.add_scalar(k, x, global_step=step)
        self.writer.flush()
        self._last_step = step

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class MultiWriter:
    """Fans each record out to several writers (JSONL first). ``path`` is the JSONL file."""

    def __init__(self, writers: List):
        if not writers:
            raise ValueError("MultiWriter needs at least one writer")
        self.writers = list(writers)

    @property
    def path(self) -> Optional[str]:
        for w in self.writers:
            if isinstance(w, MetricsWriter):
                return w.path
        return None

    def write(self, record: Mapping[str, Any]) -> None:
        for w in self.writers:
            w.write(record)

    def close(self) -> None:
        for w in self.writers:
            w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def build_writers(log_dir: str, wandb_project: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                  config: Optional[Mapping] = None, *, resume: bool = False, run_name: Optional[str] = None,
                  wandb_mode: Optional[str] = None, wandb_dir: Optional[str] = None) -> MultiWriter:
    """The trainer's writers: always ``<log_dir>/metrics.jsonl``; a :class:`WandbBackend`
    when ``wandb_project`` is set (run name ``run_name`` or the log dir's name, files under
    ``wandb_dir`` or ``log_dir``); a :class:`TensorBoardBackend` when ``tensorboard_dir`` is
    set. Call on the driver rank only. A missing optional package raises ImportError at
    once (before training starts), naming the package.
    """
    writers: List = [MetricsWriter(log_dir, resume=resume)]
    try:
        if tensorboard_dir:
            writers.append(TensorBoardBackend(tensorboard_dir, config=config))
        if wandb_project:
            name = run_name or os.path.basename(os.path.normpath(log_dir))
            writers.append(WandbBackend(wandb_project, run_name=name, dir=wandb_dir or log_dir,
                                        mode=wandb_mode, config=config))
    except BaseException:
        for w in writers:
            w.close()
        raise
    return MultiWriter(writers)


def _mb(v) -> str:
    return f"{v / 1e6:.1f}" if isinstance(v, (int, float)) else "-"


def format_progress(m: Dict, total_iters: int) -> str:
    """One console line per iteration: the whole-step bytes (``comm/total_bytes``, its ratio to
    dense-everything, and the run's ratio so far, ``comm/run_total_ratio``) before the boundary ratio."""
    def g(k, fmt="{:.3f}"):
        v = m.get(k)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    line = (
        f"iter {m['step']:>4}/{total_iters} | score {g('critic/score/mean')} | "
        f"pg_loss {g('actor/pg_loss', '{:+.4f}')} | kl {g('actor/kl_loss', '{:.4f}')} | "
        f"ent {g('actor/entropy', '{:.2f}')} | gnorm {g('actor/grad_norm', '{:.3f}')} | "
        f"mismatch {g('mismatch/abs_logprob_diff_mean', '{:.3f}')} | "
        f"resp_len {g('response_length/mean', '{:.0f}')} | "
        f"comm {_mb(m.get('comm/total_bytes'))} MB, {g('comm/total_ratio', '{:.4f}')} of dense "
        f"(run {g('comm/run_total_ratio', '{:.4f}')}) | "
        f"boundary {g('comm/bytes_ratio', '{:.4f}')} | "
        f"{g('timing_s/step', '{:.1f}')} s"
    )
    if m.get("anchor/fire"):
        line += (f" | anchor fire: {m.get('anchor/branch', '-')}, staleness {m.get('anchor/staleness', '-')}, "
                 f"sign agreement {g('anchor/sign_agreement')}")
    if "probe/kl_to_base" in m:  # the dense-view drift and the codec's gap (docs/training_health.md)
        line += (f" | probe: kl to base {g('probe/kl_to_base', '{:.2e}')}, "
                 f"view gap {g('probe/view_abs_logprob_diff', '{:.4f}')}")
    if "drift/action" in m:
        line += f" | drift: action {m['drift/action']:+d}, dense steps {m.get('drift/dense_steps', '-')}"
    return line
