#!/usr/bin/env python
"""The CPU study's report (issue 11): ``docs/study.md``, ``docs/study/summary.json`` and PNGs.

    python tools/study_report.py [STUDY_DIR] [--docs docs]
    python tools/study_report.py --show     # print the committed summary's table, write nothing
    python tools/study_report.py --show --run runs/smollm2_mawps_pcaq_every=2_lrq   # and that run's gain (make demo)
    python tools/study_report.py STUDY_DIR --progress   # a line per arm, running ones too; writes nothing

``STUDY_DIR`` (default ``$STUDY_DIR``, else ``/work/study-runs/study``) holds one folder per
arm and seed, as ``examples/study_cpu.sh`` writes them: ``metrics.jsonl`` and ``config.json``
from the trainer, ``study_arm.json`` (``{"arm", "seed", "codec", "anchor"}``) from the script.
A folder without ``study_arm.json`` takes its name as the arm and the rest from
``config.json``. Everything else is read from ``metrics.jsonl`` (the runs' own log):

============================ ================================================================
summary field                source in metrics.jsonl
============================ ================================================================
``iterations``               largest ``step`` of a training record (one with ``timing_s/step``)
``wall_s``                   sum of ``timing_s/step`` over training records + sum of
                             ``timing_s/eval`` over all records (an evaluation at a step is
                             timed apart from the step; seconds inside the run: model
                             loading and process start-up are not counted)
``train_s``, ``gen_s``       sums of ``timing_s/step`` and ``timing_s/gen`` over training
                             records: training time without the evaluations, and its
                             generation (every round of ``--filter-groups``)
``gen_rounds_mean``          mean ``batch/num_gen_batches`` over training records (generation
                             rounds an iteration, ``--filter-groups``); None without it
``acc_before``               ``val/holdout/acc`` of the step-0 record (before training)
``acc_after``                ``val/holdout/acc`` of the last record holding it at step
                             ``iterations`` > 0 (after training); None while unfinished (a run
                             stopped right after a ``--holdout-eval-interval`` evaluation would
                             read that one: unfinished runs, no ``DONE``, are left out)
``acc_before_stderr``,       their ``val/holdout/acc_stderr`` (sample std / sqrt(n),
``acc_stderr``               ``megatron_cegrpo.evaluation.DatasetResult.acc_stderr``)
``heldout_rows``             ``val/holdout/num_rows``
``gain``, ``gain_z``         ``acc_after - acc_before``; gain / sqrt(se_before^2 + se_after^2)
                             (unpaired: metrics.jsonl has no per-row scores; the paired error
                             is usually smaller, so this z is conservative)
``boundary_bytes_ratio``     sum over steps of ``comm/fwd_bytes + comm/bwd_bytes`` / sum of
                             ``comm/dense_equiv_bytes`` (the run's cumulative
                             ``comm/bytes_ratio``, stage boundaries only): over the run's OWN
                             dense equivalent, which a ``--shared-prefix`` run computes for its
                             packed (shared) messages
``boundary_mb``              sum over steps of ``comm/fwd_bytes + comm/bwd_bytes``, in 1e6 bytes:
                             what the arms compare in absolute terms
``truncated_before``,        ``val/holdout/response_length/clip_ratio`` at step 0 and at step
``truncated_after``          ``iterations``: the held-out greedy answers cut at
                             ``--eval-max-new-tokens`` (an answer cut before "The answer is N."
                             scores 0); the table's "truncated" column, before -> after
``resp_len_before``          ``val/holdout/response_length/mean`` at step 0: the base model's
                             greedy answers' mean length, a fingerprint of the arithmetic (two
                             runs that differ there ran other kernels and are not paired)
``lr``                       (not from the log) ``optim.lr`` of the run's ``config.json`` (``--lr``)
``launch_wall_s``            (not from the log) the sum of ``wall_seconds``, one line per
                             (re)start written by study_cpu.sh, start-up included; None
                             without that file
``other``                    ``{name: {acc_before, acc_after, acc_stderr, rows, gain_se_paired,
                             gain_z_paired}}`` for every other ``val/<name>/acc``
                             (``--eval-datasets``; the paired fields as below)
``anchor_lost_step``         first training step whose ``anchor/alive`` is 0 (the anchor rank
                             died and the stages trained on without the sign correction:
                             from there on the arm is not the arm it names); None if it never
                             happened or the arm has no anchor. The table says "lost at
                             step N" in the anchor column, and the report prints a warning
============================ ================================================================

Paired statistics (issue 33), from the run's per-row files, not from metrics.jsonl:
``eval_rows/<data set>-step<N>.jsonl`` in its log dir (``megatron_cegrpo.evaluation.rows``:
each row's 0/1 correctness keyed by its line in the data file), the files at step 0 and at
step ``iterations``. Each file is checked against metrics.jsonl (the same row count and
accuracy at that step) and the two must hold the same rows; a file that fails is one error
line naming it and the fix (:class:`~megatron_cegrpo.evaluation.EvalRowsError`). A run
without these files (every arm archived before issue 33) gets None and "n/a":

============================ ================================================================
summary field                source
============================ ================================================================
``per_row``                  the run holds both held-out files (:func:`run_rows`)
``gain_se_paired``,          per row d = after - before: sample std of d / sqrt(n), the
``gain_z_paired``            standard error of a mean of paired differences; gain / it
                             (:func:`paired_diff`)
``rows_gained``,             McNemar's discordant counts: rows wrong before and right after,
``rows_lost``                and the reverse
``vs_dense``                 ``{dense_seed, diff, se, z, rows, arm_only, dense_only}``: the
                             arm's after-evaluation against dense's at the same seed, per row
                             d = arm - dense (:func:`compare_with_dense`); None for dense
``variants``                 (top level) each arm against the arm it varies at the same seed,
                             e.g. ``dense_filter`` against ``dense``: gains, training time, gain
                             per hour, the paired after-difference, and where the base scored
                             the held-out rows at the variant's last iteration the two at equal
                             steps (``same_step``; :func:`compare_with_base`)
``fraction_of_dense``        (top level, one entry per arm) mean gain over the arm's seeds /
                             mean gain of dense at the same seeds, with a two-level percentile
                             bootstrap interval, seeds then rows (:func:`fractions_of_dense`,
                             :func:`bootstrap_fraction`; ``bootstrap`` says how it was drawn)
============================ ================================================================

Figures (one line per arm, raw values per step): ``reward.png`` (``critic/score/mean``),
``mismatch.png`` (``mismatch/abs_logprob_diff_mean``), ``fidelity_cos.png`` (the first
``fidelity/cos...`` key, when a run logged one), ``kl.png`` (``actor/kl_loss``),
``entropy.png`` (``actor/entropy``), ``kl_to_base.png`` (``probe/kl_to_base``),
``error_persistence.png`` (``codec/error_persistence``), ``heldout_curve.png`` (``val/holdout/acc``
per step, where a run scored the held-out rows between before and after: ``--holdout-eval-interval``)
and ``heldout_accuracy.png`` (before/after bars with standard-error whiskers). The panels are drawn by ``tools/plot_runs.py``.

The finished runs' small files (:data:`ARCHIVE_FILES`; finished: a ``DONE`` file, so an arm
still running is left out) are copied into ``<docs>/study/runs/<arm>-s<seed>/`` and the report
is drawn from those copies, so that the committed docs hold the evidence: run
folders live outside the checkout and do not survive a machine reset (the first two arms'
logs were lost that way on 2026-12-01). An arm that is in an earlier ``summary.json`` but has
neither a run folder nor an archived copy keeps its summary row (``logs_lost``: true) and has no
curves in the figures.

``docs/study.md`` gets the table and links the figures; the prose that interprets them
(what the evidence says about the seeds' claims) lives between the markers
``<!-- study:notes -->`` and ``<!-- /study:notes -->`` of an existing ``study.md`` and is
kept when the file is rewritten.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from megatron_cegrpo.evaluation import EvalRows

from megatron_cegrpo.bootstrap import bootstrap

_HERE = os.path.dirname(os.path.abspath(__file__))

#: Fields of each arm in summary.json, in this order (issue 11, "What to build" 3).
FIELDS = ("arm", "seed", "codec", "anchor", "iterations", "wall_s", "acc_before", "acc_after", "acc_stderr",
          "heldout_rows", "boundary_bytes_ratio")

#: (metric or metric prefix, title, y label, file stem); a prefix ends in "/".
STEP_PANELS = [  # (metric, title, y label, file stem, fewest points a run needs to be drawn)
    ("critic/score/mean", "Training reward", "mean verifier score", "reward", 1),
    ("mismatch/abs_logprob_diff_mean", "Train-inference mismatch", "nats / token", "mismatch", 1),
    ("fidelity/cos", "Gradient fidelity (cosine to the dense gradient)", "cosine", "fidelity_cos", 1),
    ("actor/kl_loss", "KL to the reference", "KL", "kl", 1),
    ("actor/entropy", "Entropy", "nats / token", "entropy", 1),
    ("probe/kl_to_base", "Drift: dense-view KL to the base model", "KL / token", "kl_to_base", 1),
    ("codec/error_persistence", "Codec error persistence (cosine of consecutive errors)", "cosine",
     "error_persistence", 1),
    # a curve only where a run scored the held-out rows between before and after (--holdout-eval-interval)
    ("val/holdout/acc", "Held-out greedy accuracy", "accuracy", "heldout_curve", 3),
]

NOTES_BEGIN, NOTES_END = "<!-- study:notes -->", "<!-- /study:notes -->"

#: A run's files copied into ``<docs>/study/runs/<folder>/`` (small: no checkpoints, no train.log),
#: with its per-row files ``eval_rows/*-step<N>.jsonl`` (about 6.7 kB per 300-row evaluation).
ARCHIVE_FILES = ("metrics.jsonl", "study_arm.json", "config.json", "wall_seconds", "DONE")

#: The arm every other arm is compared with, at the same seed.
DENSE_ARM = "dense"

#: ``--progress``: an unfinished arm whose ``metrics.jsonl`` and ``train.log`` were last written longer
#: ago than this (minutes) is idle: stopped, or queued behind the study's lock (set-up and a 300-row
#: evaluation write nothing for up to ~5 minutes here); ``PACE_STEPS``: its pace is the median
#: ``timing_s/step`` of its last steps
STALE_MIN = 15.0
PACE_STEPS = 8

#: The percentile bootstrap of each arm's fraction of dense's gain: resamples (the seeds, then the
#: held-out rows drawn with replacement, one draw shared by every run of the comparison) and the
#: seed of ``numpy.random.default_rng``.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0

NA = "n/a"


def _plot_runs():
    """tools/plot_runs.py as a module (its metrics reader and panel drawing)."""
    spec = importlib.util.spec_from_file_location("_plot_runs_for_study", os.path.join(_HERE, "plot_runs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_records(run_dir: str) -> List[dict]:
    """The parsable records of ``<run_dir>/metrics.jsonl`` in file order (a line cut short
    by a kill is skipped). FileNotFoundError when the file is missing."""
    from megatron_cegrpo.metrics import parse_record

    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path, encoding="utf-8", errors="replace") as f:
        return [r for r in (parse_record(ln) for ln in f if ln.strip()) if r is not None]


def _training_records(run_dir: str) -> Tuple[List[dict], List[dict], int]:
    """``(records, train, iterations)``: :func:`read_records`, those of them that are training steps
    (they carry ``timing_s/step``; evaluations and probes are records of their own) and the last
    training step logged (0 before the first)."""
    records = read_records(run_dir)
    train = [r for r in records if _num(r.get("timing_s/step")) is not None]
    return records, train, max((int(_num(r.get("step")) or 0) for r in train), default=0)


def _holdout_at(records: Sequence[dict], step: int, key: str) -> Optional[float]:
    """``val/holdout/<key>`` of the held-out evaluation at ``step`` (the last one logged there; None
    where it was not logged)."""
    v = [_num(r.get(f"val/holdout/{key}")) for r in records
         if "val/holdout/acc" in r and int(_num(r.get("step")) or 0) == step]
    return v[-1] if v else None


def _truncated_at(records: Sequence[dict], step: int) -> Optional[float]:
    """The share of held-out answers cut at ``--eval-max-new-tokens`` in the evaluation at ``step``
    (``val/holdout/response_length/clip_ratio``; None where it was not logged)."""
    return _holdout_at(records, step, "response_length/clip_ratio")


def _kl_to_base_by(train: Sequence[dict], step: float) -> Optional[Tuple[int, float]]:
    """``(its step, value)`` of the last ``probe/kl_to_base`` logged at or before ``step`` (the drift
    probe runs every ``--drift-probe-interval`` iterations); None before the first."""
    kl = [(int(_num(r.get("step")) or 0), _num(r.get("probe/kl_to_base"))) for r in train
          if _num(r.get("probe/kl_to_base")) is not None and int(_num(r.get("step")) or 0) <= step]
    return kl[-1] if kl else None


def _num(v) -> Optional[float]:
    from megatron_cegrpo.evaluation.summary import as_float

    x = as_float(v)
    return None if x is None or math.isnan(x) else x


def _identity(run_dir: str) -> Dict:
    """arm, seed, codec, anchor (and its c and K), commit of a run folder (study_arm.json, else
    config.json + folder name)."""
    info = {}
    p = os.path.join(run_dir, "study_arm.json")
    if os.path.isfile(p):
        with open(p, encoding="utf-8") as f:
            info = json.load(f)
    cfg = {}
    p = os.path.join(run_dir, "config.json")
    if os.path.isfile(p):
        with open(p, encoding="utf-8") as f:
            cfg = json.load(f)
    return {
        "arm": info.get("arm", os.path.basename(os.path.normpath(run_dir))),
        "seed": info.get("seed", cfg.get("optim", {}).get("seed")),
        "codec": info.get("codec", cfg.get("codec", {}).get("boundary_codec")),
        "anchor": bool(info.get("anchor", cfg.get("anchor", {}).get("anchor_ranks", 0))),
        # the anchor's cadence c (--anchor-interval) and delay K (--anchor-delay), iterations
        "anchor_interval": info.get("anchor_interval", cfg.get("anchor", {}).get("anchor_interval")),
        "anchor_delay": info.get("anchor_delay", cfg.get("anchor", {}).get("anchor_delay")),
        # the checkout study_cpu.sh ran (None for older folders); before 2026-12-06 an arm launched from a
        # git worktree imported the package of the venv's editable install, which may have been another checkout
        "commit": info.get("commit"),
        "host": info.get("host"),  # the CPU it ran on (lscpu's model name; None for older folders)
        "lr": cfg.get("optim", {}).get("lr"),  # --lr (config.json; an `_lr<X>` arm's differs from dense's)
    }


def _eval_points(records: Sequence[dict]) -> Dict[str, Dict[int, Tuple[float, Optional[float], Optional[int]]]]:
    """``{data set: {step: (acc, stderr, rows)}}`` from every ``val/<name>/acc`` (a later
    record of the same step wins)."""
    out: Dict[str, Dict[int, tuple]] = {}
    for r in records:
        step = int(_num(r.get("step")) or 0)
        for k, v in r.items():
            if k.startswith("val/") and k.endswith("/acc") and _num(v) is not None:
                name = k[4:-4]
                rows = _num(r.get(f"val/{name}/num_rows"))
                out.setdefault(name, {})[step] = (_num(v), _num(r.get(f"val/{name}/acc_stderr")),
                                                  None if rows is None else int(rows))
    return out


def _launch_wall(run_dir: str) -> Optional[float]:
    p = os.path.join(run_dir, "wall_seconds")
    if not os.path.isfile(p):
        return None
    with open(p, encoding="utf-8") as f:
        return float(sum(float(x) for x in f.read().split()))


def gain_z(acc_before: float, se_before: Optional[float], acc_after: float,
           se_after: Optional[float]) -> Tuple[float, Optional[float]]:
    """Held-out gain ``acc_after - acc_before`` (accuracies in [0, 1]) and its unpaired z,
    gain / sqrt(se_before^2 + se_after^2) (the standard error of a difference of two independent
    means; None when either error is missing, which taken as 0 would inflate z, or both are 0).
    Unpaired: it ignores that both evaluations score the same rows; the paired error
    (:func:`paired_diff`, from the per-row files) is usually smaller, so this z is conservative."""
    gain = acc_after - acc_before
    if se_before is None or se_after is None:
        return gain, None
    se = math.hypot(se_before, se_after)
    return gain, (gain / se if se > 0 else None)


def paired_diff(a: Dict[int, float], b: Dict[int, float]) -> Dict:
    """Paired comparison of two evaluations of the same rows: ``a`` and ``b`` map row id ->
    score in [0, 1] (0/1 for greedy). Per row d = a - b; returns ``{"diff": mean d, "se", "z",
    "rows": n, "a_only", "b_only"}``.

    ``se`` is the standard error of a mean of paired differences, sample std of d (n - 1) /
    sqrt(n) (the paired t statistic's denominator; for 0/1 scores the standard error of a
    difference of two dependent proportions, Agresti, *Categorical Data Analysis*, matched pairs,
    with n - 1 where Agresti has n, as ``DatasetResult.acc_stderr``); None for one row.
    ``z`` = diff / se (None when se is None or 0: every row moved alike). ``a_only`` / ``b_only``:
    McNemar's discordant counts (McNemar 1947), rows right (score 1) in ``a`` and wrong (0) in
    ``b`` and the reverse; None when a score is neither 0 nor 1 (avg@k). For 0/1 scores
    diff = (a_only - b_only) / n. Raises ValueError when the two hold different row ids or none."""
    if set(a) != set(b) or not a:
        raise ValueError(f"paired_diff needs the same, non-empty rows: {len(set(a) ^ set(b))} ids in only one "
                         f"of the two ({len(a)} and {len(b)} rows)")
    ids = sorted(a)
    d = [a[i] - b[i] for i in ids]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else None
    binary = all(a[i] in (0.0, 1.0) and b[i] in (0.0, 1.0) for i in ids)
    return {"diff": mean, "se": se, "z": mean / se if se else None, "rows": n,
            "a_only": sum(1 for i in ids if a[i] == 1 and b[i] == 0) if binary else None,
            "b_only": sum(1 for i in ids if a[i] == 0 and b[i] == 1) if binary else None}


def bootstrap_fraction(arm_gains: Sequence[Sequence[float]], dense_gains: Sequence[Sequence[float]],
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Dict:
    """An arm's mean held-out gain as a fraction of dense's at the same seeds, with a two-level
    percentile bootstrap interval (seeds, then rows).

    ``arm_gains``: one list per seed of the arm, each row's gain (after - before, in [-1, 1]);
    ``dense_gains`` the same for dense at the SAME seeds, in the same order (list i of both is
    seed i); every list covers the same n rows in the same order. Fraction = (mean over the seeds
    of the arm's mean gain) / (the same for dense).
    Interval: the percentile bootstrap (Efron and Tibshirani, *An Introduction to the
    Bootstrap*, 1993, ch. 13), two-level as for clustered data (Davison and Hinkley, *Bootstrap
    Methods and their Application*, 1997, section 3.8): ``resamples`` times, S seed indices are
    drawn with replacement and then n row indices (``numpy.random.default_rng(seed)``), the same
    draw for the arm and for dense (the seed's pair stays a pair), and the fraction is recomputed;
    the interval is the 2.5 % and 97.5 % order statistics of the sorted fractions (with 2000
    resamples the 51st and the 1950th). With one seed it reflects the rows only; with three the
    seed draw has 10 distinct outcomes, a coarse but honest view of the seed-to-seed spread. A
    resample where dense's mean gain is <= 0 has no fraction and counts as +inf (or -inf when the
    arm's gain is negative); their number is ``dense_nonpositive``.

    Returns ``{"fraction", "low", "high", "resamples", "seed", "dense_nonpositive"}``;
    ``fraction`` None when dense's mean gain is <= 0. Raises ValueError when a list is empty or
    the two differ in seeds or rows."""
    import numpy as np

    arm, dense = np.asarray(arm_gains, dtype=float), np.asarray(dense_gains, dtype=float)
    if arm.ndim != 2 or 0 in arm.shape or arm.shape != dense.shape:
        raise ValueError(f"bootstrap_fraction needs per-seed lists of the same rows at the same seeds, got "
                         f"shapes {arm.shape} and {dense.shape}")
    num_all, den_all = float(arm.mean()), float(dense.mean())
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, arm.shape[1], size=(resamples, arm.shape[1]))  # first: one seed draws as before
    seeds = rng.integers(0, arm.shape[0], size=(resamples, arm.shape[0]))
    pick = np.arange(resamples)[:, None]
    num = arm[:, rows][seeds, pick].mean(axis=2).mean(axis=1)   # arm[:, rows]: [S, R, n]; [seeds, pick]: [R, S, n]
    den = dense[:, rows][seeds, pick].mean(axis=2).mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num < 0, -np.inf, np.inf))
    frac.sort()
    lo, hi = frac[int(math.floor(0.025 * resamples))], frac[int(math.ceil(0.975 * resamples)) - 1]
    return {"fraction": num_all / den_all if den_all > 0 else None, "low": float(lo), "high": float(hi),
            "resamples": int(resamples), "seed": int(seed), "dense_nonpositive": int((den <= 0).sum())}


def _checked_rows(path: str, name: str, step: int, points: Dict) -> "EvalRows":
    """The per-row file ``path`` of data set ``name`` at ``step``, checked against the run's
    ``metrics.jsonl`` (``points``: :func:`_eval_points`): the same data set and step in its
    header, the same row count and accuracy as ``val/<name>/acc``. EvalRowsError otherwise."""
    from megatron_cegrpo.evaluation import EvalRowsError, read_eval_rows

    rows = read_eval_rows(path)
    fix = ("fix: put the run's own file there (from its log dir's eval_rows/), or delete it (the paired "
           "statistics are then shown as not available)")
    h = rows.header
    if h.get("eval") != name or h.get("step") != step:
        raise EvalRowsError(f"{path}: its header says data set {h.get('eval')!r} at step {h.get('step')}, its name "
                            f"{name!r} at step {step}; {fix}")
    logged = points.get(name, {}).get(step)
    if logged is None:
        raise EvalRowsError(f"{path}: the run's metrics.jsonl has no val/{name}/acc at step {step}, so these rows "
                            f"are not from this run; {fix}")
    acc, _, n = logged
    if n != rows.num_rows or abs(acc - rows.acc) > 1e-9:
        raise EvalRowsError(f"{path}: {rows.num_rows} rows at accuracy {rows.acc:.4f}, but the run's metrics.jsonl "
                            f"logs {n} rows at {acc:.4f} for val/{name} at step {step}: not this run's rows; {fix}")
    return rows


def run_rows(run_dir: str, points: Dict, iterations: int) -> Dict[str, Tuple["EvalRows", "EvalRows"]]:
    """``{data set: (rows before, rows after)}`` for every data set whose per-row files at step 0
    and at step ``iterations`` are both in ``<run_dir>/eval_rows/`` (``points``: the run's
    :func:`_eval_points`; {} for a run that kept none, as the archive's first arms). Each file is
    checked (:func:`_checked_rows`) and the two must hold the same rows. Raises EvalRowsError
    (one line naming the file and the fix) otherwise."""
    from megatron_cegrpo.evaluation import EvalRowsError, find_eval_rows

    files = find_eval_rows(run_dir)
    out = {}
    for name in sorted({n for n, _ in files}):
        if iterations <= 0 or (name, 0) not in files or (name, iterations) not in files:
            continue
        before = _checked_rows(files[(name, 0)], name, 0, points)
        after = _checked_rows(files[(name, iterations)], name, iterations, points)
        if (before.header.get("rows_digest") != after.header.get("rows_digest")
                or set(before.ids) != set(after.ids)):
            raise EvalRowsError(f"{after.path}: not the rows of {before.path} (rows digest "
                                f"{after.header.get('rows_digest')} vs {before.header.get('rows_digest')}): the "
                                f"evaluations before and after training must score the same rows; fix: put the "
                                f"run's own files there, or delete both")
        out[name] = (before, after)
    return out


def mid_rows(run_dir: str, points: Dict, iterations: int, before: "EvalRows") -> Dict[int, "EvalRows"]:
    """``{step: rows}`` of the held-out per-row files strictly between step 0 and ``iterations``
    (``--holdout-eval-interval``), each checked (:func:`_checked_rows`) and holding the rows of
    ``before`` (the file at step 0). Raises EvalRowsError otherwise."""
    from megatron_cegrpo.evaluation import find_eval_rows

    out = {}
    for (name, step), path in sorted(find_eval_rows(run_dir).items()):
        if name == "holdout" and 0 < step < iterations:
            out[step] = _checked_rows(path, name, step, points)
            _same_rows(out[step], before)
    return out


def summarize_run(run_dir: str, rows_out: Optional[Dict] = None, mid_out: Optional[Dict] = None) -> Dict:
    """One arm's summary (see the module docstring for each field's source). ``rows_out``: a
    dict that receives the run's checked per-row files, ``{data set: (before, after)}``
    (:func:`run_rows`), for the comparisons across arms; ``mid_out``: one that receives its held-out
    per-row files between the two, ``{step: EvalRows}`` (:func:`mid_rows`). Raises
    FileNotFoundError without a metrics.jsonl and EvalRowsError for a per-row file that is not the
    run's."""
    records, train, iterations = _training_records(run_dir)
    wall = sum(_num(r["timing_s/step"]) for r in train)
    wall += sum(_num(r.get("timing_s/eval")) or 0.0 for r in records)  # not inside timing_s/step
    wire = sum((_num(r.get("comm/fwd_bytes")) or 0.0) + (_num(r.get("comm/bwd_bytes")) or 0.0) for r in train)
    dense = sum(_num(r.get("comm/dense_equiv_bytes")) or 0.0 for r in train)
    evals = _eval_points(records)

    def before_after(name):
        pts = evals.get(name, {})
        b = pts.get(0)
        a = pts.get(iterations) if iterations > 0 else None
        return b, a

    out = dict(_identity(run_dir))
    # a fingerprint of the arithmetic (_after_against)
    out["resp_len_before"] = _holdout_at(records, 0, "response_length/mean")
    out.update(truncated_before=_truncated_at(records, 0),
               truncated_after=_truncated_at(records, iterations) if iterations > 0 else None)
    b, a = before_after("holdout")
    rounds = [_num(r.get("batch/num_gen_batches")) for r in train if _num(r.get("batch/num_gen_batches")) is not None]
    out.update(train_s=sum(_num(r["timing_s/step"]) for r in train),
               gen_s=sum(_num(r.get("timing_s/gen")) or 0.0 for r in train),
               gen_rounds_mean=sum(rounds) / len(rounds) if rounds else None)
    out.update(iterations=iterations, wall_s=wall,
               acc_before=b[0] if b else None, acc_after=a[0] if a else None,
               acc_stderr=a[1] if a else None, heldout_rows=(a or b)[2] if (a or b) else None,
               boundary_bytes_ratio=wire / dense if dense else None, boundary_mb=wire / 1e6 if train else None,
               acc_before_stderr=b[1] if b else None)
    if b and a:
        out["gain"], out["gain_z"] = gain_z(b[0], b[1], a[0], a[1])
    else:
        out["gain"] = out["gain_z"] = None
    rows = run_rows(run_dir, evals, iterations)
    if rows_out is not None:
        rows_out.update(rows)
    if mid_out is not None and "holdout" in rows:
        mid_out.update(mid_rows(run_dir, evals, iterations, rows["holdout"][0]))
    out.update(_paired_gain_fields("holdout", rows))
    other = {}
    for name in sorted(evals):
        if name == "holdout":
            continue
        ob, oa = before_after(name)
        other[name] = {"acc_before": ob[0] if ob else None, "acc_after": oa[0] if oa else None,
                       "acc_before_stderr": ob[1] if ob else None, "acc_stderr": oa[1] if oa else None,
                       "rows": (oa or ob)[2] if (oa or ob) else None}
        pf = _paired_gain_fields(name, rows)
        other[name].update(gain_se_paired=pf["gain_se_paired"], gain_z_paired=pf["gain_z_paired"])
    out["other"] = other
    lost = [int(_num(r.get("step")) or 0) for r in train if _num(r.get("anchor/alive")) == 0]
    out["anchor_lost_step"] = min(lost) if lost and out["anchor"] else None
    out.update(_damage(train))
    out["launch_wall_s"] = _launch_wall(run_dir)
    out["run_dir"] = os.path.abspath(run_dir)
    return out


def _damage(train: Sequence[dict]) -> Dict:
    """Damage to the base model (issue 33 item 6): the last ``probe/kl_to_base`` (its step) and the
    last ``actor/weight_rel_change``; None where the run logged none (no drift probe)."""
    kl = _kl_to_base_by(train, math.inf)
    moved = [_num(r.get("actor/weight_rel_change")) for r in train
             if _num(r.get("actor/weight_rel_change")) is not None]
    return {"kl_to_base": kl[1] if kl else None, "kl_to_base_step": kl[0] if kl else None,
            "weight_rel_change": moved[-1] if moved else None}


def _paired_gain_fields(name: str, rows: Dict) -> Dict:
    """``per_row``, ``gain_se_paired``, ``gain_z_paired``, ``rows_gained``, ``rows_lost`` of data set
    ``name`` from the run's per-row files (:func:`paired_diff` of after against before; each None,
    and ``per_row`` False, without them)."""
    if name not in rows:
        return {"per_row": False, "gain_se_paired": None, "gain_z_paired": None, "rows_gained": None,
                "rows_lost": None}
    before, after = rows[name]
    p = paired_diff(after.by_id(), before.by_id())
    return {"per_row": True, "gain_se_paired": p["se"], "gain_z_paired": p["z"], "rows_gained": p["a_only"],
            "rows_lost": p["b_only"]}


def archive_runs(run_dirs: Sequence[str], archive_dir: str) -> List[str]:
    """Copy each run's :data:`ARCHIVE_FILES` (those present) and its per-row files
    (``eval_rows/<data set>-step<N>.jsonl``, ``evaluation.find_eval_rows``) into
    ``archive_dir/<folder name>/``, replacing an older copy of the same folder; returns the
    copies' folders."""
    import shutil

    from megatron_cegrpo.evaluation import ROWS_DIR, find_eval_rows

    out = []
    for d in run_dirs:
        dst = os.path.join(archive_dir, os.path.basename(os.path.normpath(d)))
        if os.path.abspath(dst) == os.path.abspath(d):
            out.append(dst)
            continue
        os.makedirs(dst, exist_ok=True)
        for name in ARCHIVE_FILES:
            src = os.path.join(d, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(dst, name))
            elif os.path.exists(os.path.join(dst, name)):
                os.remove(os.path.join(dst, name))  # e.g. DONE of an older, finished copy
        rows = find_eval_rows(d)
        if os.path.isdir(os.path.join(dst, ROWS_DIR)):
            shutil.rmtree(os.path.join(dst, ROWS_DIR))  # an older copy's files
        if rows:
            os.makedirs(os.path.join(dst, ROWS_DIR))
            for src in rows.values():
                shutil.copyfile(src, os.path.join(dst, ROWS_DIR, os.path.basename(src)))
        out.append(dst)
    return out


def _same_rows(x, ref) -> None:
    """EvalRowsError unless the per-row files ``x`` and ``ref`` (EvalRows of two runs) hold the
    same rows (equal ``rows_digest`` and row ids)."""
    from megatron_cegrpo.evaluation import EvalRowsError

    if x.header.get("rows_digest") != ref.header.get("rows_digest") or set(x.ids) != set(ref.ids):
        raise EvalRowsError(f"{x.path}: rows digest {x.header.get('rows_digest')}, but {ref.path} has "
                            f"{ref.header.get('rows_digest')}: the two runs did not score the same held-out rows "
                            "(another --train-data, --num-holdout or --holdout-seed); fix: rerun the arm with the "
                            "study's data flags (examples/study_cpu.sh), or move it out of the study folder and "
                            "the archive")


def _after_against(a: Dict, other: str, rows: Dict, other_arm: Optional[Dict] = None) -> Optional[Dict]:
    """Arm ``a``'s held-out evaluation after training against arm ``other``'s at the same seed, on
    the same rows: :func:`paired_diff` (``diff`` = a - other, ``se``, ``z``, ``rows``, ``a_only``,
    ``b_only``); ``{"numerics_differ": n, "lengths_differ": bool}`` when the two evaluations BEFORE
    training (the same base weights, greedy) disagree on n rows, or score alike but their answers'
    mean length differs (``resp_len_before`` of ``a`` and ``other_arm``, that arm's summary, where
    both logged it): other arithmetic (bf16 kernels differ between CPUs), not paired measurements
    of one model. None where either run kept no per-row files. Raises EvalRowsError when their
    rows differ."""
    mine = rows.get((a["arm"], a["seed"]), {}).get("holdout")
    theirs = rows.get((other, a["seed"]), {}).get("holdout")
    if mine is None or theirs is None:
        return None
    _same_rows(mine[1], theirs[1])
    before_a, before_o = mine[0].by_id(), theirs[0].by_id()
    differ = sum(before_a[i] != before_o[i] for i in before_o)
    la, lo = a.get("resp_len_before"), (other_arm or {}).get("resp_len_before")
    lengths_differ = la is not None and lo is not None and abs(la - lo) > 1e-9
    if differ or lengths_differ:
        return {"numerics_differ": differ, "lengths_differ": lengths_differ}
    return paired_diff(mine[1].by_id(), theirs[1].by_id())


def _other_numerics(p: Optional[Dict]) -> bool:
    """Whether an :func:`_after_against` result (or a stored ``vs_dense``) found other arithmetic."""
    return bool(p) and bool(p.get("numerics_differ") or p.get("lengths_differ"))


def _numerics_cell(p: Dict) -> str:
    """The table cell of a comparison that :func:`_other_numerics` refused."""
    if p.get("numerics_differ"):
        return f"other numerics ({p['numerics_differ']} rows differ before training)"
    return "other numerics (answers before training differ in length)"


def base_arm(name: str, names) -> Optional[str]:
    """The arm that arm ``name`` varies by suffixes (``examples/study_cpu.sh``'s naming: ``<arm>_filter``,
    ``<arm>_dense16``, ``<arm>_controller``, ``<codec>_anchor``, ...): the longest prefix of ``name``
    ending before a ``_`` that is itself in ``names``; None when there is none (dense, a codec alone).
    ``dense_filter`` -> ``dense``, ``mask_anchor_dense16`` -> ``mask_anchor``, ``mask_anchor`` ->
    ``mask``, ``pcaq/every=2:lrq_anchor`` -> ``pcaq/every=2:lrq`` (where those arms exist)."""
    parts = str(name).split("_")
    for i in range(len(parts) - 1, 0, -1):
        cand = "_".join(parts[:i])
        if cand in names:
            return cand
    return None


def _gain_per_hour(arm: Dict) -> Optional[float]:
    """Held-out gain per hour of training steps (``train_s``); None without a training time."""
    return arm["gain"] / (arm["train_s"] / 3600.0) if arm.get("train_s") else None


def _against_base(p: Dict) -> Dict:
    """A variant's paired fields against its base from :func:`paired_diff`'s ``p`` (``a`` the variant)."""
    return {"diff": p["diff"], "se": p["se"], "z": p["z"], "rows": p["rows"], "arm_only": p["a_only"],
            "base_only": p["b_only"]}


def compare_with_base(arms: Sequence[Dict], rows: Dict, mids: Optional[Dict] = None) -> List[Dict]:
    """Each variant against the arm it varies (:func:`base_arm`) at the same seed: what a feature
    (``--filter-groups``, dense steps, the controller, the anchor, ...) buys at the same seed, on the
    same rows, and at what cost in training time (issue 33 item 2: dynamic sampling's effect on the
    held-out gain per wall-minute). One entry per (variant, seed) whose base finished at that seed:
    ``{"arm", "seed", "base", "gain", "base_gain", "train_s", "base_train_s", "gain_per_hour",
    "base_gain_per_hour", "gen_rounds_mean", "diff", "se", "z", "rows", "arm_only", "base_only",
    "numerics_differ", "lengths_differ", "same_step"}``: gains in accuracy (after - before),
    ``train_s`` the sum of ``timing_s/step`` (training only: the evaluations, the same in both, are
    left out), gain per hour of it, ``gen_rounds_mean`` the variant's mean ``batch/num_gen_batches``
    (None without dynamic sampling), the paired fields as :func:`_after_against` (None without
    per-row files; ``numerics_differ`` n, ``lengths_differ`` and the paired fields None when the two
    ran with other arithmetic). ``rows``: as in
    :func:`compare_with_dense`. ``same_step``: where the base ran longer and scored the held-out rows
    at the variant's last iteration (``mids``: ``{(arm, seed): {step: EvalRows}}``, :func:`mid_rows`),
    the variant's after against the base's at that step, ``{"step", "base_acc", "diff", "se", "z",
    "rows", "arm_only", "base_only"}`` (:func:`paired_diff`); else None: a variant that trains fewer
    steps (``--filter-groups`` in the same training time) is compared both at equal steps and at the
    base's end. Raises EvalRowsError when the two runs' rows differ."""
    finished = {(a["arm"], a["seed"]): a for a in arms if a.get("gain") is not None}
    names = {a["arm"] for a in arms}
    out = []
    for (name, seed), a in sorted(finished.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        base = base_arm(name, names)
        b = finished.get((base, seed)) if base else None
        if b is None:
            continue
        e = {"arm": name, "seed": seed, "base": base, "gain": a["gain"], "base_gain": b["gain"],
             "train_s": a.get("train_s"), "base_train_s": b.get("train_s"), "gain_per_hour": _gain_per_hour(a),
             "base_gain_per_hour": _gain_per_hour(b), "gen_rounds_mean": a.get("gen_rounds_mean"),
             "diff": None, "se": None, "z": None, "rows": None, "arm_only": None, "base_only": None,
             "numerics_differ": None, "lengths_differ": None, "same_step": None}
        p = None if a.get("logs_lost") or b.get("logs_lost") else _after_against(a, base, rows, b)
        if _other_numerics(p):
            e["numerics_differ"], e["lengths_differ"] = p["numerics_differ"], p["lengths_differ"]
        elif p:
            e.update(_against_base(p))
            at = (mids or {}).get((base, seed), {}).get(a.get("iterations"))
            if at is not None:
                mine = rows[(name, seed)]["holdout"][1]
                _same_rows(mine, at)
                q = paired_diff(mine.by_id(), at.by_id())
                e["same_step"] = {"step": a["iterations"], "base_acc": at.acc, **_against_base(q)}
        out.append(e)
    return out


def _dense_by_seed(arms: Sequence[Dict]) -> Dict[int, Dict]:
    """The dense control's run at each seed (``{seed: arm}``): what every comparison with dense pairs
    an arm with (:func:`compare_with_dense`, :func:`fractions_of_dense`, :func:`movement_vs_dense`)."""
    return {a["seed"]: a for a in arms if a["arm"] == DENSE_ARM}


def compare_with_dense(arms: Sequence[Dict], rows: Dict) -> None:
    """Set every arm's ``vs_dense``: its held-out accuracy after training against dense's at the
    same seed, on the same rows (:func:`paired_diff` of the two after-evaluations: ``diff`` =
    arm - dense, ``se``, ``z``, ``rows``, ``arm_only`` / ``dense_only`` right). None for dense
    itself and where either run kept no per-row files (an arm whose logs are lost keeps the value
    of the earlier summary). ``{"dense_seed", "numerics_differ": n, "lengths_differ"}`` instead when
    the two runs' evaluations BEFORE training (the same weights, greedy) disagree on n rows or in
    their answers' mean length (:func:`_after_against`): they ran with other arithmetic (bf16 on
    another CPU: AMX vs AVX512-BF16 kernels round differently), so their after-accuracies are not
    paired measurements of the same model. ``dense_iterations``: dense's iteration count, only where
    it is not the arm's (their after-evaluations are then at other steps; the table says so).
    ``rows``: ``{(arm, seed): {data
    set: (before, after)}}`` (:func:`run_rows`). Raises EvalRowsError when the two runs' rows differ."""
    dense_at = _dense_by_seed(arms)
    for a in arms:
        if a.get("logs_lost"):
            continue  # its row is kept as the earlier summary had it
        a["vs_dense"] = None
        d = dense_at.get(a["seed"])
        p = None if a["arm"] == DENSE_ARM else _after_against(a, DENSE_ARM, rows, d)
        if p is None:
            continue
        if _other_numerics(p):
            a["vs_dense"] = {"dense_seed": a["seed"], "numerics_differ": p["numerics_differ"],
                             "lengths_differ": p["lengths_differ"]}
            continue
        a["vs_dense"] = {"dense_seed": a["seed"], "diff": p["diff"], "se": p["se"], "z": p["z"], "rows": p["rows"],
                         "arm_only": p["a_only"], "dense_only": p["b_only"]}
        if d is not None and d.get("iterations") != a.get("iterations"):  # after-evaluations at other steps
            a["vs_dense"]["dense_iterations"] = d.get("iterations")


def fractions_of_dense(arms: Sequence[Dict], rows: Dict, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> List[Dict]:
    """For every arm other than dense with a finished seed: its mean held-out gain over its
    finished seeds as a fraction of dense's mean gain over THE SAME seeds (dense's carried arms
    included), ``{"arm", "seeds", "mean_gain", "dense_seeds", "dense_mean_gain", "fraction",
    "low", "high", "resamples", "bootstrap_seed", "dense_nonpositive", "left_out", "no_dense",
    "dense_iterations"}``.
    Matching the seeds keeps the comparison paired: dense's gain varies from seed to seed as much
    as the arms differ (+0.013 to +0.097 on the AMX host), so a one-seed arm over dense's mean of
    three would rank the seed, not the arm. A seed whose anchor was lost during the run
    (``anchor_lost_step``) does not measure the arm and is left out (``left_out``: those seeds), as
    is a seed dense has not finished (``no_dense``). ``fraction`` None without a dense mean gain
    > 0 at those seeds; the interval (:func:`bootstrap_fraction`: seeds, then rows) only with a
    fraction and when every one of those runs kept its held-out per-row files (``rows`` as in
    :func:`compare_with_dense`), else ``low``, ``high`` ... None. ``dense_iterations``: the seeds
    whose dense run trained another number of iterations than the arm's, ``{seed: dense's count}``
    (the gains are then at other steps; the table says so), else None. Raises EvalRowsError when
    the runs' rows differ."""
    dense_at = {seed: d for seed, d in _dense_by_seed(arms).items() if d.get("gain") is not None}
    out = []
    for name in sorted({a["arm"] for a in arms if a["arm"] != DENSE_ARM}):
        finished = [a for a in arms if a["arm"] == name and a.get("gain") is not None]
        kept = [a for a in finished if a.get("anchor_lost_step") is None]
        left_out = [a["seed"] for a in finished if a.get("anchor_lost_step") is not None]
        runs = [a for a in kept if a["seed"] in dense_at]
        no_dense = [a["seed"] for a in kept if a["seed"] not in dense_at]
        if not finished:
            continue  # (an arm whose every seed lost its anchor stays: its row names them)
        dense = [dense_at[a["seed"]] for a in runs]
        dense_gain = sum(a["gain"] for a in dense) / len(dense) if dense else None
        mean = sum(a["gain"] for a in runs) / len(runs) if runs else None
        e = {"arm": name, "seeds": [a["seed"] for a in runs], "left_out": left_out, "no_dense": no_dense,
             "mean_gain": mean,
             "dense_seeds": [a["seed"] for a in dense], "dense_mean_gain": dense_gain,
             "fraction": mean / dense_gain if dense_gain is not None and dense_gain > 0 else None,
             "low": None, "high": None, "resamples": None, "bootstrap_seed": None, "dense_nonpositive": None,
             "dense_iterations": {a["seed"]: d.get("iterations") for a, d in zip(runs, dense)
                                  if d.get("iterations") != a.get("iterations")} or None}
        got = [rows.get((a["arm"], a["seed"]), {}).get("holdout") for a in runs + dense]
        if e["fraction"] is not None and all(g is not None for g in got):
            for g in got[1:]:
                _same_rows(g[1], got[0][1])
            order = sorted(got[0][1].ids)
            gains = [[g[1].by_id()[i] - g[0].by_id()[i] for i in order] for g in got]
            b = bootstrap_fraction(gains[:len(runs)], gains[len(runs):], resamples, seed)
            e.update(low=b["low"], high=b["high"], resamples=b["resamples"], bootstrap_seed=b["seed"],
                     dense_nonpositive=b["dense_nonpositive"])
        out.append(e)
    return out


def _strict_json(v):
    """``v`` with every infinite float as the string ``"inf"`` / ``"-inf"`` and NaN as None, so that
    ``summary.json`` is JSON every parser reads (``json.dump`` writes ``Infinity`` otherwise, which
    jq and JavaScript refuse); the bootstrap's open interval ends are the infinities."""
    if isinstance(v, float):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else v
    if isinstance(v, dict):
        return {k: _strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict_json(x) for x in v]
    return v


def _carried_arms(summary_path: str, have: Sequence[Dict]) -> List[Dict]:
    """Arms of an earlier ``summary.json`` with no run folder and no archived copy now
    (``logs_lost``: true); [] without that file."""
    if not os.path.isfile(summary_path):
        return []
    with open(summary_path, encoding="utf-8") as f:
        old = json.load(f).get("arms", [])
    keys = {(a["arm"], a["seed"]) for a in have}
    out = [dict(a, logs_lost=True, run_dir=None) for a in old if (a["arm"], a["seed"]) not in keys]
    for a in out:  # a summary written before the paired statistics existed
        for k in ("gain_se_paired", "gain_z_paired", "rows_gained", "rows_lost", "vs_dense"):
            a.setdefault(k, None)
        a.setdefault("per_row", False)
        for o in a.get("other", {}).values():
            o.setdefault("gain_se_paired", None)
            o.setdefault("gain_z_paired", None)
    return out


def find_runs(study_dir: str) -> List[str]:
    """Sub-folders of ``study_dir`` holding a metrics.jsonl, sorted by name."""
    if not os.path.isdir(study_dir):
        raise FileNotFoundError(f"{study_dir}: no such study folder (run examples/study_cpu.sh first, or pass "
                                "the folder holding the arms)")
    return sorted(os.path.join(study_dir, d) for d in os.listdir(study_dir)
                  if os.path.isfile(os.path.join(study_dir, d, "metrics.jsonl")))


def _fmt(v, spec="{:.3f}") -> str:
    return "-" if v is None else spec.format(v)


def _anchor_cell(arm: Dict) -> str:
    if not arm["anchor"]:
        return "no"
    lost = arm.get("anchor_lost_step")
    c, k = arm.get("anchor_interval"), arm.get("anchor_delay")
    cad = None if c is None else (f"c = K = {c}" if c == k else f"c = {c}, K = {k}")
    if lost is None:
        return cad or "yes"
    return f"**lost at step {lost}**" if cad is None else f"{cad}, **lost at step {lost}**"


def table(arms: Sequence[Dict]) -> str:
    """The markdown table of ``arms``."""
    head = ("| arm | seed | codec | anchor | iters | wall (min) | held-out before | after | gain (z) | rows | "
            "boundary bytes (of its dense) | boundary MB | truncated |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in arms:
        lines.append(
            f"| {a['arm']} | {a['seed']} | {a['codec']} | {_anchor_cell(a)} | {a['iterations']} | "
            f"{a['wall_s'] / 60:.1f} | {_fmt(a['acc_before'])} ± {_fmt(a['acc_before_stderr'])} | "
            f"{_fmt(a['acc_after'])} ± {_fmt(a['acc_stderr'])} | {_fmt(a['gain'], '{:+.3f}')} "
            f"({_fmt(a['gain_z'], '{:+.1f}')}) | {_fmt(a['heldout_rows'], '{:d}')} | "
            f"{_fmt(a['boundary_bytes_ratio'], '{:.4f}')} | {_fmt(a.get('boundary_mb'), '{:.3g}')} | "
            f"{_truncated_cell(a)} |")
    return "\n".join(lines)


def _truncated_cell(arm: Dict) -> str:
    """The held-out greedy answers cut at the length limit, before -> after ("-": not logged)."""
    b, a = arm.get("truncated_before"), arm.get("truncated_after")
    return "-" if b is None and a is None else f"{_fmt(b, '{:.2f}')} -> {_fmt(a, '{:.2f}')}"


def plot_steps(run_dirs: Sequence[str], labels: Sequence[str], out_dir: str) -> List[str]:
    """One PNG per :data:`STEP_PANELS` entry that some run logged; returns the paths."""
    pr = _plot_runs()
    plt = pr._plt()
    runs = [(lab, pr.read_metrics(d)[0]) for d, lab in zip(run_dirs, labels)]
    written = []
    for key, title, ylabel, stem, fewest in STEP_PANELS:
        found = sorted({k for _, s in runs for k in s if k == key or k.startswith(key + "/")})
        # the runs with fewer points stay out of the panel (empty: each run keeps its colour)
        drawn = [(lab, s if len(s.get(found[0], ())) >= fewest else {}) for lab, s in runs] if found else []
        if not any(s for _, s in drawn):
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        pr._draw_panel(ax, drawn, found[0], title, ylabel, None)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def plot_accuracy(arms: Sequence[Dict], out_dir: str) -> Optional[str]:
    """Held-out accuracy before / after per arm, standard-error whiskers; None without data."""
    rows = [a for a in arms if a["acc_before"] is not None]
    if not rows:
        return None
    plt = _plot_runs()._plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.2))
    xs = range(len(rows))
    for off, key, se, lab in ((-0.2, "acc_before", "acc_before_stderr", "before"),
                              (0.2, "acc_after", "acc_stderr", "after")):
        have = [(x, a) for x, a in zip(xs, rows) if a[key] is not None]  # an unfinished arm has no bar
        ax.bar([x + off for x, _ in have], [a[key] for _, a in have], width=0.38,
               yerr=[a[se] or 0.0 for _, a in have], capsize=3, label=lab, error_kw={"lw": 0.8})
        for x, a in zip(xs, rows):
            if a[key] is None:
                ax.text(x + off, 0.005, "unfinished", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{a['arm']}\nseed {a['seed']}" for a in rows], fontsize=7)
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"Held-out accuracy ({rows[0]['heldout_rows']} rows), ± 1 standard error", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "heldout_accuracy.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _kept_title(md_path: str) -> Optional[str]:
    """The title (first line ``# ...``) of the report already at ``md_path``; None without one. A
    rewrite keeps it unless ``--title`` is given."""
    if not os.path.isfile(md_path):
        return None
    with open(md_path, encoding="utf-8") as f:
        first = f.readline().rstrip("\n")
    return first[2:] if first.startswith("# ") else None


def _kept_notes(md_path: str) -> str:
    if not os.path.isfile(md_path):
        return "(no interpretation written yet)"
    with open(md_path, encoding="utf-8") as f:
        text = f.read()
    if NOTES_BEGIN in text and NOTES_END in text:
        return text.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[0].strip("\n")
    return "(no interpretation written yet)"


def _cell(a: Dict, v, spec: str) -> str:
    """A paired cell of arm ``a``: "n/a" where the run kept no per-row files, else ``_fmt``."""
    return NA if not a.get("per_row") else _fmt(v, spec)


def paired_table(arms: Sequence[Dict]) -> str:
    """The markdown table of the paired statistics of ``arms`` (see ``method_lines``): the gain
    with its paired standard error, McNemar's counts, and the after-accuracy against dense's at
    the same seed. "n/a": the run kept no per-row files; "-": not applicable (dense against
    itself, an unfinished arm)."""
    head = ("| arm | seed | gain | paired SE | z paired | z unpaired | rows fixed / broken | "
            "after - dense's after | paired SE | z | rows right in arm only / dense only |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in arms:
        v = a.get("vs_dense")
        if a["arm"] == DENSE_ARM:
            vs = ["-"] * 4
        elif v is None:
            vs = [NA] * 4
        elif _other_numerics(v):
            vs = [_numerics_cell(v)] + ["-"] * 3
        else:
            at = f" (dense after {v['dense_iterations']} iterations)" if v.get("dense_iterations") is not None else ""
            vs = [_fmt(v["diff"], "{:+.3f}") + at, _fmt(v["se"]), _fmt(v["z"], "{:+.1f}"),
                  f"{_fmt(v['arm_only'], '{:d}')} / {_fmt(v['dense_only'], '{:d}')}"]
        counts = NA if not a.get("per_row") else f"{_fmt(a['rows_gained'], '{:d}')} / {_fmt(a['rows_lost'], '{:d}')}"
        cells = [str(a["arm"]), str(a["seed"]), _fmt(a.get("gain"), "{:+.3f}"),
                 _cell(a, a.get("gain_se_paired"), "{:.3f}"), _cell(a, a.get("gain_z_paired"), "{:+.1f}"),
                 _fmt(a.get("gain_z"), "{:+.1f}"), counts] + vs
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def movement_vs_dense(arm: Dict, arms: Sequence[Dict]) -> Optional[float]:
    """``arm``'s relative weight movement over dense's at the same seed and number of iterations
    (``weight_rel_change`` / dense's): above 1, the arm moved its weights further than dense (at the
    same ``--lr`` the anchor's every-step fold does: docs/anchor.md, "What the fold does to Adam"; an
    ``_lr<X>`` arm's ratio includes its other learning rate, its ``lr`` field). None without such a
    dense run or where either run logged no movement."""
    dense = _dense_by_seed(arms).get(arm["seed"])
    if (dense is None or dense.get("iterations") != arm.get("iterations") or not dense.get("weight_rel_change")
            or arm.get("weight_rel_change") is None):
        return None
    return arm["weight_rel_change"] / dense["weight_rel_change"]


def damage_table(arms: Sequence[Dict]) -> str:
    """Damage to the base model per arm: KL to the base at the last probe, the weights' relative
    movement at the end and over dense's at the same seed (:func:`movement_vs_dense`), the other data
    set before -> after ("-": not logged)."""
    others = sorted({n for a in arms for n in a["other"]})
    head = ("| arm | seed | KL to base (dense view, last probe) | at step | weight movement (relative) | "
            "movement / dense's (same seed) |")
    head += "".join(f" {n} before -> after |" for n in others)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in arms:
        cells = [a["arm"], str(a["seed"]), _fmt(a.get("kl_to_base"), "{:.2e}"), _fmt(a.get("kl_to_base_step"), "{:d}"),
                 _fmt(a.get("weight_rel_change"), "{:.2e}"), _fmt(movement_vs_dense(a, arms), "{:.2f}")]
        for n in others:
            o = a["other"].get(n)
            cells.append(f"{_fmt(o['acc_before'])} -> {_fmt(o['acc_after'])}" if o else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def variant_table(variants: Sequence[Dict]) -> str:
    """The markdown table of :func:`compare_with_base`: each variant against its base arm at the same
    seed ("n/a": a run kept no per-row files)."""
    head = ("| arm | seed | against | gain: arm / against | training min: arm / against | "
            "gain per training hour: arm / against | generation rounds / iteration | "
            "after - against's after | paired SE | z | rows right in arm only / against only | "
            "at the arm's last iteration: against's accuracy, after - it (paired SE, z) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for e in variants:
        st = e.get("same_step")
        same = ("-" if st is None else f"iteration {st['step']}: {st['base_acc']:.3f}, {st['diff']:+.3f} "
                f"({_fmt(st['se'])}, {_fmt(st['z'], '{:+.1f}')})")
        mins = [None if x is None else x / 60 for x in (e["train_s"], e["base_train_s"])]
        if _other_numerics(e):
            paired = [_numerics_cell(e), "-", "-", "-"]
        elif e["rows"] is None:
            paired = [NA] * 4
        else:
            paired = [_fmt(e["diff"], "{:+.3f}"), _fmt(e["se"]), _fmt(e["z"], "{:+.1f}"),
                      f"{_fmt(e['arm_only'], '{:d}')} / {_fmt(e['base_only'], '{:d}')}"]
        cells = [str(e["arm"]), str(e["seed"]), str(e["base"]),
                 f"{_fmt(e['gain'], '{:+.3f}')} / {_fmt(e['base_gain'], '{:+.3f}')}",
                 f"{_fmt(mins[0], '{:.1f}')} / {_fmt(mins[1], '{:.1f}')}",
                 f"{_fmt(e['gain_per_hour'], '{:+.3f}')} / {_fmt(e['base_gain_per_hour'], '{:+.3f}')}",
                 _fmt(e["gen_rounds_mean"], "{:.2f}")] + paired + [same]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fraction_table(fractions: Sequence[Dict]) -> str:
    """The markdown table of :func:`fractions_of_dense`: each arm's mean gain over its seeds as a
    fraction of dense's at the same seeds, with the bootstrap interval ("n/a" where a run kept no
    per-row files); the seeds left out (anchor lost, no dense run) are named, and so is a dense run of
    another iteration count."""
    head = ("| arm | seeds | mean gain | dense's mean gain (same seeds) | fraction of dense's gain | "
            "95 % interval |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for e in fractions:
        seeds = ", ".join(str(x) for x in e["seeds"])
        if e.get("left_out"):
            seeds += f" ({', '.join(str(x) for x in e['left_out'])} left out: anchor lost)"
        if e.get("no_dense"):
            seeds += f" ({', '.join(str(x) for x in e['no_dense'])} left out: no dense run)"
        seeds = seeds.strip()
        dense = (f"{_fmt(e['dense_mean_gain'], '{:+.3f}')} ({', '.join(str(x) for x in e['dense_seeds'])})"
                 if e["dense_seeds"] else "-")
        if e.get("dense_iterations"):
            dense += " (dense after " + ", ".join(f"{n} iterations at {s}" for s, n in
                                                 e["dense_iterations"].items()) + ")"
        ci = "-" if e["fraction"] is None else NA if e["low"] is None else f"{e['low']:.2f} to {e['high']:.2f}"
        lines.append(f"| {e['arm']} | {seeds} | {_fmt(e['mean_gain'], '{:+.3f}')} | {dense} | "
                     f"{_fmt(e['fraction'], '{:.2f}')} | {ci} |")
    return "\n".join(lines)


def method_lines() -> List[str]:
    """The method section of study.md: how each paired column is computed and where its data
    come from (the unpaired columns are described in the opening paragraph)."""
    return [
        "## Method", "",
        "Held-out accuracy: greedy pass@1 on the rows held out of the training file (`--num-holdout`, "
        "`--holdout-seed`: the same rows in every arm and seed), at step 0 and after the last step; ± is one "
        "standard error, sample std / sqrt(n). **gain (z)** in the first table: after - before, "
        "z = gain / sqrt(se_before^2 + se_after^2), unpaired: it ignores that both evaluations score the same "
        "rows, so it is usually conservative; it stays beside the paired z, and is all there is for the arms "
        "that kept no per-row data.", "",
        "The paired statistics use each run's per-row files (`eval_rows/holdout-step0.jsonl` and "
        "`eval_rows/holdout-step<N>.jsonl` in the run's log dir, archived with it: each held-out row's 0/1 "
        "correctness keyed by its line in the training file; about 6.7 kB per 300-row evaluation). **n/a**: "
        "the run kept none (every arm run before the per-row files existed).", "",
        "- **paired SE, z paired**: per row d = after - before; SE = sample std of d / sqrt(n), the standard "
        "error of a mean of paired differences; z paired = gain / SE. Smaller than the unpaired error when "
        "rows right before stay right after.",
        "- **rows fixed / broken**: McNemar's discordant counts, rows wrong before and right after, and the "
        "reverse; gain = (fixed - broken) / n.",
        "- **after - dense's after, paired SE, z**: the arm against dense at the same seed on the same rows, "
        "per row d = arm's after - dense's after, the same SE; **rows right in arm only / dense only**: "
        "McNemar's counts of that pair. **other numerics**: the two runs' evaluations before training (the same "
        "base weights, greedy) disagree on some rows, so they ran with other arithmetic (bf16 kernels differ "
        "between CPUs: AMX vs AVX512-BF16) and their after-accuracies are not paired; no test is made.",
        "- **fraction of dense's gain**: the arm's mean gain over its finished seeds divided by dense's mean "
        "gain at the same seeds (dense runs whose logs were lost included, from their summary rows); a seed "
        "dense has not run is left out and named. \"-\" when dense's mean gain at those seeds is not above 0. "
        "With one seed the fraction is that seed's ratio and swings with dense's gain there (where dense "
        "barely gained, any arm's fraction at that seed is large and its interval open). "
        "**95 % interval**: two-level percentile "
        f"bootstrap, {BOOTSTRAP_RESAMPLES} resamples: the seeds drawn with replacement (the arm's and dense's "
        "run at a seed drawn together), then the held-out rows "
        f"(`numpy.random.default_rng({BOOTSTRAP_SEED})`), one draw shared by every run of the comparison; the "
        "2.5 % and 97.5 % points of the resampled fractions (a resample in which dense did not gain counts "
        "as an infinite fraction, +inf, or -inf where the arm's resampled gain is below 0; `inf` in "
        "summary.json). With three seeds it covers the seed-to-seed spread coarsely (10 distinct "
        "seed draws) as well as the rows; n/a unless every one of those runs kept per-row files.",
        "- Other data sets: their lines add the paired SE and z of the gain where the run kept per-row files.",
        "",
    ]


def _summarize_archive(runs: Sequence[str], root: str, summary_path: str) -> Tuple[List[Dict], Dict, Dict]:
    """Every archived run summarized (:func:`summarize_run`) plus the carried arms of the earlier
    summary (:func:`_carried_arms`), sorted; the runs' per-row files by (arm, seed), and their
    held-out per-row files between before and after by (arm, seed)."""
    arms, rows, mids = [], {}, {}
    for d in runs:
        kept: Dict = {}
        mid: Dict = {}
        a = summarize_run(d, kept, mid)
        twin = next((b for b in arms if (b["arm"], b["seed"]) == (a["arm"], a["seed"])), None)
        if twin is not None:  # the comparisons key runs by (arm, seed): one would silently stand for both
            raise ValueError(f"{d}: arm {a['arm']!r} seed {a['seed']} again (also {twin['run_dir']}); fix: keep one "
                             "of the two runs in the study folder and the archive")
        mids[(a["arm"], a["seed"])] = mid
        a["run_dir"] = os.path.relpath(os.path.abspath(d), root)  # the archived copy, from the repo root
        a["logs_lost"] = False
        arms.append(a)
        rows[(a["arm"], a["seed"])] = kept
    arms += _carried_arms(summary_path, arms)
    arms.sort(key=lambda a: (str(a["arm"]), str(a["seed"])))
    return arms, rows, mids


#: the report's name (``<docs>/<name>.md``, ``<docs>/<name>/``) and title unless ``--name``/``--title`` say otherwise
DEFAULT_NAME, DEFAULT_TITLE = "study", "CPU study: does it learn? (issue 11)"


def write_report(study_dir: Optional[str], docs_dir: str, name: str = DEFAULT_NAME,
                 title: Optional[str] = None) -> Dict:
    """Archive every finished run under ``study_dir`` into ``<docs>/study/runs/`` (:func:`archive_runs`),
    summarize every archived run, carry the arms of the earlier ``summary.json`` whose logs are
    gone (:func:`_carried_arms`), compare every arm with dense on the same rows
    (:func:`compare_with_dense`, :func:`fractions_of_dense`) and write ``<docs>/study/summary.json``,
    the PNGs and ``<docs>/study.md`` (titled ``title``, else the existing report's title, else
    :data:`DEFAULT_TITLE`; its notes section is kept). Only finished arms (a ``DONE`` file, written by study_cpu.sh when the
    run exits cleanly) are archived: an arm still running or stopped is left out of the report
    (else its row, with no "after" value, would be committed and carried on). ``study_dir`` None
    or missing: the archive alone. Returns the summary dict plus ``unfinished`` (the live folders
    left out). Raises FileNotFoundError when there is no run at all and EvalRowsError (a
    ValueError; one line naming the file and the fix) for a per-row file that does not match its
    run or the rows of the arm it is compared with. ``name``: another study beside the first (its
    own ``<docs>/<name>.md`` and ``<docs>/<name>/``: e.g. the bf16 arms, a configuration of their own)."""
    out_dir = os.path.join(docs_dir, name)
    archive = os.path.join(out_dir, "runs")
    live = find_runs(study_dir) if study_dir and os.path.isdir(study_dir) else []
    unfinished = [d for d in live if not os.path.isfile(os.path.join(d, "DONE"))]
    live = [d for d in live if d not in unfinished]  # a running or stopped arm is not archived
    if live:
        archive_runs(live, archive)
    runs = find_runs(archive) if os.path.isdir(archive) else []
    root = os.path.dirname(os.path.abspath(docs_dir))
    arms, rows, mids = _summarize_archive(runs, root, os.path.join(out_dir, "summary.json"))
    if not arms:
        raise FileNotFoundError(f"{study_dir}: no arm folder with a metrics.jsonl (and nothing archived in {archive})")
    compare_with_dense(arms, rows)
    fractions = fractions_of_dense(arms, rows)
    variants = compare_with_base(arms, rows, mids)
    os.makedirs(out_dir, exist_ok=True)
    summary = {"study_dir": os.path.abspath(study_dir) if live else None, "archive": os.path.relpath(archive, root),
               "fields": list(FIELDS), "arms": arms, "fraction_of_dense": fractions,
               "variants": variants,
               "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED,
                             "interval": "percentile, 2.5 % and 97.5 %", "resampled": "seeds, then held-out rows",
                             "infinite": "a resample where dense's gain is <= 0: \"inf\" (\"-inf\" when the arm's is "
                                         "below 0)"}}
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(_strict_json(summary), f, indent=2, allow_nan=False)
        f.write("\n")
    drawn = [a for a in arms if not a["logs_lost"]]
    labels = [f"{a['arm']} s{a['seed']}" for a in drawn]
    figs = plot_steps([os.path.join(root, a["run_dir"]) for a in drawn], labels, out_dir)
    acc = plot_accuracy(arms, out_dir)
    figs += [acc] if acc else []
    md = os.path.join(docs_dir, f"{name}.md")
    title = title or _kept_title(md) or DEFAULT_TITLE
    lines = _report_lines(arms, fractions, figs, os.path.relpath(archive, docs_dir), _kept_notes(md), name, title,
                          variants)
    with open(md, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return dict(summary, unfinished=unfinished)


def _report_lines(arms: Sequence[Dict], fractions: Sequence[Dict], figs: Sequence[str], archive: str,
                  notes: str, name: str = DEFAULT_NAME, title: str = DEFAULT_TITLE,
                  variants: Sequence[Dict] = ()) -> List[str]:
    """The lines of ``<name>.md`` (``archive``: the archive folder relative to the docs folder;
    ``variants``: :func:`compare_with_base`'s entries, a section of their own when there are any)."""
    others = sorted({n for a in arms for n in a["other"]})
    lost = [f"{a['arm']} seed {a['seed']}" for a in arms if a["logs_lost"]]
    lines = [f"# {title}", "",
             "Written by `tools/study_report.py` from the arms' `metrics.jsonl`, archived in "
             f"`{archive}/` (runs of `examples/study_cpu.sh`). Held-out accuracy is "
             "greedy pass@1 on rows held out of the training file; ± is one standard error; the gain's z is "
             "unpaired (conservative). *boundary bytes (of its dense)*: the run's boundary bytes over the "
             "dense equivalent of its own messages (a `--shared-prefix` run's are the packed ones, so the "
             "ratio hides the sharing); *boundary MB*: the same bytes, forward + backward over the run, "
             "the column to compare across arms.", "", table(arms), ""]
    dead = [f"{a['arm']} seed {a['seed']} (step {a['anchor_lost_step']})" for a in arms
            if a.get("anchor_lost_step") is not None]
    if dead:
        lines += [f"Anchor lost during the run (`anchor/alive` 0; the stages went on without the sign correction, "
                  f"so these rows do not measure the arm they name after that step): {', '.join(dead)}.", ""]
    if lost:
        lines += [f"Logs lost (summary rows kept from the earlier summary.json, no curves in the figures): "
                  f"{', '.join(lost)}.", ""]
    for n in others:
        lines += [f"Other data set `{n}` (before -> after, ± se):", ""]
        for a in arms:
            o = a["other"].get(n)
            if o:
                paired = ("" if o.get("gain_se_paired") is None else f"; gain's paired SE "
                          f"{_fmt(o['gain_se_paired'])}, z {_fmt(o.get('gain_z_paired'), '{:+.1f}')}")
                lines.append(f"- {a['arm']} seed {a['seed']}: {_fmt(o['acc_before'])} ± "
                             f"{_fmt(o['acc_before_stderr'])} -> {_fmt(o['acc_after'])} ± {_fmt(o['acc_stderr'])} "
                             f"({_fmt(o['rows'], '{:d}')} rows{paired})")
        lines.append("")
    lines += ["## Paired statistics", "",
              "The same held-out rows before and after training, and against dense at the same seed "
              "(how each column is computed: Method, below).", "", paired_table(arms), "",
              "Each arm's mean gain as a fraction of dense's mean gain:", "", fraction_table(fractions), ""]
    if variants:
        lines += ["## Each variant against the arm it varies", "",
                  "An arm named `<arm>_<suffix>` (`_filter`, `_dense16`, `_controller`, ...; `<codec>_anchor` "
                  "against the codec alone) against `<arm>` at the same seed: what the feature adds to the held-out "
                  "gain, on the same rows, and what it costs in training time (the sum of `timing_s/step`, "
                  "evaluations left out; wall time on a shared machine varies, so read it beside the run's "
                  "`timing_s/*`). *generation rounds*: `batch/num_gen_batches` (`--filter-groups`). *At the arm's last "
                  "iteration*: where the arm it varies ran longer and scored the held-out rows at that iteration "
                  "(`--holdout-eval-interval`), the two at the same number of steps, paired on the same rows.", "",
                  variant_table(variants), ""]
    lines += ["## Damage to the base model", "",
              "KL(pi || pi_base) per response token on a training batch through dense boundaries "
              "(`probe/kl_to_base`, the drift probe of `--drift-probe-interval`), the weights' relative movement "
              "(`actor/weight_rel_change`; the seeds report 0.03-0.13 %) and over dense's at the same seed and "
              "iterations, and the other data set's accuracy.", "",
              damage_table(arms), ""]
    lines += method_lines()
    lines += ["## Figures", ""] + [f"![{os.path.basename(p)[:-4]}]({name}/{os.path.basename(p)})" for p in figs]
    lines += ["", "## What the evidence says", "", NOTES_BEGIN, notes, NOTES_END, ""]
    return lines


def show_summary(docs_dir: str, intro: bool = False, name: str = DEFAULT_NAME) -> str:
    """The table of the committed ``<docs>/<name>/summary.json`` (no run folder read, nothing
    written): what ``make demo`` prints after its short run; ``intro``: a line before it saying
    where the study lives and how many iterations its arms ran. Raises FileNotFoundError when
    the file is missing and ValueError (naming the file) when it is not a summary this tool wrote."""
    path = os.path.join(docs_dir, name, "summary.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist; fix: run tools/study_report.py on a study folder first")
    try:
        with open(path, encoding="utf-8") as f:
            arms = json.load(f)["arms"]
        text = table(arms)
        n = max((int(a.get("iterations") or 0) for a in arms), default=0)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a study summary ({type(e).__name__}: {e}); fix: rewrite it with "
                         "tools/study_report.py") from None
    if not intro:
        return text
    return (f"the study (docs/{name}.md; examples/study_cpu.sh, about an hour an arm here) ran {n} iterations "
            f"an arm, side by side:\n{text}")


def run_line(log_dir: str) -> str:
    """One line on a finished trainer run, from its ``<log_dir>/summary.json`` (``initial`` and
    ``final`` held-out evaluations, ``last_metrics.step``): accuracy before -> after ± one
    standard error, the gain, and whether it reaches 3 standard errors, issue 11's bar for
    "learns". With the run's per-row files of both evaluations (``eval_rows/holdout-step0.jsonl``
    and ``-step<N>.jsonl``, checked by :func:`run_rows`) the bar is the paired one (issue 33 item 7:
    :func:`paired_diff`'s standard error, rows fixed / broken), the unpaired z (:func:`gain_z`)
    beside it; without them the unpaired z alone. What ``make demo`` prints after its run.
    Raises FileNotFoundError when the run wrote no summary.json (it did not finish) and
    ValueError (naming the file) when it holds no held-out evaluation before and after, or
    per-row files that are not this run's (``EvalRowsError``)."""
    path = os.path.join(log_dir, "summary.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: the run did not finish; fix: see its log, rerun it")
    bad = f"{path} has no held-out evaluation before and after"
    try:
        with open(path, encoding="utf-8") as f:
            s = json.load(f)
    except ValueError as e:
        raise ValueError(f"{bad} ({type(e).__name__}: {e}); fix: rerun it") from None
    if isinstance(s, dict) and "final" in s and "initial" not in s:
        raise ValueError(f"{path} has no before-training evaluation: the run was resumed (--load), and a "
                         "resumed run evaluates only at its end; fix: compare with the first launch's log")
    try:
        b, a = s["initial"], s["final"]
        acc_b, se_b = float(b["val/holdout/acc"]), float(b["val/holdout/acc_stderr"])
        acc_a, se_a = float(a["val/holdout/acc"]), float(a["val/holdout/acc_stderr"])
        rows, iters = int(a["val/holdout/num_rows"]), int(s["last_metrics"]["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{bad} ({type(e).__name__}: {e}); fix: run with --num-holdout > 0") from None
    gain, z = gain_z(acc_b, se_b, acc_a, se_a)
    head = (f"this run ({log_dir}, {iters} iterations, {rows} held-out rows): {acc_b:.3f} ± {se_b:.3f} -> "
            f"{acc_a:.3f} ± {se_a:.3f}, gain {gain:+.3f}")
    per_row = run_rows(log_dir, _eval_points(read_records(log_dir)), iters) if os.path.isfile(
        os.path.join(log_dir, "metrics.jsonl")) else {}
    if "holdout" not in per_row:
        verdict = ("at least 3 standard errors" if z is not None and z >= 3 else
                   "below 3 standard errors, so not evidence of learning")
        return f"{head} (z {_fmt(z, '{:+.1f}')}, unpaired): {verdict}"
    before, after = per_row["holdout"]
    p = paired_diff(after.by_id(), before.by_id())
    verdict = ("at least 3 paired standard errors" if p["z"] is not None and p["z"] >= 3 else
               "below 3 paired standard errors, so not evidence of learning")
    return (f"{head} (paired SE {_fmt(p['se'])}, z {_fmt(p['z'], '{:+.1f}')}: {p['a_only']} rows fixed, "
            f"{p['b_only']} broken; unpaired z {_fmt(z, '{:+.1f}')}): {verdict}")


def progress(run_dir: str, now: Optional[float] = None) -> Dict:
    """Where one arm folder stands, finished or not (``--progress``; a run of 160 iterations spans
    sessions): ``{arm, seed, codec, iterations, train_iters, finished, state, idle_min, pace_s, eta_min,
    acc_before, truncated_before, train_min, heldout}``, where
    ``iterations`` is the last training step logged, ``train_iters`` the run's ``--train-iters``
    (config.json; None without it), ``finished`` whether study_cpu.sh wrote ``DONE``; ``state``
    ``finished``, ``running``, or ``idle`` when ``metrics.jsonl`` and ``train.log`` were last written
    more than :data:`STALE_MIN` minutes before ``now`` (default: the clock; ``idle_min``: minutes since;
    stopped, or waiting for the study's lock: the log says nothing while it waits);
    ``pace_s`` the median ``timing_s/step`` of the last :data:`PACE_STEPS` steps (None before a step),
    ``eta_min`` the training minutes left at that pace (None when finished or without ``train_iters``;
    evaluations not counted); ``acc_before``
    the held-out accuracy at step 0 (None before it is logged), ``train_min``
    the sum of ``timing_s/step`` in minutes, and ``heldout`` one entry per held-out evaluation after
    step 0, ``{step, acc, gain, se, z, fixed, broken, truncated, kl_to_base, kl_to_base_step}``: the
    gain over step 0 and, where both per-row files are in ``eval_rows/``, its paired standard error, z
    and McNemar counts (:func:`paired_diff`; None without them), the share of its answers cut at the
    length limit and the last drift probe's KL to the base at or before it (the two signs of a run
    that drifts: ``docs/study_bf16_amx_long.md``); ``truncated_before`` is step 0's share. Raises
    FileNotFoundError without a metrics.jsonl and EvalRowsError for a per-row file that is not the
    run's."""
    from megatron_cegrpo.evaluation import find_eval_rows

    records, train, iterations = _training_records(run_dir)
    cfg_path = os.path.join(run_dir, "config.json")
    train_iters = None
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            train_iters = json.load(f).get("optim", {}).get("train_iters")
    points = _eval_points(records).get("holdout", {})
    files = find_eval_rows(run_dir)
    before = (_checked_rows(files[("holdout", 0)], "holdout", 0, {"holdout": points})
              if ("holdout", 0) in files and 0 in points else None)
    heldout = []
    for step in sorted(t for t in points if t > 0):
        kl = _kl_to_base_by(train, step)
        entry = {"step": step, "acc": points[step][0], "gain": None, "se": None, "z": None,
                 "fixed": None, "broken": None, "truncated": _truncated_at(records, step),
                 "kl_to_base": kl[1] if kl else None, "kl_to_base_step": kl[0] if kl else None}
        if 0 in points:
            entry["gain"] = points[step][0] - points[0][0]
        if before is not None and ("holdout", step) in files:
            rows = _checked_rows(files[("holdout", step)], "holdout", step, {"holdout": points})
            _same_rows(rows, before)
            d = paired_diff(rows.by_id(), before.by_id())
            entry.update(se=d["se"], z=d["z"], fixed=d["a_only"], broken=d["b_only"])
        heldout.append(entry)
    ident = _identity(run_dir)
    finished = os.path.isfile(os.path.join(run_dir, "DONE"))
    written = max((os.path.getmtime(p) for p in (os.path.join(run_dir, n) for n in ("metrics.jsonl", "train.log"))
                   if os.path.isfile(p)), default=0.0)
    idle_min = max(0.0, ((time.time() if now is None else now) - written) / 60.0)
    paces = [_num(r["timing_s/step"]) for r in train[-PACE_STEPS:]]
    pace_s = statistics.median(paces) if paces else None
    eta_min = (None if finished or train_iters is None or pace_s is None
               else max(0, train_iters - iterations) * pace_s / 60.0)
    return {"arm": ident["arm"], "seed": ident["seed"], "codec": ident["codec"], "iterations": iterations,
            "train_iters": train_iters, "finished": finished,
            "state": "finished" if finished else ("idle" if idle_min > STALE_MIN else "running"),
            "idle_min": idle_min, "pace_s": pace_s, "eta_min": eta_min,
            "acc_before": points.get(0, (None,))[0], "truncated_before": _truncated_at(records, 0),
            "train_min": sum(_num(r["timing_s/step"]) for r in train) / 60.0, "heldout": heldout}


def progress_line(run_dir: str) -> str:
    """:func:`progress` as one line: ``dense s1234: 57/160 iterations (running, 94.4 min of training left at
    55 s an iteration), 58.3 min of training; held-out 0.077 at 0 (cut 0.31), 0.150 at 40 (+0.073, paired SE
    0.021, z +3.5: 32 fixed, 10 broken; cut 0.17; KL to base 0.108 at 40)`` (cut: the share of answers cut at
    the length limit); ``(no output for 42 min: stopped, or waiting for the study's lock)`` for an idle
    arm (a stopped one resumes when its study is rerun)."""
    p = progress(run_dir)
    total = "?" if p["train_iters"] is None else p["train_iters"]
    state = p["state"]
    if state == "idle":
        state = f"no output for {p['idle_min']:.0f} min: stopped, or waiting for the study's lock"
    elif state == "running" and p["eta_min"] is not None:
        state += f", {p['eta_min']:.1f} min of training left at {p['pace_s']:.0f} s an iteration"
    parts = [f"{p['arm']} s{p['seed']}: {p['iterations']}/{total} iterations ({state}), "
             f"{p['train_min']:.1f} min of training"]
    evals = [] if p["acc_before"] is None else [f"{p['acc_before']:.3f} at 0" + (
        "" if p["truncated_before"] is None else f" (cut {p['truncated_before']:.2f})")]
    for e in p["heldout"]:
        text = f"{e['acc']:.3f} at {e['step']}"
        notes = []
        if e["gain"] is not None:
            note = f"{e['gain']:+.3f}"
            if e["se"] is not None:
                note += (f", paired SE {_fmt(e['se'])}, z {_fmt(e['z'], '{:+.1f}')}: {e['fixed']} fixed, "
                         f"{e['broken']} broken")
            notes.append(note)
        if e["truncated"] is not None:
            notes.append(f"cut {e['truncated']:.2f}")
        if e["kl_to_base"] is not None:
            notes.append(f"KL to base {e['kl_to_base']:.3g} at {e['kl_to_base_step']}")
        evals.append(text + (f" ({'; '.join(notes)})" if notes else ""))
    if evals:
        parts.append("held-out " + ", ".join(evals))
    return "; ".join(parts)


def main(argv=None) -> int:
    bootstrap()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study_dir", nargs="?", default=os.environ.get("STUDY_DIR", "/work/study-runs/study"),
                   help="folder of live arm folders to archive first (missing: the archive in docs/study/runs alone)")
    p.add_argument("--docs", default=os.path.join(os.path.dirname(_HERE), "docs"), help="docs folder to write")
    p.add_argument("--name", default=DEFAULT_NAME,
                   help="the study's name: writes <docs>/<name>.md and <docs>/<name>/ (default: study)")
    p.add_argument("--title", default=None,
                   help=f"the report's title (default: the existing report's, else {DEFAULT_TITLE!r})")
    p.add_argument("--show", action="store_true",
                   help="print the table of the committed <docs>/<name>/summary.json, after a line saying which "
                        "study it is, and exit (reads no run, writes nothing)")
    p.add_argument("--run", metavar="LOG_DIR",
                   help="with --show: first a line on that finished trainer run (its summary.json): held-out "
                        "accuracy before -> after, gain and z")
    p.add_argument("--progress", action="store_true",
                   help="print one line per arm folder in STUDY_DIR, finished or not (iterations done; running, "
                        "with the training minutes left, or idle; every held-out evaluation so far with its "
                        "paired gain, answers cut at the length limit and KL to the base), and exit (writes nothing)")
    args = p.parse_args(argv)
    if args.progress:
        try:
            dirs = find_runs(args.study_dir)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        rc = 0
        for d in dirs:  # one arm's unreadable file is that arm's line; the others still print
            try:
                print(progress_line(d))
            except (OSError, ValueError) as e:  # ValueError: a bad config.json, evaluation.EvalRowsError
                print(f"error: {os.path.basename(d)}: {e}", file=sys.stderr)
                rc = 2
        return rc
    if args.run and not args.show:
        p.error("--run goes with --show (e.g. --show --run runs/smollm2_mawps_pcaq_every=2_lrq)")
    if args.show:
        rc = 0
        if args.run:
            try:
                print(run_line(args.run))
            except (FileNotFoundError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                rc = 2
        try:
            print(show_summary(args.docs, intro=True, name=args.name))
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return rc
    try:
        s = write_report(args.study_dir, args.docs, args.name, args.title)
    except (FileNotFoundError, ValueError) as e:  # ValueError: evaluation.EvalRowsError, a per-row file
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(s["arms"]))
    for d in s["unfinished"]:
        print(f"skipped {d}: unfinished (no DONE file); rerun examples/study_cpu.sh to finish it", file=sys.stderr)
    for a in s["arms"]:
        if a.get("anchor_lost_step") is not None:
            print(f"warning: {a['arm']} seed {a['seed']}: the anchor was lost at step {a['anchor_lost_step']} "
                  "(anchor/alive 0); its row does not measure the arm it names after that step", file=sys.stderr)
    print(f"wrote {os.path.join(args.docs, args.name + '.md')} and "
          f"{os.path.join(args.docs, args.name, 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
