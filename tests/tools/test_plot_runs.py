"""tools/plot_runs.py: PNGs from two short runs' metrics and from two evaluation summaries."""

import json
import math
import random
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install matplotlib)")
PIL_Image = pytest.importorskip("PIL.Image", reason="pillow not installed (pip install pillow)")

from megatron_cegrpo.data import PromptRecord  # noqa: E402
from megatron_cegrpo.evaluation import DatasetResult, EvalMode, EvalReport, write_summary  # noqa: E402
from distributed_util import load_tool  # noqa: E402


def _tool():
    return load_tool("plot_runs")


def _write_run(d: Path, codec: dict, steps: int, seed: int, mismatch: float, probe: bool, nan_step: int = 0):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"codec": codec, "optim": {"seed": seed}}))
    rng = random.Random(seed)
    with open(d / "metrics.jsonl", "w") as f:
        for t in range(1, steps + 1):
            rec = {"step": t, "critic/score/mean": 0.35 + 0.02 * t + 0.03 * rng.random(),
                   "actor/entropy": 7.8 + 0.1 * rng.random(), "actor/kl_loss": 0.001 * t,
                   "mismatch/abs_logprob_diff_mean": mismatch + 0.01 * rng.random(),
                   "comm/bytes_ratio": codec.get("boundary_keep_ratio", 1.0), "timing_s/step": 1.0}
            if t == nan_step:
                rec["actor/kl_loss"] = "nan"     # how MetricsWriter writes a non-finite float
                del rec["actor/entropy"]         # and a missing key
            if probe and t % 5 == 0:
                rec["probe/kl_to_ref"] = 0.0005 * t
                rec["probe/abs_logprob_diff_mean"] = 0.0002
            if t % 10 == 0:
                rec["val/mawps/acc"] = 0.3 + 0.01 * t
            if codec["boundary_codec"] != "dense":  # as the trainer logs them: persistence from step 2
                if t >= 2:
                    rec["codec/error_persistence"] = 0.1 + 0.04 * t
                if t % 5 == 0:
                    rec["fidelity/cos"] = 0.3 + 0.01 * t
            f.write(json.dumps(rec) + "\n")
        f.write('{"step": 99, "critic/sco')  # a run killed mid-write


def _png_ok(path: Path):
    assert path.is_file(), path
    assert path.stat().st_size > 5 * 1024, (path, path.stat().st_size)
    with PIL_Image.open(path) as im:
        im.verify()
    with PIL_Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200


def test_training_curves_from_two_runs(tmp_path, capsys):
    dense, mask = tmp_path / "runs" / "dense", tmp_path / "runs" / "mask"
    _write_run(dense, {"boundary_codec": "dense"}, 20, 1, 0.0002, probe=False)
    _write_run(mask, {"boundary_codec": "mask", "boundary_keep_ratio": 0.05}, 20, 2, 10.0, probe=True,
               nan_step=7)
    tool = _tool()
    assert tool.run_labels([str(dense), str(mask)]) == ["dense (dense)", "mask (mask 5%)"]
    series, bad = tool.read_metrics(str(mask))
    assert bad == 1
    assert math.isnan(dict(series["actor/kl_loss"])[7.0])
    assert 7.0 not in dict(series["actor/entropy"]) and len(series["actor/entropy"]) == 19
    assert len(series["probe/kl_to_ref"]) == 4
    assert series["codec/error_persistence"][0] == (2.0, pytest.approx(0.18))
    assert len(series["codec/error_persistence"]) == 19 and len(series["fidelity/cos"]) == 4

    out = tmp_path / "figs"
    assert tool.main([str(dense), str(mask), "--out", str(out)]) == 0
    for stem in ["reward", "entropy", "kl_to_ref", "mismatch", "training_curves", "error_persistence",
                 "grad_fidelity", "val_acc"]:
        _png_ok(out / f"{stem}.png")
    # the codec panels only where some run logged them: a dense run alone has neither
    dense_only = [Path(p).name for p in tool.plot_training([str(dense)], str(tmp_path / "dense_figs"))]
    assert "error_persistence.png" not in dense_only and "grad_fidelity.png" not in dense_only
    assert "val_acc.png" in dense_only
    assert "skipped 1 unreadable line" in capsys.readouterr().err


def test_runs_without_a_metric_or_config_still_plot(tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": "nan"}) + "\n"
                                     + json.dumps({"critic/score/mean": 0.5}) + "\n")
    tool = _tool()
    assert tool.run_labels([str(d)]) == ["bare"]
    written = tool.plot_training([str(d)], str(tmp_path / "out"))
    assert [Path(p).name for p in written] == ["reward.png", "entropy.png", "kl_to_ref.png", "mismatch.png",
                                               "training_curves.png"]
    for p in written:
        _png_ok(Path(p))
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        tool.read_metrics(str(tmp_path))


