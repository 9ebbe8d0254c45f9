"""tools/study_report.py: the study summary from synthetic metrics.jsonl files (exact values)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "study_report.py"


def _tool():
    spec = importlib.util.spec_from_file_location("study_report_tool", _TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _step(t, score, fwd, bwd, dense, seconds, **extra):
    return {"step": t, "critic/score/mean": score, "actor/kl_loss": 0.0, "actor/entropy": 0.5 - 0.01 * t,
            "mismatch/abs_logprob_diff_mean": 0.1 * t, "comm/fwd_bytes": fwd, "comm/bwd_bytes": bwd,
            "comm/dense_equiv_bytes": dense, "timing_s/step": seconds, **extra}


def _holdout(t, acc, se, seconds):
    return {"step": t, "val/holdout/acc": acc, "val/holdout/acc_stderr": se, "val/holdout/num_rows": 300,
            "timing_s/eval/holdout": seconds, "timing_s/eval": seconds}


def _write_run(d: Path, records, arm=None, config=None, tail="", done=True):
    d.mkdir(parents=True)
    if done:  # study_cpu.sh's mark of a run that exited cleanly
        (d / "DONE").write_text("")
    with open(d / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)
    if arm is not None:
        (d / "study_arm.json").write_text(json.dumps(arm))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))


@pytest.fixture()
def study(tmp_path):
    root = tmp_path / "runs"
    other0 = {"step": 0, "val/mawps/singleop/acc": 0.25, "val/mawps/singleop/acc_stderr": 0.025,
              "val/mawps/singleop/num_rows": 300, "timing_s/eval": 50.0}
    # dense: finished, 2 iterations; the suite's final evaluation rides in the step-2 record
    _write_run(root / "dense-s1", [
        other0, _holdout(0, 0.30, 0.02, 40.0),
        _step(1, 0.25, 1000, 1000, 2000, 60.0),
        _step(2, 0.50, 1000, 1000, 2000, 62.5, **{"val/mawps/singleop/acc": 0.3,
                                                  "val/mawps/singleop/acc_stderr": 0.026,
                                                  "val/mawps/singleop/num_rows": 300, "timing_s/eval": 45.0}),
        _holdout(2, 0.40, 0.03, 38.0),
    ], arm={"arm": "dense", "seed": 1, "codec": "dense", "anchor": False},
        tail='{"step": 3, "critic/sco')  # a line cut short by a kill
    (root / "dense-s1" / "wall_seconds").write_text("100\n250\n")  # started twice
    # mask + anchor: exited without its final evaluation (no holdout record at its last step);
    # identity from config.json
    _write_run(root / "mask_anchor-s1", [
        _holdout(0, 0.30, 0.02, 41.0),
        _step(1, 0.125, 30, 70, 2000, 70.0, **{"fidelity/cos": 0.5}),
    ], config={"optim": {"seed": 1}, "codec": {"boundary_codec": "mask"}, "anchor": {"anchor_ranks": 1}})
    return root


def test_summary_values(study, tmp_path):
    mod = _tool()
    docs = tmp_path / "docs"
    (docs).mkdir()
    (docs / "study.md").write_text(f"old\n{mod.NOTES_BEGIN}\nThe dense arm learns.\n{mod.NOTES_END}\nold\n")
    summary = mod.write_report(str(study), str(docs))
    on_disk = json.loads((docs / "study" / "summary.json").read_text())
    assert summary.pop("unfinished") == []  # returned, not written
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["fields"] == list(mod.FIELDS)
    dense, mask = on_disk["arms"]  # sorted by folder name
    assert {k: dense[k] for k in mod.FIELDS} == {
        "arm": "dense", "seed": 1, "codec": "dense", "anchor": False, "iterations": 2,
        "wall_s": 60.0 + 62.5 + 50.0 + 40.0 + 45.0 + 38.0, "acc_before": 0.30, "acc_after": 0.40,
        "acc_stderr": 0.03, "heldout_rows": 300, "boundary_bytes_ratio": 1.0}
    assert dense["acc_before_stderr"] == 0.02 and dense["launch_wall_s"] == 350.0
    assert dense["gain"] == pytest.approx(0.10, abs=1e-15)
    assert dense["gain_z"] == pytest.approx(0.10 / math.sqrt(0.02 ** 2 + 0.03 ** 2), rel=1e-12)
    assert dense["other"] == {"mawps/singleop": {"acc_before": 0.25, "acc_after": 0.3, "acc_before_stderr": 0.025,
                                                 "acc_stderr": 0.026, "rows": 300}}
    assert {k: mask[k] for k in mod.FIELDS} == {
        "arm": "mask_anchor-s1", "seed": 1, "codec": "mask", "anchor": True, "iterations": 1,
        "wall_s": 41.0 + 70.0, "acc_before": 0.30, "acc_after": None, "acc_stderr": None, "heldout_rows": 300,
        "boundary_bytes_ratio": 100 / 2000}
    assert mask["gain"] is None and mask["gain_z"] is None and mask["other"] == {} and mask["launch_wall_s"] is None

    md = (docs / "study.md").read_text()
    assert "| dense | 1 | dense | no | 2 | 4.9 | 0.300 ± 0.020 | 0.400 ± 0.030 | +0.100 (+2.8) | 300 | 1.0000 |" in md
    assert f"{mod.NOTES_BEGIN}\nThe dense arm learns.\n{mod.NOTES_END}" in md and "old" not in md
    pngs = {p.name for p in (docs / "study").glob("*.png")}
    assert pngs == {"reward.png", "mismatch.png", "fidelity_cos.png", "kl.png", "entropy.png",
                    "heldout_accuracy.png"}
    assert all((docs / "study" / n).stat().st_size < 200_000 for n in pngs)


def test_no_runs_is_an_error(tmp_path):
    mod = _tool()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no arm folder"):
        mod.write_report(str(tmp_path / "empty"), str(tmp_path / "docs"))
    assert mod.main([str(tmp_path / "missing"), "--docs", str(tmp_path / "docs")]) == 2


def test_archive_then_report_without_runs(study, tmp_path):
    """The runs' small files are archived under docs/study/runs and a later report drawn from the
    archive alone (the run folders gone) gives the same summary; an arm of an earlier summary.json
    whose logs are gone everywhere keeps its row, flagged, and gets no curve."""
    mod = _tool()
    docs = tmp_path / "docs"
    first = mod.write_report(str(study), str(docs))
    archived = docs / "study" / "runs"
    assert sorted(p.name for p in archived.iterdir()) == ["dense-s1", "mask_anchor-s1"]
    assert sorted(p.name for p in (archived / "dense-s1").iterdir()) == ["DONE", "metrics.jsonl", "study_arm.json",
                                                                          "wall_seconds"]
    assert [a["run_dir"] for a in first["arms"]] == ["docs/study/runs/dense-s1", "docs/study/runs/mask_anchor-s1"]

    # an arm known only from the summary: its logs were lost
    on_disk = json.loads((docs / "study" / "summary.json").read_text())
    lost = dict(on_disk["arms"][0], arm="mask", seed=7)
    on_disk["arms"].append(lost)
    (docs / "study" / "summary.json").write_text(json.dumps(on_disk))
    import shutil
    shutil.rmtree(study)
    again = mod.write_report(str(study), str(docs))
    assert again["arms"][:1] + again["arms"][2:] == first["arms"]  # sorted: dense, mask (carried), mask_anchor-s1
    carried = again["arms"][1]
    assert carried["arm"] == "mask" and carried["logs_lost"] is True and carried["run_dir"] is None
    assert carried["acc_after"] == 0.40
    md = (docs / "study.md").read_text()
    assert "Logs lost (summary rows kept from the earlier summary.json, no curves in the figures): mask seed 7." in md
    assert "| mask | 7 | dense | no | 2 |" in md


def test_an_arm_whose_anchor_died_is_flagged(tmp_path, capsys):
    """The anchor rank of an anchor arm was killed at step 2 (anchor/alive 0 from there): the row
    says so, study.md names the arm and step, main() warns; a dense arm's alive=0 is not flagged."""
    mod = _tool()
    root = tmp_path / "runs"
    _write_run(root / "mask_anchor-s1", [
        _holdout(0, 0.30, 0.02, 41.0),
        _step(1, 0.1, 30, 70, 2000, 70.0, **{"anchor/alive": 1}),
        _step(2, 0.1, 30, 70, 2000, 70.0, **{"anchor/alive": 0}),
        _step(3, 0.1, 30, 70, 2000, 70.0, **{"anchor/alive": 0}),
        _holdout(3, 0.25, 0.02, 41.0),
    ], arm={"arm": "mask_anchor", "seed": 1, "codec": "mask", "anchor": True})
    _write_run(root / "dense-s1", [
        _holdout(0, 0.30, 0.02, 41.0), _step(1, 0.1, 30, 70, 2000, 70.0, **{"anchor/alive": 0}),
    ], arm={"arm": "dense", "seed": 1, "codec": "dense", "anchor": False})
    docs = tmp_path / "docs"
    assert mod.main([str(root), "--docs", str(docs)]) == 0
    summary = json.loads((docs / "study" / "summary.json").read_text())
    assert [(a["arm"], a["anchor_lost_step"]) for a in summary["arms"]] == [("dense", None), ("mask_anchor", 2)]
    md = (docs / "study.md").read_text()
    assert "| mask_anchor | 1 | mask | **lost at step 2** | 3 |" in md and "| dense | 1 | dense | no | 1 |" in md
    assert "so these rows do not measure the arm they name after that step): mask_anchor seed 1 (step 2)." in md
    err = capsys.readouterr().err
    assert "warning: mask_anchor seed 1: the anchor was lost at step 2 (anchor/alive 0)" in err


