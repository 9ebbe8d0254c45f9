#!/usr/bin/env python
"""Plot training runs and evaluation summaries as PNG figures.

    python tools/plot_runs.py runs/dense runs/mask --out figs
    python tools/plot_runs.py --eval dense.json mask.json --out figs
    python tools/plot_runs.py runs/dense runs/mask --eval dense.json mask.json --out figs

Training curves, one line per run (legend: run folder name + boundary codec from its
``config.json``), raw values per logged step, no smoothing:

* ``reward.png``      training reward, ``critic/score/mean``
* ``entropy.png``     entropy as the trainer computes it (through the boundary compression), ``actor/entropy``
* ``kl_to_ref.png``   KL to the reference as the trainer computes it, ``actor/kl_loss``
* ``mismatch.png``    train-inference mismatch, ``mismatch/abs_logprob_diff_mean`` (nats/token)
* ``training_curves.png``  the four panels together
* ``val_acc.png``     ``val/<data set>/acc`` over steps, when a run logged any
* ``error_persistence.png``  ``codec/error_persistence``, the cosine of successive iterations' mean
                      forward boundary error (docs/codecs.md), when a run logged it: near 1 the codec
                      throws away the same direction every step (the seeds' warning about a held basis)
* ``grad_fidelity.png``  ``fidelity/cos``, the cosine of the codec's gradient to the dense-boundary
                      gradient (``--grad-fidelity-interval``, docs/fidelity.md), when a run logged it
* ``drift.png``       damage to the base model, when a run logged the drift probe's ``probe/kl_to_base``
                      (docs/training_health.md): the dense-view KL to the base model per probe, the drift
                      controller's band (``drift/target_low`` .. ``drift/target``) where a run had one, and
                      a marker under each dense step it took (``comm/dense_step`` = 1)

Where a run also logged the compression-off drift probe (``probe/kl_to_ref``,
``probe/abs_logprob_diff_mean``) it is drawn dashed in the run's colour on the KL and
mismatch panels.

``--eval``: ``eval_accuracy.png``, a grouped bar chart of per-benchmark accuracy (one bar
per summary, standard-error whiskers when the summary has them), from
``tools/evaluate.py`` JSON summaries (or the trainer's ``summary.json``).

A panel whose lines lie more than three orders of magnitude apart (a dense run's
mismatch beside a compressed run's, or a probe beside the trainer view) switches to a log
y axis and says so. Missing metrics, missing ``config.json``, "nan" strings and a truncated last line are
tolerated: a panel without data says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_cegrpo.bootstrap import bootstrap
from megatron_cegrpo.evaluation import load_summary
from megatron_cegrpo.evaluation.summary import as_float as _float
from megatron_cegrpo.metrics import parse_record

#: (metric, title, y label, file stem, drift-probe metric or None)
PANELS = [
    ("critic/score/mean", "Training reward", "mean verifier score", "reward", None),
    ("actor/entropy", "Entropy (trainer view, through the compression)", "nats / token", "entropy", None),
    ("actor/kl_loss", "KL to the reference (trainer view)", "KL", "kl_to_ref", "probe/kl_to_ref"),
    ("mismatch/abs_logprob_diff_mean", "Train-inference mismatch |sampler - trainer log-prob|",
     "nats / token", "mismatch", "probe/abs_logprob_diff_mean"),
]

#: panels drawn only when some run logged their metric (compressed runs; the long-horizon figures of
#: issue 33 item 5), same fields as PANELS
CODEC_PANELS = [
    ("codec/error_persistence", "Error persistence: cosine of successive iterations' mean boundary error",
     "cosine", "error_persistence", None),
    ("fidelity/cos", "Gradient fidelity: cos(G_codec, G_dense)", "cosine", "grad_fidelity", None),
]


def read_metrics(run_dir: str) -> Tuple[Dict[str, List[Tuple[float, float]]], int]:
    """``{metric: [(step, value), ...]}`` from ``<run_dir>/metrics.jsonl`` and the number of
    unreadable lines skipped. Records without ``step`` take their line number."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a training log dir?)")
    series: Dict[str, List[Tuple[float, float]]] = {}
    bad = 0
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rec = parse_record(line)
            if rec is None:
                bad += 1  # e.g. the last line of a run killed mid-write
                continue
            step = _float(rec.get("step"))
            if step is None or math.isnan(step):
                step = float(i)
            for k, v in rec.items():
                if k == "step":
                    continue
                x = _float(v)
                if x is not None:
                    series.setdefault(k, []).append((step, x))
    for pts in series.values():
        pts.sort(key=lambda p: p[0])
    return series, bad


