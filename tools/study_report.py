#!/usr/bin/env python
"""The CPU study's report (issue 11): ``docs/study.md``, ``docs/study/summary.json`` and PNGs.

    python tools/study_report.py [STUDY_DIR] [--docs docs]
    python tools/study_report.py --show     # print the committed summary's table, write nothing
    python tools/study_report.py --show --run runs/smollm2_mawps_mask   # and that run's gain (make demo)

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
``acc_before``               ``val/holdout/acc`` of the step-0 record (before training)
``acc_after``                ``val/holdout/acc`` of the last record holding it at step
                             ``iterations`` > 0 (after training); None while unfinished
``acc_before_stderr``,       their ``val/holdout/acc_stderr`` (sample std / sqrt(n),
``acc_stderr``               ``megatron_cegrpo.evaluation.DatasetResult.acc_stderr``)
``heldout_rows``             ``val/holdout/num_rows``
``gain``, ``gain_z``         ``acc_after - acc_before``; gain / sqrt(se_before^2 + se_after^2)
                             (unpaired: the log has no per-row scores; the paired error is
                             smaller, so this z is conservative)
``boundary_bytes_ratio``     sum over steps of ``comm/fwd_bytes + comm/bwd_bytes`` / sum of
                             ``comm/dense_equiv_bytes`` (the run's cumulative
                             ``comm/bytes_ratio``, stage boundaries only)
``launch_wall_s``            (not from the log) the sum of ``wall_seconds``, one line per
                             (re)start written by study_cpu.sh, start-up included; None
                             without that file
``other``                    ``{name: {acc_before, acc_after, acc_stderr, rows}}`` for every
                             other ``val/<name>/acc`` (``--eval-datasets``)
``anchor_lost_step``         first training step whose ``anchor/alive`` is 0 (the anchor rank
                             died and the stages trained on without the sign correction:
                             from there on the arm is not the arm it names); None if it never
                             happened or the arm has no anchor. The table says "lost at
                             step N" in the anchor column, and the report prints a warning
============================ ================================================================

Figures (one line per arm, raw values per step): ``reward.png`` (``critic/score/mean``),
``mismatch.png`` (``mismatch/abs_logprob_diff_mean``), ``fidelity_cos.png`` (the first
``fidelity/cos...`` key, when a run logged one), ``kl.png`` (``actor/kl_loss``),
``entropy.png`` (``actor/entropy``) and ``heldout_accuracy.png`` (before/after bars with
standard-error whiskers). The panels are drawn by ``tools/plot_runs.py``.

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
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_cegrpo.bootstrap import bootstrap

_HERE = os.path.dirname(os.path.abspath(__file__))

#: Fields of each arm in summary.json, in this order (issue 11, "What to build" 3).
FIELDS = ("arm", "seed", "codec", "anchor", "iterations", "wall_s", "acc_before", "acc_after", "acc_stderr",
          "heldout_rows", "boundary_bytes_ratio")

#: (metric or metric prefix, title, y label, file stem); a prefix ends in "/".
STEP_PANELS = [
    ("critic/score/mean", "Training reward", "mean verifier score", "reward"),
    ("mismatch/abs_logprob_diff_mean", "Train-inference mismatch", "nats / token", "mismatch"),
    ("fidelity/cos", "Gradient fidelity (cosine to the dense gradient)", "cosine", "fidelity_cos"),
    ("actor/kl_loss", "KL to the reference", "KL", "kl"),
    ("actor/entropy", "Entropy", "nats / token", "entropy"),
]

NOTES_BEGIN, NOTES_END = "<!-- study:notes -->", "<!-- /study:notes -->"

#: A run's files copied into ``<docs>/study/runs/<folder>/`` (small: no checkpoints, no train.log).
ARCHIVE_FILES = ("metrics.jsonl", "study_arm.json", "config.json", "wall_seconds", "DONE")


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


def _num(v) -> Optional[float]:
    from megatron_cegrpo.evaluation.summary import as_float

    x = as_float(v)
    return None if x is None or math.isnan(x) else x


def _identity(run_dir: str) -> Dict:
    """arm, seed, codec, anchor, commit of a run folder (study_arm.json, else config.json + folder name)."""
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
        "commit": info.get("commit"),  # the checkout study_cpu.sh ran (None for older folders)
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
    gain / sqrt(se_before^2 + se_after^2) (None when both errors are 0 or missing). Unpaired:
    the logs keep no per-row scores, and the paired error is smaller, so the z is conservative."""
    se = math.hypot(se_before or 0.0, se_after or 0.0)
    gain = acc_after - acc_before
    return gain, (gain / se if se > 0 else None)