def test_drift_figure_draws_the_probe_the_band_and_the_dense_steps(tmp_path):
    """drift.png for a controller run (band, dense steps) beside one without: the series it draws
    are the runs' logged values; a run without the probe adds no drift.png."""
    on, off = tmp_path / "on", tmp_path / "off"
    for d, ctl in ((on, True), (off, False)):
        d.mkdir()
        with open(d / "metrics.jsonl", "w") as f:
            for t in range(1, 9):
                rec = {"step": t, "critic/score/mean": 0.1, "comm/dense_step": int(ctl and t in (5, 7))}
                if t % 2 == 0:
                    rec["probe/kl_to_base"] = 0.004 * t if ctl else 0.006 * t
                if ctl:
                    rec.update({"drift/target": 0.02, "drift/target_low": 0.01})
                f.write(json.dumps(rec) + "\n")
    tool = _tool()
    series, _ = tool.read_metrics(str(on))
    assert tool.drift_series(series) == {"kl": [(2.0, 0.008), (4.0, 0.016), (6.0, 0.024), (8.0, 0.032)],
                                         "dense_steps": [5, 7], "band": (0.01, 0.02)}
    assert tool.drift_series(tool.read_metrics(str(off))[0])["band"] is None
    written = tool.plot_training([str(on), str(off)], str(tmp_path / "figs"))
    assert Path(written[-1]).name == "drift.png"
    _png_ok(Path(written[-1]))
    _write_run(tmp_path / "plain", {"boundary_codec": "dense"}, 5, 1, 0.001, probe=False)
    assert "drift.png" not in [Path(p).name for p in tool.plot_training([str(tmp_path / "plain")], str(tmp_path / "p"))]


def _summary(path: Path, label: str, accs: dict):
    """An evaluation summary written by the real writer: per data set, rows scored to hit ``accs``."""
    report = EvalReport(metrics={}, settings={"max_new_tokens": 16})
    for name, (acc, k) in accs.items():
        n = 10
        scores = [[1.0 if (i * k + j) < round(acc * n * k) else 0.0 for j in range(k)] for i in range(n)]
        recs = [PromptRecord(f"q{i}", "1", "numeric", name, i + 1) for i in range(n)]
        mode = EvalMode() if k == 1 else EvalMode(greedy=False, k=k, temperature=0.7)
        r = DatasetResult(name, mode, recs, scores, [["\\boxed{1}"] * k for _ in recs], [[4] * k for _ in recs],
                          [[False] * k for _ in recs], 1.0)
        assert r.acc == pytest.approx(acc)
        report.datasets[name] = r
        report.metrics.update(r.metrics())
    write_summary(str(path), report, {"label": label})


def test_eval_bar_chart_from_two_summaries(tmp_path, monkeypatch):
    _summary(tmp_path / "dense.json", "dense", {"gsm8k/test": (0.6, 1), "mawps": (0.8, 1), "amc23": (0.3, 8)})
    _summary(tmp_path / "mask.json", "mask 5%", {"gsm8k/test": (0.5, 1), "mawps": (0.8, 1), "amc23": (0.35, 8),
                                                   "aime24": (0.1, 8)})
    out = tmp_path / "figs"
    tool = _tool()
    plt = tool._plt()
    figs, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figs.append(fig), close(fig))[1])
    assert tool.main(["--eval", str(tmp_path / "dense.json"), str(tmp_path / "mask.json"), "--out", str(out)]) == 0
    _png_ok(out / "eval_accuracy.png")
    # what the bars show: each summary's accuracy per benchmark (a PNG check alone passed any bar heights)
    from matplotlib.container import BarContainer

    (ax,) = figs[-1].axes
    names = [t.get_text().split("\n")[0] for t in ax.get_xticklabels()]
    bars = {c.get_label(): {names[round(b.get_x() + b.get_width() / 2)]: b.get_height() for b in c}
            for c in ax.containers if isinstance(c, BarContainer)}
    assert bars == {"dense": {"gsm8k/test": pytest.approx(0.6), "mawps": pytest.approx(0.8),
                              "amc23": pytest.approx(0.3)},
                    "mask 5%": {"gsm8k/test": pytest.approx(0.5), "mawps": pytest.approx(0.8),
                                "amc23": pytest.approx(0.35), "aime24": pytest.approx(0.1)}}
    # |0.5 - 0.6| + |0.8 - 0.8| + |0.35 - 0.3| over the 3 benchmarks both scored
    assert ax.get_title().endswith("mean |mask 5% - dense| = 0.050 over 3 benchmark(s)")
    # both kinds at once, with explicit labels
    _write_run(tmp_path / "r1", {"boundary_codec": "mask", "boundary_keep_ratio": 0.05}, 5, 3, 10.0, probe=False)
    assert tool.main([str(tmp_path / "r1"), "--labels", "compressed", "--eval", str(tmp_path / "dense.json"),
                      "--eval-labels", "dense-final", "--out", str(tmp_path / "both")]) == 0
    _png_ok(tmp_path / "both" / "eval_accuracy.png")
    _png_ok(tmp_path / "both" / "reward.png")