def codec_label(run_dir: str) -> Optional[str]:
    """"mask 5%", "dense", ... from ``<run_dir>/config.json`` (None if unknown)."""
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    codec = cfg.get("codec") if isinstance(cfg, dict) else None
    if not isinstance(codec, dict) or not codec.get("boundary_codec"):
        return None
    name = str(codec["boundary_codec"])
    ratio = _float(codec.get("boundary_keep_ratio"))
    if name == "mask" and ratio is not None and not math.isnan(ratio):
        return f"mask {ratio * 100:g}%"
    return name


def run_labels(run_dirs: Sequence[str]) -> List[str]:
    """Folder name + codec; parent folders are added while names collide."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    depth = 1
    names = ["/".join(p[-depth:]) for p in parts]
    while len(set(names)) < len(names) and depth < max(len(p) for p in parts):
        depth += 1
        names = ["/".join(p[-depth:]) for p in parts]
    out = []
    for d, n in zip(run_dirs, names):
        c = codec_label(d)
        out.append(f"{n} ({c})" if c else n)
    return out


def _plt():
    import matplotlib  # optional (the "plot" extra): imported when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_steps(ax):
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_panel(ax, runs, key, title, ylabel, probe_key):
    drew = False
    for i, (label, series) in enumerate(runs):
        color = f"C{i % 10}"
        pts = series.get(key, [])
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=color, lw=1.4, marker="o" if len(pts) <= 30 else None, ms=3, label=label)
            drew = True
        probe = series.get(probe_key, []) if probe_key else []
        if probe:
            xs, ys = zip(*probe)
            ax.plot(xs, ys, color=color, lw=1.2, ls="--", marker="s" if len(probe) <= 30 else None, ms=3,
                    label=f"{label}, probe (compression off)")
            drew = True
    ax.set_title(f"{title}\n{key}", fontsize=10)
    ax.set_xlabel("training step")
    _integer_steps(ax)
    # lines orders of magnitude apart (a dense run's 0.0002 nats beside a compressed run's
    # 10, or the compression-off probe beside the trainer view): log scale, or none is visible
    vals = [v for _, s in runs for k in (key, probe_key) if k for _, v in s.get(k, []) if math.isfinite(v)]
    pos = [v for v in vals if v > 0]
    if pos and min(vals) >= 0 and max(pos) / min(pos) > 1e3:
        if min(vals) == 0:
            ax.set_yscale("symlog", linthresh=min(pos))
        else:
            ax.set_yscale("log")
        ylabel += " (log scale)"
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drew:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, f"no '{key}' values in these runs", ha="center", va="center",
                transform=ax.transAxes, fontsize=9, color="0.4")
    return drew


def _panel_png(plt, runs, panel, out_dir: str) -> str:
    """One ``PANELS``-style panel (metric, title, y label, file stem, probe metric) as
    ``<out_dir>/<stem>.png``; returns its path."""
    key, title, ylabel, stem, probe = panel
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _draw_panel(ax, runs, key, title, ylabel, probe)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_training(run_dirs: Sequence[str], out_dir: str, labels: Optional[Sequence[str]] = None) -> List[str]:
    """Write the training-curve PNGs for ``run_dirs`` into ``out_dir``; returns their paths."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    labels = list(labels) if labels else run_labels(run_dirs)
    runs = []
    for d, lab in zip(run_dirs, labels):
        series, bad = read_metrics(d)
        if bad:
            print(f"[plot_runs] {d}: skipped {bad} unreadable line(s) of metrics.jsonl", file=sys.stderr)
        runs.append((lab, series))
    written = [_panel_png(plt, runs, panel, out_dir) for panel in PANELS]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for ax, (key, title, ylabel, _, probe) in zip(axes.ravel(), PANELS):
        _draw_panel(ax, runs, key, title, ylabel, probe)
    fig.suptitle("Training curves: " + ", ".join(labels), fontsize=11)
    fig.tight_layout()
    path = os.path.join(out_dir, "training_curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    written += [_panel_png(plt, runs, panel, out_dir) for panel in CODEC_PANELS
                if any(s.get(panel[0]) for _, s in runs)]

    val_keys = sorted({k for _, s in runs for k in s if re.match(r"^val/.+/acc$", k)})
    if val_keys:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        styles = ["-", "--", ":", "-."]
        for i, (label, series) in enumerate(runs):
            for j, k in enumerate(val_keys):
                pts = series.get(k, [])
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color=f"C{i % 10}", ls=styles[j % len(styles)], marker="o", ms=3,
                            label=f"{label}: {k[4:-4]}")
        ax.set_title("Dense-view validation accuracy", fontsize=10)
        ax.set_xlabel("training step")
        _integer_steps(ax)
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, "val_acc.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    drift = plot_drift(runs, out_dir)
    if drift:
        written.append(drift)
    return written