def summarize_run(run_dir: str) -> Dict:
    """One arm's summary (see the module docstring for each field's source)."""
    records = read_records(run_dir)
    train = [r for r in records if _num(r.get("timing_s/step")) is not None]
    iterations = max((int(_num(r.get("step")) or 0) for r in train), default=0)
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
    b, a = before_after("holdout")
    out.update(iterations=iterations, wall_s=wall,
               acc_before=b[0] if b else None, acc_after=a[0] if a else None,
               acc_stderr=a[1] if a else None, heldout_rows=(a or b)[2] if (a or b) else None,
               boundary_bytes_ratio=wire / dense if dense else None,
               acc_before_stderr=b[1] if b else None)
    if b and a:
        out["gain"], out["gain_z"] = gain_z(b[0], b[1], a[0], a[1])
    else:
        out["gain"] = out["gain_z"] = None
    other = {}
    for name in sorted(evals):
        if name == "holdout":
            continue
        ob, oa = before_after(name)
        other[name] = {"acc_before": ob[0] if ob else None, "acc_after": oa[0] if oa else None,
                       "acc_before_stderr": ob[1] if ob else None, "acc_stderr": oa[1] if oa else None,
                       "rows": (oa or ob)[2] if (oa or ob) else None}
    out["other"] = other
    lost = [int(_num(r.get("step")) or 0) for r in train if _num(r.get("anchor/alive")) == 0]
    out["anchor_lost_step"] = min(lost) if lost and out["anchor"] else None
    out["launch_wall_s"] = _launch_wall(run_dir)
    out["run_dir"] = os.path.abspath(run_dir)
    return out


def archive_runs(run_dirs: Sequence[str], archive_dir: str) -> List[str]:
    """Copy each run's :data:`ARCHIVE_FILES` (those present) into ``archive_dir/<folder name>/``,
    replacing an older copy of the same folder; returns the copies' folders."""
    import shutil

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
        out.append(dst)
    return out


def _carried_arms(summary_path: str, have: Sequence[Dict]) -> List[Dict]:
    """Arms of an earlier ``summary.json`` with no run folder and no archived copy now
    (``logs_lost``: true); [] without that file."""
    if not os.path.isfile(summary_path):
        return []
    with open(summary_path, encoding="utf-8") as f:
        old = json.load(f).get("arms", [])
    keys = {(a["arm"], a["seed"]) for a in have}
    return [dict(a, logs_lost=True, run_dir=None) for a in old if (a["arm"], a["seed"]) not in keys]


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
    return "yes" if lost is None else f"**lost at step {lost}**"