def test_show_prints_the_committed_table_and_writes_nothing(study, tmp_path, capsys):
    """--show (what make demo prints at its end) is the table of summary.json as written, reads no run
    folder and writes no file; a missing or broken summary is one error line and exit 2."""
    mod = _tool()
    docs = tmp_path / "docs"
    assert mod.main(["--show", "--docs", str(docs)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {docs / 'study' / 'summary.json'} does not exist; fix:")
    summary = mod.write_report(str(study), str(docs))
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in docs.rglob("*")}
    import shutil
    shutil.rmtree(study)
    assert mod.main(["--show", "--docs", str(docs)]) == 0
    out = capsys.readouterr().out
    assert out == mod.table(summary["arms"]) + "\n"
    assert "| dense | 1 | dense | no | 2 |" in out and "| +0.100 (+2.8) |" in out
    assert {p: p.stat().st_mtime_ns for p in docs.rglob("*")} == before
    (docs / "study" / "summary.json").write_text("{")
    assert mod.main(["--show", "--docs", str(docs)]) == 2
    err = capsys.readouterr().err
    assert "is not a study summary (JSONDecodeError" in err and len(err.splitlines()) == 1


def test_an_unfinished_arm_is_not_archived(study, tmp_path, capsys):
    """A live arm folder without DONE (still running, or stopped) stays out of the archive and the
    summary, and main() names it; a rerun after it finishes archives it."""
    mod = _tool()
    _write_run(study / "lowrank-s1", [_holdout(0, 0.30, 0.02, 40.0), _step(1, 0.2, 30, 70, 2000, 60.0)],
               arm={"arm": "lowrank", "seed": 1, "codec": "lowrank", "anchor": False}, done=False)
    docs = tmp_path / "docs"
    assert mod.main([str(study), "--docs", str(docs)]) == 0
    err = capsys.readouterr().err
    assert f"skipped {study / 'lowrank-s1'}: unfinished (no DONE file); rerun examples/study_cpu.sh" in err
    summary = json.loads((docs / "study" / "summary.json").read_text())
    assert [a["arm"] for a in summary["arms"]] == ["dense", "mask_anchor-s1"]
    assert sorted(p.name for p in (docs / "study" / "runs").iterdir()) == ["dense-s1", "mask_anchor-s1"]
    (study / "lowrank-s1" / "DONE").write_text("")
    again = mod.write_report(str(study), str(docs))
    assert [a["arm"] for a in again["arms"]] == ["dense", "lowrank", "mask_anchor-s1"] and again["unfinished"] == []


def _trainer_summary(d: Path, before, after, step):
    d.mkdir(parents=True)
    ev = lambda acc, se: {"val/holdout/acc": acc, "val/holdout/acc_stderr": se, "val/holdout/num_rows": 300}
    (d / "summary.json").write_text(json.dumps({"initial": ev(*before), "final": ev(*after),
                                                "last_metrics": {"step": step}}))


def test_show_run_prints_the_runs_gain_then_the_study(study, tmp_path, capsys):
    """--show --run DIR (make demo's last lines): the run's before -> after from its summary.json, the
    gain and the unpaired z against the 3-standard-error bar, then the study's table; a run that wrote
    no summary.json is one error line and exit 2, and the table is still printed."""
    mod = _tool()
    docs = tmp_path / "docs"
    summary = mod.write_report(str(study), str(docs))
    capsys.readouterr()
    run = tmp_path / "demo"
    _trainer_summary(run, (0.08, 0.015), (0.11, 0.018), 10)
    assert mod.main(["--show", "--run", str(run), "--docs", str(docs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    z = 0.03 / math.hypot(0.015, 0.018)  # 1.28
    assert lines[0] == (f"this run ({run}, 10 iterations, 300 held-out rows): 0.080 ± 0.015 -> 0.110 ± 0.018, "
                        f"gain +0.030 (z +{z:.1f}, unpaired): below 3 standard errors, so not evidence of learning")
    assert lines[1] == ("the study (docs/study.md; examples/study_cpu.sh, about an hour an arm here) ran 2 "
                        "iterations an arm, side by side:")
    assert "\n".join(lines[2:]) == mod.table(summary["arms"])
    assert mod.gain_z(0.08, 0.015, 0.11, 0.018) == (pytest.approx(0.03, abs=1e-15), pytest.approx(z, rel=1e-12))

    big = tmp_path / "long"
    _trainer_summary(big, (0.08, 0.015), (0.18, 0.022), 48)
    assert mod.main(["--show", "--run", str(big), "--docs", str(docs)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("gain +0.100 (z +3.8, unpaired): at least 3 standard errors")

    assert mod.main(["--show", "--run", str(tmp_path / "crashed"), "--docs", str(docs)]) == 2
    out, err = capsys.readouterr()
    assert err == f"error: {tmp_path / 'crashed' / 'summary.json'} does not exist: the run did not finish; fix: see its log, rerun it\n"
    assert out.splitlines()[1:] == mod.table(summary["arms"]).splitlines()
    resumed = tmp_path / "resumed"  # a run continued with --load evaluates only at its end
    _trainer_summary(resumed, (0.08, 0.015), (0.11, 0.018), 10)
    s = json.loads((resumed / "summary.json").read_text())
    del s["initial"]
    (resumed / "summary.json").write_text(json.dumps(s))
    with pytest.raises(ValueError, match="has no before-training evaluation: the run was resumed"):
        mod.run_line(str(resumed))
    with pytest.raises(SystemExit):
        mod.main(["--run", str(run), "--docs", str(docs)])