def drift_series(series: Dict[str, List[Tuple[float, float]]]) -> Dict[str, object]:
    """What ``drift.png`` draws for one run: ``kl`` [(step, probe/kl_to_base)], ``dense_steps`` (the
    steps with ``comm/dense_step`` = 1) and ``band`` (LOW, HIGH) from the run's last
    ``drift/target_low`` / ``drift/target`` (None without the controller)."""
    high, low = series.get("drift/target", []), series.get("drift/target_low", [])
    return {"kl": list(series.get("probe/kl_to_base", [])),
            "dense_steps": [int(t) for t, v in series.get("comm/dense_step", []) if v == 1],
            "band": (low[-1][1], high[-1][1]) if high and low else None}


def plot_drift(runs: Sequence[Tuple[str, Dict[str, List[Tuple[float, float]]]]], out_dir: str) -> Optional[str]:
    """``drift.png`` (see the module's docstring) for the runs that logged ``probe/kl_to_base``;
    None when none did. Returns the path."""
    drawn = [(label, drift_series(s)) for label, s in runs if s.get("probe/kl_to_base")]
    if not drawn:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    top = max(v for _, d in drawn for _, v in d["kl"])
    for i, (label, d) in enumerate(drawn):
        color = f"C{i % 10}"
        xs, ys = zip(*d["kl"])
        ax.plot(xs, ys, color=color, lw=1.5, marker="o", ms=3, label=f"{label}: probe/kl_to_base")
        if d["band"] is not None:
            lo, hi = d["band"]
            ax.axhspan(lo, hi, color=color, alpha=0.12, label=f"{label}: controller band [{lo:g}, {hi:g}]")
            top = max(top, hi)
        if d["dense_steps"]:
            ax.plot(d["dense_steps"], [0.0] * len(d["dense_steps"]), ls="none", marker="^", ms=7, color=color,
                    label=f"{label}: dense steps ({len(d['dense_steps'])})")
    ax.set_ylim(bottom=-0.03 * top, top=1.1 * top)
    ax.set_title("Damage to the base model: dense-view KL(pi || pi_base) on the probe batch", fontsize=10)
    ax.set_xlabel("training step")
    _integer_steps(ax)
    ax.set_ylabel("KL, nats / token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = os.path.join(out_dir, "drift.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_eval(summary_paths: Sequence[str], out_path: str, labels: Optional[Sequence[str]] = None) -> str:
    """Grouped bar chart of per-benchmark accuracy, one bar per summary; returns the path."""
    plt = _plt()
    sums = [load_summary(p) for p in summary_paths]
    if labels:
        for s, lab in zip(sums, labels):
            s["label"] = lab
    names: List[str] = []
    for s in sums:
        for n in s["acc"]:
            if n not in names:
                names.append(n)
    modes = {}
    for s in sums:
        for n, m in s.get("modes", {}).items():
            modes.setdefault(n, m)
    n_b, n_s = len(names), len(sums)
    width = 0.8 / n_s
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * n_b * max(1, n_s) / 2 + 2), 4.6))
    for j, s in enumerate(sums):
        xs, ys, errs = [], [], []
        for i, n in enumerate(names):
            v = s["acc"].get(n)
            if v is None or math.isnan(v):
                ax.text(i + (j - (n_s - 1) / 2) * width, 0.01, "n/a", ha="center", va="bottom", fontsize=7,
                        rotation=90, color="0.4")
                continue
            xs.append(i + (j - (n_s - 1) / 2) * width)
            ys.append(v)
            e = s["stderr"].get(n)
            errs.append(e if e is not None and not math.isnan(e) else 0.0)
        bars = ax.bar(xs, ys, width=width * 0.95, color=f"C{j % 10}", label=s["label"],
                      yerr=errs if any(errs) else None, capsize=3, error_kw={"lw": 0.8})
        for b, v, e in zip(bars, ys, errs):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height() + e + 0.005, f"{v:.3f}", ha="center",
                    va="bottom", fontsize=7)
    ax.set_xlim(-0.5, n_b - 0.5)
    ax.set_xticks(range(n_b))
    ax.set_xticklabels([f"{n}\n{modes[n]}" if n in modes else n for n in names], fontsize=8)
    ymax = max([v + (s["stderr"].get(n) or 0.0) for s in sums for n, v in s["acc"].items()
                if not math.isnan(v)] + [0.0])
    ax.set_ylim(0, min(1.05, max(0.1, ymax * 1.25 + 0.05)))
    ax.set_ylabel("accuracy")
    title = "Accuracy per benchmark"
    if n_s == 2:
        a, b = sums
        common = [n for n in names if n in a["acc"] and n in b["acc"]
                  and not math.isnan(a["acc"][n]) and not math.isnan(b["acc"][n])]
        if common:
            mad = sum(abs(b["acc"][n] - a["acc"][n]) for n in common) / len(common)
            title += f"\nmean |{b['label']} - {a['label']}| = {mad:.3f} over {len(common)} benchmark(s)"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def main(argv=None) -> int:
    bootstrap()
    p = argparse.ArgumentParser(description="Plot training runs (metrics.jsonl) and evaluation summaries.")
    p.add_argument("runs", nargs="*", help="training log dirs (each with metrics.jsonl, optionally config.json)")
    p.add_argument("--out", required=True, help="output folder for the PNGs")
    p.add_argument("--labels", default=None, help="comma-separated legend labels for the runs")
    p.add_argument("--eval", nargs="+", default=None, metavar="JSON", help="evaluation summaries to compare")
    p.add_argument("--eval-labels", default=None, help="comma-separated labels for the --eval summaries")
    args = p.parse_args(argv)
    if not args.runs and not args.eval:
        p.error("give at least one RUN_DIR or --eval JSON")
    written = []
    if args.runs:
        labels = args.labels.split(",") if args.labels else None
        if labels and len(labels) != len(args.runs):
            p.error(f"--labels has {len(labels)} names for {len(args.runs)} runs")
        written += plot_training(args.runs, args.out, labels)
    if args.eval:
        labels = args.eval_labels.split(",") if args.eval_labels else None
        if labels and len(labels) != len(args.eval):
            p.error(f"--eval-labels has {len(labels)} names for {len(args.eval)} summaries")
        written.append(plot_eval(args.eval, os.path.join(args.out, "eval_accuracy.png"), labels))
    for w in written:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