def table(arms: Sequence[Dict]) -> str:
    """The markdown table of ``arms``."""
    head = ("| arm | seed | codec | anchor | iters | wall (min) | held-out before | after | gain (z) | rows | "
            "boundary bytes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in arms:
        lines.append(
            f"| {a['arm']} | {a['seed']} | {a['codec']} | {_anchor_cell(a)} | {a['iterations']} | "
            f"{a['wall_s'] / 60:.1f} | {_fmt(a['acc_before'])} ± {_fmt(a['acc_before_stderr'])} | "
            f"{_fmt(a['acc_after'])} ± {_fmt(a['acc_stderr'])} | {_fmt(a['gain'], '{:+.3f}')} "
            f"({_fmt(a['gain_z'], '{:+.1f}')}) | {_fmt(a['heldout_rows'], '{:d}')} | "
            f"{_fmt(a['boundary_bytes_ratio'], '{:.4f}')} |")
    return "\n".join(lines)


def plot_steps(run_dirs: Sequence[str], labels: Sequence[str], out_dir: str) -> List[str]:
    """One PNG per :data:`STEP_PANELS` entry that some run logged; returns the paths."""
    pr = _plot_runs()
    plt = pr._plt()
    runs = [(lab, pr.read_metrics(d)[0]) for d, lab in zip(run_dirs, labels)]
    written = []
    for key, title, ylabel, stem in STEP_PANELS:
        found = sorted({k for _, s in runs for k in s if k == key or k.startswith(key + "/")})
        if not found:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        pr._draw_panel(ax, runs, found[0], title, ylabel, None)
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


def _kept_notes(md_path: str) -> str:
    if not os.path.isfile(md_path):
        return "(no interpretation written yet)"
    with open(md_path, encoding="utf-8") as f:
        text = f.read()
    if NOTES_BEGIN in text and NOTES_END in text:
        return text.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[0].strip("\n")
    return "(no interpretation written yet)"


def write_report(study_dir: Optional[str], docs_dir: str) -> Dict:
    """Archive every finished run under ``study_dir`` into ``<docs>/study/runs/`` (:func:`archive_runs`),
    summarize every archived run, carry the arms of the earlier ``summary.json`` whose logs are
    gone (:func:`_carried_arms`), and write ``<docs>/study/summary.json``, the PNGs and
    ``<docs>/study.md``. Only finished arms (a ``DONE`` file, written by study_cpu.sh when the
    run exits cleanly) are archived: an arm still running or stopped is left out of the report
    (else its row, with no "after" value, would be committed and carried on). ``study_dir`` None
    or missing: the archive alone. Returns the summary dict plus ``unfinished`` (the live folders
    left out). Raises FileNotFoundError when there is no run at all."""
    out_dir = os.path.join(docs_dir, "study")
    archive = os.path.join(out_dir, "runs")
    live = find_runs(study_dir) if study_dir and os.path.isdir(study_dir) else []
    unfinished = [d for d in live if not os.path.isfile(os.path.join(d, "DONE"))]
    live = [d for d in live if d not in unfinished]  # a running or stopped arm is not archived
    if live:
        archive_runs(live, archive)
    runs = find_runs(archive) if os.path.isdir(archive) else []
    root = os.path.dirname(os.path.abspath(docs_dir))
    arms = []
    for d in runs:
        a = summarize_run(d)
        a["run_dir"] = os.path.relpath(os.path.abspath(d), root)  # the archived copy, from the repo root
        a["logs_lost"] = False
        arms.append(a)
    arms += _carried_arms(os.path.join(out_dir, "summary.json"), arms)
    if not arms:
        raise FileNotFoundError(f"{study_dir}: no arm folder with a metrics.jsonl (and nothing archived in {archive})")
    arms.sort(key=lambda a: (str(a["arm"]), str(a["seed"])))
    os.makedirs(out_dir, exist_ok=True)
    summary = {"study_dir": os.path.abspath(study_dir) if live else None, "archive": os.path.relpath(archive, root),
               "fields": list(FIELDS), "arms": arms}
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    drawn = [a for a in arms if not a["logs_lost"]]
    labels = [f"{a['arm']} s{a['seed']}" for a in drawn]
    figs = plot_steps([os.path.join(root, a["run_dir"]) for a in drawn], labels, out_dir)
    acc = plot_accuracy(arms, out_dir)
    figs += [acc] if acc else []
    md = os.path.join(docs_dir, "study.md")
    notes = _kept_notes(md)
    others = sorted({n for a in arms for n in a["other"]})
    lost = [f"{a['arm']} seed {a['seed']}" for a in arms if a["logs_lost"]]
    lines = ["# CPU study: does it learn? (issue 11)", "",
             "Written by `tools/study_report.py` from the arms' `metrics.jsonl`, archived in "
             f"`{os.path.relpath(archive, docs_dir)}/` (runs of `examples/study_cpu.sh`). Held-out accuracy is "
             "greedy pass@1 on rows held out of the training file; ± is one standard error; the gain's z is "
             "unpaired (conservative).", "", table(arms), ""]
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
                lines.append(f"- {a['arm']} seed {a['seed']}: {_fmt(o['acc_before'])} ± "
                             f"{_fmt(o['acc_before_stderr'])} -> {_fmt(o['acc_after'])} ± {_fmt(o['acc_stderr'])} "
                             f"({_fmt(o['rows'], '{:d}')} rows)")
        lines.append("")
    lines += ["## Figures", ""] + [f"![{os.path.basename(p)[:-4]}](study/{os.path.basename(p)})" for p in figs]
    lines += ["", "## What the evidence says", "", NOTES_BEGIN, notes, NOTES_END, ""]
    with open(md, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return dict(summary, unfinished=unfinished)


def show_summary(docs_dir: str, intro: bool = False) -> str:
    """The table of the committed ``<docs>/study/summary.json`` (no run folder read, nothing
    written): what ``make demo`` prints after its short run; ``intro``: a line before it saying
    where the study lives and how many iterations its arms ran. Raises FileNotFoundError when
    the file is missing and ValueError (naming the file) when it is not a summary this tool wrote."""
    path = os.path.join(docs_dir, "study", "summary.json")
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
    return (f"the study (docs/study.md; examples/study_cpu.sh, about an hour an arm here) ran {n} iterations "
            f"an arm, side by side:\n{text}")


def run_line(log_dir: str) -> str:
    """One line on a finished trainer run, from its ``<log_dir>/summary.json`` (``initial`` and
    ``final`` held-out evaluations, ``last_metrics.step``): accuracy before -> after ± one
    standard error, the gain and its unpaired z (:func:`gain_z`), and whether the gain reaches 3
    standard errors, issue 11's bar for "learns". What ``make demo`` prints after its run.
    Raises FileNotFoundError when the run wrote no summary.json (it did not finish) and
    ValueError (naming the file) when it holds no held-out evaluation before and after."""
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
    verdict = ("at least 3 standard errors" if z is not None and z >= 3 else
               "below 3 standard errors, so not evidence of learning")
    return (f"this run ({log_dir}, {iters} iterations, {rows} held-out rows): {acc_b:.3f} ± {se_b:.3f} -> "
            f"{acc_a:.3f} ± {se_a:.3f}, gain {gain:+.3f} (z {_fmt(z, '{:+.1f}')}, unpaired): {verdict}")


def main(argv=None) -> int:
    bootstrap()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study_dir", nargs="?", default=os.environ.get("STUDY_DIR", "/work/study-runs/study"),
                   help="folder of live arm folders to archive first (missing: the archive in docs/study/runs alone)")
    p.add_argument("--docs", default=os.path.join(os.path.dirname(_HERE), "docs"), help="docs folder to write")
    p.add_argument("--show", action="store_true",
                   help="print the table of the committed <docs>/study/summary.json and exit (reads no run, writes nothing)")
    p.add_argument("--run", metavar="LOG_DIR",
                   help="with --show: first a line on that finished trainer run (its summary.json): held-out "
                        "accuracy before -> after, gain and z")
    args = p.parse_args(argv)
    if args.run and not args.show:
        p.error("--run goes with --show (e.g. --show --run runs/smollm2_mawps_mask)")
    if args.show:
        rc = 0
        if args.run:
            try:
                print(run_line(args.run))
            except (FileNotFoundError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                rc = 2
        try:
            print(show_summary(args.docs, intro=bool(args.run)))
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return rc
    try:
        s = write_report(args.study_dir, args.docs)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(s["arms"]))
    for d in s["unfinished"]:
        print(f"skipped {d}: unfinished (no DONE file); rerun examples/study_cpu.sh to finish it", file=sys.stderr)
    for a in s["arms"]:
        if a.get("anchor_lost_step") is not None:
            print(f"warning: {a['arm']} seed {a['seed']}: the anchor was lost at step {a['anchor_lost_step']} "
                  "(anchor/alive 0); its row does not measure the arm it names after that step", file=sys.stderr)
    print(f"wrote {os.path.join(args.docs, 'study.md')} and {os.path.join(args.docs, 'study', 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
