"""The anchor forecast's error on a run's real weight trajectory, for any cadence and damping
(issue 31 item 4; docs/anchor.md, "How far the forecast lands").

Reads ``<log-dir>/weight_trace/`` (written by ``--log-weight-sample N``, training/weight_trace.py:
the same sampled fp32 coordinates of every stage after every iteration) and replays the anchor's
own forecast (``anchor/forecast.py``, through a :class:`CheckpointRing` holding theta at
s = 0, c, 2c, ... as the anchor's shipments do, ``anchor/transport.is_ship_step``) at every fire
t = c, 2c, ... whose forecast proper exists (t >= K + c), scoring each with ``forecast_error``:

    ||theta_hat(t) - theta(t)|| / ||theta(s1) - theta(t)||

(1: no better than replaying the stale theta(s1); below 1 the forecast helps; above 1 it
overshoots; the seeds' EXP-42 measure). Every (c, K, damping) is scored on the same trajectory,
so the comparison between dampings is paired. The trajectory is the traced run's own: a run whose
anchor used another damping would have moved a little differently.

The ratio is computed on the sampled coordinates: a uniform sample scales both sums of squares by
the same factor, so the ratio is estimated; ``--check-metrics`` prints the run's own
``anchor/forecast_error`` (every coordinate, the anchor's shipped weights) beside the estimate at
the run's c, K and damping.

    python tools/forecast_report.py RUN_DIR --cadence 4:4 8:8 --damping 1 0.53 [--json out.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:
    import torch

from megatron_cegrpo.bootstrap import bootstrap

__all__ = ["load_trajectory", "score", "main"]


def load_trajectory(run_dir: str) -> Dict[int, "torch.Tensor"]:
    """``{iteration: float64 vector}`` of every stage's sampled coordinates, concatenated in file
    name order, for the iterations every stage recorded.

    Raises:
        FileNotFoundError: no ``weight_trace/*.json`` under ``run_dir`` (the run lacked
            ``--log-weight-sample``).
    """
    import torch

    from megatron_cegrpo.training.weight_trace import read_trace

    metas = sorted(glob.glob(os.path.join(run_dir, "weight_trace", "*.json")))
    if not metas:
        raise FileNotFoundError(f"{run_dir}/weight_trace/: no trace; fix: run with --log-weight-sample N "
                                f"(e.g. 262144) and --log-dir {run_dir}")
    traces = []
    for m in metas:
        n = json.load(open(m, encoding="utf-8"))["coordinates"]
        traces.append(read_trace(m[:-len(".json")] + ".bin", n))
    steps = sorted(set.intersection(*(set(t) for t in traces)))
    return {s: torch.from_numpy(np.concatenate([t[s] for t in traces]).astype(np.float64)) for s in steps}


def score(traj: Dict[int, "torch.Tensor"], c: int, K: int, damping: float,
          forecast: str = "secant") -> List[Tuple[int, float]]:
    """``[(fire t, forecast_error)]`` of the anchor's ``forecast`` at cadence ``c``, delay ``K``
    (a positive multiple of c) and ``damping``, over the fires the trajectory covers.

    Raises:
        ValueError: c < 1, or K not a positive multiple of c (the anchor's own rule).
    """
    from megatron_cegrpo.anchor.forecast import forecast_error, get_forecast
    from megatron_cegrpo.anchor.ring import CheckpointRing

    if c < 1 or K < c or K % c:
        raise ValueError(f"cadence c={c}, delay K={K}: K must be a positive multiple of c")
    fn = get_forecast(forecast, **({"damping": damping} if forecast == "secant" else {}))
    ring = CheckpointRing(capacity=4 + K // c, delay=K)
    out = []
    last = max(traj)
    for t in range(c, last + 1, c):
        s = t - c  # shipped before fire t (theta(t - c) at iteration t - c + 1), as the anchor's ring
        if s in traj and s not in ring.steps:
            ring.put(s, {"theta": traj[s]})
        if t not in traj:
            continue
        res = fn(ring, t, K, c)
        if res is None or res.branch != "forecast":
            continue
        err = forecast_error(res.weights, ring.read(max(res.source_steps), t), {"theta": traj[t]})
        if err is not None:
            out.append((t, err))
    return out


def _logged(run_dir: str) -> List[Tuple[int, float]]:
    """The run's own ``anchor/forecast_error`` values, by the fire they score."""
    out = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path, encoding="utf-8"):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "anchor/forecast_error" in r:
                out.append((int(r["anchor/forecast_error_step"]), float(r["anchor/forecast_error"])))
    return out


def _cadence(text: str) -> Tuple[int, int]:
    c, _, k = text.partition(":")
    return int(c), int(k or c)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("run_dir", help="a run's --log-dir (with weight_trace/)")
    ap.add_argument("--cadence", nargs="+", default=["4:4", "8:8"], help="c:K pairs (default: 4:4 8:8)")
    ap.add_argument("--damping", nargs="+", type=float, default=[1.0, 0.53],
                    help="secant dampings D (default: 1 and the seeds' 0.53)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--check-metrics", action="store_true",
                    help="print the run's own anchor/forecast_error beside the estimate")
    a = ap.parse_args(argv)
    bootstrap()
    try:
        traj = load_trajectory(a.run_dir)
    except FileNotFoundError as e:
        print(f"[forecast_report] error: {e}", file=sys.stderr)
        return 2
    steps = sorted(traj)
    n = next(iter(traj.values())).numel()
    print(f"{a.run_dir}: iterations {steps[0]}-{steps[-1]} ({len(steps)} records), {n} sampled coordinates")
    print("\n| c | K | damping | fires scored | mean error | median | min | max |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for cad in a.cadence:
        c, K = _cadence(cad)
        for d in a.damping:
            errs = score(traj, c, K, d)
            v = [e for _, e in errs]
            rows.append({"c": c, "K": K, "damping": d, "fires": [t for t, _ in errs], "errors": v})
            if v:
                print(f"| {c} | {K} | {d:g} | {len(v)} | {statistics.fmean(v):.3f} | {statistics.median(v):.3f} | "
                      f"{min(v):.3f} | {max(v):.3f} |")
            else:
                print(f"| {c} | {K} | {d:g} | 0 | - | - | - | - |")
    if a.check_metrics:
        logged = _logged(a.run_dir)
        print("\nthe run's own anchor/forecast_error (fire: logged):",
              ", ".join(f"{t}: {e:.3f}" for t, e in logged) or "none")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"run_dir": a.run_dir, "iterations": [steps[0], steps[-1]], "coordinates": n,
                       "rows": rows, "logged": _logged(a.run_dir)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
