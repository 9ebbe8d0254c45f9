"""tools/study_report.py: the study summary from synthetic metrics.jsonl files (exact values)."""

import json
import math
import os
import time
from pathlib import Path

import pytest

from distributed_util import load_tool

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "study_report.py"


def _tool():
    return load_tool("study_report")


def _step(t, score, fwd, bwd, dense, seconds, **extra):
    return {"step": t, "critic/score/mean": score, "actor/kl_loss": 0.0, "actor/entropy": 0.5 - 0.01 * t,
            "mismatch/abs_logprob_diff_mean": 0.1 * t, "comm/fwd_bytes": fwd, "comm/bwd_bytes": bwd,
            "comm/dense_equiv_bytes": dense, "timing_s/step": seconds, **extra}


def _holdout(t, acc, se, seconds, clip=None):
    out = {"step": t, "val/holdout/acc": acc, "val/holdout/acc_stderr": se, "val/holdout/num_rows": 300,
           "timing_s/eval/holdout": seconds, "timing_s/eval": seconds}
    if clip is not None:  # the share of held-out answers cut at the length limit
        out["val/holdout/response_length/clip_ratio"] = clip
    return out


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
        other0, _holdout(0, 0.30, 0.02, 40.0, clip=0.33),
        _step(1, 0.25, 1000, 1000, 2000, 60.0, **{"actor/weight_rel_change": 1e-4, "probe/kl_to_base": 2e-3}),
        _step(2, 0.50, 1000, 1000, 2000, 62.5, **{"actor/weight_rel_change": 3e-4, "val/mawps/singleop/acc": 0.3,
                                                  "val/mawps/singleop/acc_stderr": 0.026,
                                                  "val/mawps/singleop/num_rows": 300, "timing_s/eval": 45.0}),
        _holdout(2, 0.40, 0.03, 38.0, clip=0.87),
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
                                                 "acc_stderr": 0.026, "rows": 300, "gain_se_paired": None,
                                                 "gain_z_paired": None}}  # no per-row files here
    assert {k: mask[k] for k in mod.FIELDS} == {
        "arm": "mask_anchor-s1", "seed": 1, "codec": "mask", "anchor": True, "iterations": 1,
        "wall_s": 41.0 + 70.0, "acc_before": 0.30, "acc_after": None, "acc_stderr": None, "heldout_rows": 300,
        "boundary_bytes_ratio": 100 / 2000}
    assert mask["gain"] is None and mask["gain_z"] is None and mask["other"] == {} and mask["launch_wall_s"] is None
    assert (dense["truncated_before"], dense["truncated_after"]) == (0.33, 0.87)
    assert (dense["kl_to_base"], dense["kl_to_base_step"], dense["weight_rel_change"]) == (2e-3, 1, 3e-4)
    assert dense["lr"] is None and mask["lr"] is None  # no config.json's optim.lr in these folders
    assert (mask["kl_to_base"], mask["weight_rel_change"]) == (None, None)
    assert (mask["truncated_before"], mask["truncated_after"]) == (None, None)

    md = (docs / "study.md").read_text()
    assert ("| dense | 1 | dense | no | 2 | 4.9 | 0.300 ± 0.020 | 0.400 ± 0.030 | +0.100 (+2.8) | 300 | 1.0000 | "
            "0.004 | 0.33 -> 0.87 |") in md  # 2 steps of 1000 + 1000 bytes: 0.004 MB
    assert "| 0.0500 | 0.0001 | - |" in md  # mask_anchor: 30 + 70 bytes; no truncation logged
    assert (dense["boundary_mb"], mask["boundary_mb"]) == (0.004, 1e-4)
    assert "| dense | 1 | 2.00e-03 | 1 | 3.00e-04 | 1.00 | 0.250 -> 0.300 |" in md  # damage to the base model
    assert "| mask_anchor-s1 | 1 | - | - | - | - | - |" in md  # no movement logged (and 1 iteration, not dense's 2)
    moved = dict(mask, weight_rel_change=6e-4)
    assert mod.movement_vs_dense(moved, [dense, moved]) is None  # 1 iteration against dense's 2: not compared
    assert mod.movement_vs_dense(dict(moved, iterations=2), [dense, moved]) == pytest.approx(2.0, rel=1e-12)
    assert mod.movement_vs_dense(dict(moved, iterations=2, seed=2), [dense]) is None  # no dense at that seed
    assert f"{mod.NOTES_BEGIN}\nThe dense arm learns.\n{mod.NOTES_END}" in md and "old" not in md.splitlines()
    pngs = {p.name for p in (docs / "study").glob("*.png")}
    # no run scored the held-out rows between before and after: no curve (the bars hold both points)
    assert pngs == {"reward.png", "mismatch.png", "fidelity_cos.png", "kl.png", "entropy.png", "kl_to_base.png",
                    "heldout_accuracy.png"}
    assert all((docs / "study" / n).stat().st_size < 200_000 for n in pngs)


def test_a_held_out_curve_is_drawn_and_the_last_evaluation_is_after(tmp_path):
    """--holdout-eval-interval: the held-out rows scored at 0, 1 and 2; "after" is the last one, and
    the curve is drawn."""
    root = tmp_path / "runs"
    _write_run(root / "dense-s1", [
        _holdout(0, 0.30, 0.02, 40.0), _step(1, 0.25, 1000, 1000, 2000, 60.0), _holdout(1, 0.50, 0.03, 40.0),
        _step(2, 0.50, 1000, 1000, 2000, 60.0), _holdout(2, 0.40, 0.03, 38.0),
    ], arm={"arm": "dense", "seed": 1, "codec": "dense", "anchor": False})
    docs = tmp_path / "docs"
    docs.mkdir()
    summary = _tool().write_report(str(root), str(docs))
    (dense,) = summary["arms"]
    assert (dense["acc_before"], dense["acc_after"]) == (0.30, 0.40)
    assert (docs / "study" / "heldout_curve.png").stat().st_size > 0


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
    assert out == mod.show_summary(str(docs), intro=True) + "\n"
    assert out.startswith("the study (docs/study.md;") and out.endswith(mod.table(summary["arms"]) + "\n")
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
    # one error missing: no z (taking it as 0 would give 0.03 / 0.018 = 1.7, inflated)
    assert mod.gain_z(0.08, None, 0.11, 0.018)[1] is None and mod.gain_z(0.08, 0.015, 0.11, None)[1] is None

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
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        mod.main(["--run", str(run), "--docs", str(docs)])  # --run without --show
    assert e.value.code == 2 and "error: --run goes with --show" in capsys.readouterr().err


# ----------------------------------------------------------------------------- paired statistics (issue 33)


def test_paired_diff_is_the_hand_computed_paired_standard_error():
    """d = after - before = [1, 0, 0, -1, 1]: mean 0.2, sample variance (0.64 + 0.04 + 0.04 + 1.44 + 0.64) / 4
    = 0.7, SE sqrt(0.7 / 5); McNemar's counts: rows 1 and 5 fixed, row 4 broken."""
    mod = _tool()
    before = {1: 0, 2: 0, 3: 1, 4: 1, 5: 0}
    after = {1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
    p = mod.paired_diff(after, before)
    assert p["diff"] == pytest.approx(0.2, abs=1e-15) and p["rows"] == 5
    assert p["se"] == pytest.approx(math.sqrt(0.14), rel=1e-12) == 0.3741657386773941
    assert p["z"] == pytest.approx(0.2 / math.sqrt(0.14), rel=1e-12)
    assert (p["a_only"], p["b_only"]) == (2, 1)
    # unpaired, the same two evaluations: se_before = sqrt(0.3 / 5), se_after = sqrt(0.3 / 5)
    assert mod.gain_z(0.4, math.sqrt(0.06), 0.6, math.sqrt(0.06))[1] == pytest.approx(0.2 / math.sqrt(0.12))
    avg = mod.paired_diff({1: 0.5, 2: 1.0}, {1: 0.0, 2: 0.5})  # avg@k scores: no McNemar counts
    assert avg["diff"] == 0.5 and avg["se"] == 0.0 and avg["z"] is None and avg["a_only"] is None
    assert mod.paired_diff({7: 1}, {7: 0})["se"] is None
    with pytest.raises(ValueError, match="same, non-empty rows: 2 ids in only one"):
        mod.paired_diff({1: 1, 2: 0}, {1: 1, 3: 0})


def test_bootstrap_fraction_values():
    mod = _tool()
    # dense gains on every row at both seeds, the arm on every row at one seed and none at the other:
    # rows do not matter; a resample's fraction is the share of its two seed draws that hit the
    # learning seed, 0, 0.5 or 1 (probabilities 1/4, 1/2, 1/4): the seeds are resampled
    b = mod.bootstrap_fraction([[1, 1, 1, 1], [0, 0, 0, 0]], [[1, 1, 1, 1], [1, 1, 1, 1]])
    assert (b["fraction"], b["low"], b["high"], b["dense_nonpositive"]) == (0.5, 0.0, 1.0, 0)
    # ... and a seed's pair stays a pair: both gain 1 at one seed and 0.5 at the other, so every
    # resample is 1 (drawn apart, the arm's seed against dense's other one would give 2 or 0.5)
    b = mod.bootstrap_fraction([[1, 1, 1, 1], [.5, .5, .5, .5]], [[1, 1, 1, 1], [.5, .5, .5, .5]])
    assert b == {"fraction": 1.0, "low": 1.0, "high": 1.0, "resamples": 2000, "seed": 0, "dense_nonpositive": 0}
    # two rows: a resample's fraction is 0, 0.5 or 1 (probabilities 1/4, 1/2, 1/4): the 2.5 % and 97.5 % points
    b = mod.bootstrap_fraction([[1, 0]], [[1, 1]], resamples=2000, seed=3)
    assert (b["fraction"], b["low"], b["high"], b["seed"]) == (0.5, 0.0, 1.0, 3)
    # dense's gain is 0 in the resamples that draw only its second row (1/4): counted, and as +inf
    b = mod.bootstrap_fraction([[1, 1]], [[1, 0]])
    assert b["fraction"] == 2.0 and b["low"] == 1.0 and b["high"] == math.inf
    assert 400 < b["dense_nonpositive"] < 600
    assert mod.bootstrap_fraction([[1, 1]], [[1, 0]]) == b  # fixed seed: the same interval every time
    with pytest.raises(ValueError, match="per-seed lists of the same rows at the same seeds"):
        mod.bootstrap_fraction([[1, 0, 1]], [[1, 1]])
    with pytest.raises(ValueError, match="at the same seeds, got shapes \\(2, 2\\) and \\(1, 2\\)"):
        mod.bootstrap_fraction([[1, 0], [0, 1]], [[1, 1]])


#: Ten held-out rows (line numbers of the training file) and their 0/1 correctness.
_IDS = [3, 7, 11, 12, 20, 31, 40, 41, 55, 60]
_BEFORE = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
_AFTER = {("dense", 1): [1, 1, 1, 1, 0, 0, 0, 0, 1, 1], ("dense", 2): [1, 1, 0, 0, 0, 0, 0, 0, 1, 1],
          ("mask_anchor", 1): [1, 1, 0, 0, 0, 0, 0, 0, 1, 0], ("mask_anchor", 2): [1, 0, 0, 0, 0, 0, 0, 0, 1, 1]}


def _rows_file(run: Path, name, step, scores, ids=_IDS, digest="0000abcd"):
    d = run / "eval_rows"
    d.mkdir(exist_ok=True)
    head = {"schema": "megatron_cegrpo.eval_rows/1", "eval": name, "step": step, "mode": "greedy", "k": 1,
            "num_rows": len(ids), "acc": sum(scores) / len(scores), "rows_digest": digest}
    path = d / f"{name.replace('/', ',')}-step{step}.jsonl"
    path.write_text("\n".join([json.dumps(head)] + [json.dumps({"row": i, "score": s}) for i, s in zip(ids, scores)])
                    + "\n")
    return path


def _se(scores):
    m = sum(scores) / len(scores)
    return math.sqrt(sum((x - m) ** 2 for x in scores) / (len(scores) - 1) / len(scores))


def _ev(t, scores):
    """The held-out record at step ``t`` of 10 rows scored ``scores``."""
    return {"step": t, "val/holdout/acc": sum(scores) / 10, "val/holdout/acc_stderr": _se(scores),
            "val/holdout/num_rows": 10, "timing_s/eval": 1.0}


def _paired_run(root: Path, arm, seed, after, rows=True):
    recs = [{"step": 0, "val/holdout/acc": sum(_BEFORE) / 10, "val/holdout/acc_stderr": _se(_BEFORE),
             "val/holdout/num_rows": 10, "timing_s/eval": 1.0},
            _step(1, 0.1, 30, 70, 2000, 10.0), _step(2, 0.1, 30, 70, 2000, 10.0),
            {"step": 2, "val/holdout/acc": sum(after) / 10, "val/holdout/acc_stderr": _se(after),
             "val/holdout/num_rows": 10, "timing_s/eval": 1.0}]
    run = root / f"{arm}-s{seed}"
    _write_run(run, recs, arm={"arm": arm, "seed": seed, "codec": "dense" if arm == "dense" else "mask",
                               "anchor": arm != "dense"})
    if rows:
        _rows_file(run, "holdout", 0, _BEFORE)
        _rows_file(run, "holdout", 2, after)
    return run


@pytest.fixture()
def paired_study(tmp_path):
    root = tmp_path / "live"
    for (arm, seed), after in _AFTER.items():
        _paired_run(root, arm, seed, after)
    _paired_run(root, "lowrank", 1, _BEFORE, rows=False)  # an arm that kept no per-row files
    return root


def test_report_with_per_row_files(paired_study, tmp_path):
    """A synthetic study with per-row files: each arm's paired SE of its gain, the arm against dense
    at the same seed, the fraction of dense's mean gain with its bootstrap interval; the arm without
    per-row files shows n/a; the per-row files are archived and a report from the archive alone
    gives the same summary."""
    mod = _tool()
    docs = tmp_path / "docs"
    s = mod.write_report(str(paired_study), str(docs))
    arms = {(a["arm"], a["seed"]): a for a in s["arms"]}
    d1, m1, low = arms[("dense", 1)], arms[("mask_anchor", 1)], arms[("lowrank", 1)]
    # dense seed 1: d = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]: mean 0.4, sample variance 2.4 / 9
    assert d1["per_row"] is True and d1["gain"] == pytest.approx(0.4)
    assert d1["gain_se_paired"] == pytest.approx(math.sqrt(2.4 / 9 / 10), rel=1e-12)
    assert d1["gain_z_paired"] == pytest.approx(0.4 / math.sqrt(2.4 / 90), rel=1e-12)
    assert (d1["rows_gained"], d1["rows_lost"], d1["vs_dense"]) == (4, 0, None)
    assert d1["gain_z"] == pytest.approx(0.4 / math.hypot(_se(_BEFORE), _se(_AFTER[("dense", 1)])))  # unpaired kept
    # mask + anchor seed 1: d = [1, 1, 0, 0, 0, 0, 0, 0, 0, -1]: mean 0.1, sample variance
    # (2 x 0.81 + 7 x 0.01 + 1.21) / 9 = 2.9 / 9
    assert m1["gain_se_paired"] == pytest.approx(math.sqrt(2.9 / 90), rel=1e-12)
    assert (m1["rows_gained"], m1["rows_lost"]) == (2, 1)
    # against dense seed 1 after training: arm - dense = [0, 0, -1, -1, 0, 0, 0, 0, 0, -1]: -0.3, variance 2.1 / 9
    v = m1["vs_dense"]
    assert v["dense_seed"] == 1 and v["rows"] == 10 and (v["arm_only"], v["dense_only"]) == (0, 3)
    assert v["diff"] == pytest.approx(-0.3) and v["se"] == pytest.approx(math.sqrt(2.1 / 90), rel=1e-12)
    assert v["z"] == pytest.approx(-0.3 / math.sqrt(2.1 / 90), rel=1e-12)
    assert low["per_row"] is False and low["gain_se_paired"] is None and low["vs_dense"] is None
    # fraction: mask + anchor gained 0.1 at both seeds, dense 0.4 and 0.2
    frac = {e["arm"]: e for e in s["fraction_of_dense"]}
    fa = frac["mask_anchor"]
    assert fa["seeds"] == [1, 2] and fa["dense_seeds"] == [1, 2]
    assert fa["mean_gain"] == pytest.approx(0.1) and fa["dense_mean_gain"] == pytest.approx(0.3)
    assert fa["fraction"] == pytest.approx(1 / 3)
    assert fa["resamples"] == 2000 and fa["bootstrap_seed"] == 0 and fa["low"] < 1 / 3 < fa["high"]
    b = mod.bootstrap_fraction([[x - y for x, y in zip(_AFTER[("mask_anchor", k)], _BEFORE)] for k in (1, 2)],
                               [[x - y for x, y in zip(_AFTER[("dense", k)], _BEFORE)] for k in (1, 2)])
    assert (fa["low"], fa["high"], fa["dense_nonpositive"]) == (b["low"], b["high"], b["dense_nonpositive"])
    assert frac["lowrank"]["fraction"] == 0.0 and frac["lowrank"]["low"] is None  # no per-row files: no interval
    assert s["bootstrap"]["resamples"] == 2000 and s["bootstrap"]["resampled"] == "seeds, then held-out rows"
    # strict JSON (no Infinity / NaN tokens): an open interval's end is written "inf" / "-inf"
    json.loads((docs / "study" / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert mod._strict_json({"a": [math.inf, -math.inf, math.nan, 0.5, "x"], "b": (1, math.inf)}) == {
        "a": ["inf", "-inf", None, 0.5, "x"], "b": [1, "inf"]}

    md = (docs / "study.md").read_text()
    z1 = 0.4 / math.sqrt(2.4 / 90)
    assert (f"| dense | 1 | +0.400 | {math.sqrt(2.4 / 90):.3f} | +{z1:.1f} | "
            f"+{d1['gain_z']:.1f} | 4 / 0 | - | - | - | - |") in md
    assert (f"| mask_anchor | 1 | +0.100 | 0.180 | +0.6 | +{m1['gain_z']:.1f} | 2 / 1 | -0.300 | 0.153 | -2.0 | "
            "0 / 3 |") in md
    assert "| lowrank | 1 | +0.000 | n/a | n/a | +0.0 | n/a | n/a | n/a | n/a | n/a |" in md
    assert f"| mask_anchor | 1, 2 | +0.100 | +0.300 (1, 2) | 0.33 | {fa['low']:.2f} to {fa['high']:.2f} |" in md
    assert "| lowrank | 1 | +0.000 | +0.400 (1) | 0.00 | n/a |" in md  # dense at lowrank's seed only
    assert "## Method" in md and "2000 resamples: the seeds drawn with replacement" in md

    archived = docs / "study" / "runs" / "mask_anchor-s1" / "eval_rows"
    assert sorted(p.name for p in archived.iterdir()) == ["holdout-step0.jsonl", "holdout-step2.jsonl"]
    assert not (docs / "study" / "runs" / "lowrank-s1" / "eval_rows").exists()
    import shutil
    shutil.rmtree(paired_study)
    again = mod.write_report(str(paired_study), str(docs))
    assert again["arms"] == json.loads(json.dumps(s["arms"])) and again["fraction_of_dense"] == s["fraction_of_dense"]


def test_other_data_sets_get_the_paired_gain(paired_study, tmp_path):
    mod = _tool()
    run = paired_study / "dense-s1"
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    recs[0].update({"val/mawps/multiarith/acc": 0.0, "val/mawps/multiarith/acc_stderr": 0.0,
                    "val/mawps/multiarith/num_rows": 4})
    recs[2].update({"val/mawps/multiarith/acc": 0.5, "val/mawps/multiarith/acc_stderr": _se([1, 1, 0, 0]),
                    "val/mawps/multiarith/num_rows": 4})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    _rows_file(run, "mawps/multiarith", 0, [0, 0, 0, 0], ids=[1, 2, 3, 4])
    _rows_file(run, "mawps/multiarith", 2, [1, 1, 0, 0], ids=[1, 2, 3, 4])
    docs = tmp_path / "docs"
    s = mod.write_report(str(paired_study), str(docs))
    o = next(a for a in s["arms"] if (a["arm"], a["seed"]) == ("dense", 1))["other"]["mawps/multiarith"]
    assert o["gain_se_paired"] == pytest.approx(_se([1, 1, 0, 0]), rel=1e-12)  # before all 0: d = after
    assert o["gain_z_paired"] == pytest.approx(0.5 / _se([1, 1, 0, 0]), rel=1e-12)
    md = (docs / "study.md").read_text()
    assert (f"- dense seed 1: 0.000 ± 0.000 -> 0.500 ± {_se([1, 1, 0, 0]):.3f} (4 rows; gain's paired SE "
            f"{_se([1, 1, 0, 0]):.3f}, z +{0.5 / _se([1, 1, 0, 0]):.1f})") in md
    assert (docs / "study" / "runs" / "dense-s1" / "eval_rows" / "mawps,multiarith-step2.jsonl").is_file()


@pytest.mark.parametrize("breakage, file, message", [
    ("other_acc", "mask_anchor-s1/eval_rows/holdout-step2.jsonl",
     ": 10 rows at accuracy 0.4000, but the run's metrics.jsonl logs 10 rows at 0.3000 for val/holdout at step 2: "
     "not this run's rows; fix: put the run's own file there"),
    ("other_rows", "mask_anchor-s1/eval_rows/holdout-step2.jsonl",
     ": not the rows of "),
    ("other_study", "mask_anchor-s1/eval_rows/holdout-step2.jsonl",
     ": rows digest 99999999, but "),
    ("cut", "mask_anchor-s1/eval_rows/holdout-step2.jsonl", ", line 10: not a {\"row\", \"score\"} object"),
])
def test_a_rows_file_that_does_not_match_is_one_error_line(paired_study, tmp_path, capsys, breakage, file,
                                                           message):
    """A per-row file of another run (its accuracy is not the one the run logged), of other rows
    than its before-file, of other held-out rows than dense's (another --holdout-seed), or cut
    short: main() prints one line naming the file and the fix and exits 2."""
    mod = _tool()
    run = paired_study / "mask_anchor-s1"
    after = _AFTER[("mask_anchor", 1)]
    if breakage == "other_acc":
        _rows_file(run, "holdout", 2, _AFTER[("dense", 2)])
    elif breakage == "other_rows":
        _rows_file(run, "holdout", 2, after, ids=[i + 1 for i in _IDS], digest="0000abce")
    elif breakage == "other_study":
        _rows_file(run, "holdout", 0, _BEFORE, ids=[i + 1 for i in _IDS], digest="99999999")
        _rows_file(run, "holdout", 2, after, ids=[i + 1 for i in _IDS], digest="99999999")
    else:
        p = run / "eval_rows" / "holdout-step2.jsonl"
        p.write_text(p.read_text()[:-30])
    docs = tmp_path / "docs"
    assert mod.main([str(paired_study), "--docs", str(docs)]) == 2
    err = capsys.readouterr().err
    path = docs / "study" / "runs" / file  # the archived copy is what the report reads
    assert err.startswith(f"error: {path}{message}"), err
    assert len(err.splitlines()) == 1 and "fix: " in err


def test_the_committed_archive_without_per_row_files_still_builds(tmp_path):
    """The arms archived before issue 33 have no per-row files: the report builds from the archive
    alone, every paired cell n/a, the unpaired columns and the main table unchanged, and each arm's
    fraction of dense's mean gain from the logged gains, without an interval."""
    import shutil
    mod = _tool()
    repo_docs = _TOOL.parents[1] / "docs"
    docs = tmp_path / "docs"
    shutil.copytree(repo_docs / "study" / "runs", docs / "study" / "runs")
    shutil.copyfile(repo_docs / "study" / "summary.json", docs / "study" / "summary.json")
    shutil.copyfile(repo_docs / "study.md", docs / "study.md")
    committed = json.loads((repo_docs / "study" / "summary.json").read_text())
    s = mod.write_report(str(tmp_path / "nonexistent"), str(docs))
    assert [{k: a[k] for k in mod.FIELDS} for a in s["arms"]] == [{k: a[k] for k in mod.FIELDS}
                                                                   for a in committed["arms"]]
    assert all(a["per_row"] is False and a["gain_se_paired"] is None and a["vs_dense"] is None for a in s["arms"])
    assert all(e["low"] is None and e["dense_seeds"] == e["seeds"] for e in s["fraction_of_dense"])
    dense_gain = sum(a["gain"] for a in committed["arms"] if a["arm"] == "dense") / 2
    ma = next(e for e in s["fraction_of_dense"] if e["arm"] == "mask_anchor")
    assert ma["fraction"] == pytest.approx(ma["mean_gain"] / dense_gain) and ma["seeds"] == [1234, 4321]
    one = next(e for e in s["fraction_of_dense"] if e["arm"] == "mask")  # one seed: dense at that seed
    dense_1234 = next(a["gain"] for a in committed["arms"] if (a["arm"], a["seed"]) == ("dense", 1234))
    assert one["seeds"] == [1234] and one["fraction"] == pytest.approx(one["mean_gain"] / dense_1234)
    md = (docs / "study.md").read_text()
    assert mod.table(s["arms"]) in md and mod.table(committed["arms"]) in md
    assert "| mask_anchor | 4321 | +0.047 | n/a | n/a | +1.9 | n/a | n/a | n/a | n/a | n/a |" in md


def test_a_named_study_beside_the_first(study, tmp_path):
    """--name/--title: another study (e.g. the bf16 arms) gets its own page, folder and archive, and
    --show reads it; the first study's files are not touched."""
    mod = _tool()
    docs = tmp_path / "docs"
    assert mod.main([str(study), "--docs", str(docs), "--name", "study_bf16", "--title", "CPU study in bf16"]) == 0
    md = (docs / "study_bf16.md").read_text()
    assert md.startswith("# CPU study in bf16\n") and "](study_bf16/reward.png)" in md
    assert mod.main([str(study), "--docs", str(docs), "--name", "study_bf16"]) == 0  # a rewrite keeps the title
    assert (docs / "study_bf16.md").read_text().startswith("# CPU study in bf16\n")
    assert sorted(p.name for p in (docs / "study_bf16" / "runs").iterdir()) == ["dense-s1", "mask_anchor-s1"]
    assert not (docs / "study.md").exists() and not (docs / "study").exists()
    summary = json.loads((docs / "study_bf16" / "summary.json").read_text())
    assert mod.show_summary(str(docs), name="study_bf16") == mod.table(summary["arms"])
    assert mod.show_summary(str(docs), intro=True, name="study_bf16").startswith("the study (docs/study_bf16.md;")


def test_run_line_is_paired_with_the_runs_per_row_files(tmp_path):
    """make demo's line uses the paired bar (issue 33 item 7) when the run kept both evaluations'
    per-row files: dense seed 1's rows, 4 fixed and 0 broken of 10, gain +0.4, paired SE from the
    per-row differences; the unpaired z stays beside it. A per-row file from another run is refused."""
    mod = _tool()
    run = _paired_run(tmp_path, "dense", 1, _AFTER[("dense", 1)])
    ev = lambda acc, se: {"val/holdout/acc": acc, "val/holdout/acc_stderr": se, "val/holdout/num_rows": 300}
    (run / "summary.json").write_text(json.dumps({"initial": ev(0.2, _se(_BEFORE)),
                                                  "final": ev(0.6, _se(_AFTER[("dense", 1)])),
                                                  "last_metrics": {"step": 2}}))
    d = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]  # after - before, row by row
    se = math.sqrt(sum((x - 0.4) ** 2 for x in d) / 9 / 10)
    z_unpaired = 0.4 / math.hypot(_se(_BEFORE), _se(_AFTER[("dense", 1)]))
    assert mod.run_line(str(run)) == (
        f"this run ({run}, 2 iterations, 300 held-out rows): 0.200 ± {_se(_BEFORE):.3f} -> 0.600 ± "
        f"{_se(_AFTER[('dense', 1)]):.3f}, gain +0.400 (paired SE {se:.3f}, z +{0.4 / se:.1f}: 4 rows fixed, 0 broken; "
        f"unpaired z +{z_unpaired:.1f}): below 3 paired standard errors, so not evidence of learning")
    _rows_file(run, "holdout", 2, _AFTER[("dense", 2)])  # another run's rows: accuracy 0.4, not the logged 0.6
    with pytest.raises(ValueError, match="not this run's rows"):
        mod.run_line(str(run))


def test_an_arm_run_with_other_numerics_is_not_paired_with_dense(paired_study, tmp_path):
    """Two runs whose evaluations before training (the same base weights, greedy) disagree ran with
    other arithmetic (bf16 on another CPU): no paired test against dense, the table says why."""
    mod = _tool()
    run = paired_study / "mask_anchor-s2"
    other = [1, 0, 0, 0, 0, 0, 0, 0, 1, 0]  # 2 rows differ from _BEFORE, same accuracy
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert recs[0]["val/holdout/acc"] == sum(other) / 10
    _rows_file(run, "holdout", 0, other)
    s = mod.write_report(str(paired_study), str(tmp_path / "docs"))
    arms = {(a["arm"], a["seed"]): a for a in s["arms"]}
    assert arms[("mask_anchor", 2)]["vs_dense"] == {"dense_seed": 2, "numerics_differ": 2, "lengths_differ": False}
    assert arms[("mask_anchor", 1)]["vs_dense"]["rows"] == 10  # the same numerics: paired as before
    md = (tmp_path / "docs" / "study.md").read_text()
    assert "| other numerics (2 rows differ before training) | - | - | - |" in md


def test_answers_of_another_length_before_training_are_other_numerics(paired_study, tmp_path):
    """Every row scored alike before training, but the base model's greedy answers had another mean
    length (``val/holdout/response_length/mean`` at step 0): other kernels that only changed rows
    both got wrong; not paired with dense. The same length, or none logged, pairs as before."""
    mod = _tool()

    def set_len(run, value):
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        recs[0]["val/holdout/response_length/mean"] = value
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")

    set_len(paired_study / "dense-s2", 35.7)
    set_len(paired_study / "mask_anchor-s2", 36.1)
    set_len(paired_study / "mask_anchor-s1", 35.7)  # dense-s1 logged none: no fingerprint to compare
    s = mod.write_report(str(paired_study), str(tmp_path / "docs"))
    arms = {(a["arm"], a["seed"]): a for a in s["arms"]}
    assert arms[("mask_anchor", 2)]["resp_len_before"] == 36.1
    assert arms[("mask_anchor", 2)]["vs_dense"] == {"dense_seed": 2, "numerics_differ": 0, "lengths_differ": True}
    assert arms[("mask_anchor", 1)]["vs_dense"]["rows"] == 10
    md = (tmp_path / "docs" / "study.md").read_text()
    assert "| other numerics (answers before training differ in length) | - | - | - |" in md


def test_two_runs_of_one_arm_and_seed_are_refused(paired_study, tmp_path):
    """The comparisons key runs by (arm, seed): a second folder of mask_anchor seed 1 would silently
    stand for both, so the report stops with a line naming the two."""
    import shutil

    mod = _tool()
    shutil.copytree(paired_study / "mask_anchor-s1", paired_study / "mask_anchor-s1-again")
    with pytest.raises(ValueError, match=r"mask_anchor-s1-again: arm 'mask_anchor' seed 1 again \(also "
                                         r".*mask_anchor-s1\); fix: keep one"):
        mod.write_report(str(paired_study), str(tmp_path / "docs"))


def test_the_fraction_pairs_seeds_and_names_a_seed_dense_lacks():
    """An arm run at seeds 2 and 3 against dense at 1 and 2: the fraction is the arm's seed-2 gain over
    dense's seed-2 gain (not over dense's mean of 1 and 2), seed 3 is named, and without per-row files
    there is no interval."""
    mod = _tool()
    arms = [{"arm": "dense", "seed": 1, "gain": 0.4}, {"arm": "dense", "seed": 2, "gain": 0.2},
            {"arm": "x", "seed": 2, "gain": 0.05}, {"arm": "x", "seed": 3, "gain": 0.3}]
    (e,) = mod.fractions_of_dense(arms, {})
    assert (e["seeds"], e["no_dense"], e["dense_seeds"]) == ([2], [3], [2])
    assert e["fraction"] == pytest.approx(0.25) and e["low"] is None
    assert "| x | 2 (3 left out: no dense run) | +0.050 | +0.200 (2) | 0.25 | n/a |" in mod.fraction_table([e])
    # no seed in common: a row that says so, with nothing to divide
    (e,) = mod.fractions_of_dense([{"arm": "dense", "seed": 1, "gain": 0.4}, {"arm": "x", "seed": 3, "gain": 0.1}], {})
    assert (e["seeds"], e["no_dense"], e["mean_gain"], e["fraction"]) == ([], [3], None, None)
    assert "| x | (3 left out: no dense run) | - | - | - | - |" in mod.fraction_table([e])


def test_the_fraction_names_a_dense_run_of_another_length():
    """Dense at seed 2 ran 160 iterations, the arm 48: its gain is at another step, so the entry
    names dense's count at that seed and the table cell says so; equal counts name nothing."""
    mod = _tool()
    arms = [{"arm": "dense", "seed": 1, "gain": 0.4, "iterations": 48},
            {"arm": "dense", "seed": 2, "gain": 0.2, "iterations": 160},
            {"arm": "x", "seed": 1, "gain": 0.1, "iterations": 48}, {"arm": "x", "seed": 2, "gain": 0.1, "iterations": 48}]
    (e,) = mod.fractions_of_dense(arms, {})
    assert e["dense_iterations"] == {2: 160} and e["fraction"] == pytest.approx(0.1 / 0.3)
    assert "| +0.300 (1, 2) (dense after 160 iterations at 2) | 0.33 |" in mod.fraction_table([e])
    (e,) = mod.fractions_of_dense(arms[:1] + arms[2:3], {})
    assert e["dense_iterations"] is None and "dense after" not in mod.fraction_table([e])


def test_a_seed_whose_anchor_was_lost_is_left_out_of_the_fraction(paired_study):
    """mask + anchor seed 2 lost its anchor (``anchor/alive`` 0 from step 2): it does not measure
    the arm, so the fraction of dense's gain is seed 1's alone against dense's at seed 1 (0.1 / 0.4),
    and the table names the seed it left out."""
    mod = _tool()
    run = paired_study / "mask_anchor-s2"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    for r in recs:
        if r["step"] == 2 and "critic/score/mean" in r:
            r["anchor/alive"] = 0
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    arms, rows = [], {}
    for d in sorted(paired_study.iterdir()):
        arms.append(mod.summarize_run(str(d), rows))
    assert [a["anchor_lost_step"] for a in arms if a["arm"] == "mask_anchor"] == [None, 2]
    frac = {e["arm"]: e for e in mod.fractions_of_dense(arms, rows)}["mask_anchor"]
    assert (frac["seeds"], frac["left_out"]) == ([1], [2])
    assert frac["mean_gain"] == pytest.approx(0.1) and frac["fraction"] == pytest.approx(0.1 / 0.4)
    assert frac["dense_seeds"] == [1] and frac["dense_mean_gain"] == pytest.approx(0.4)
    assert "| mask_anchor | 1 (2 left out: anchor lost) | +0.100 |" in mod.fraction_table([frac])
    # every seed lost: the arm keeps its row, naming them, with nothing to divide
    (e,) = mod.fractions_of_dense([{"arm": "dense", "seed": 1, "gain": 0.4},
                                   {"arm": "x", "seed": 1, "gain": 0.1, "anchor_lost_step": 3}], {})
    assert (e["seeds"], e["left_out"], e["fraction"]) == ([], [1], None)
    assert "| x | (1 left out: anchor lost) | - | - | - | - |" in mod.fraction_table([e])


def test_the_anchor_cell_states_c_and_k(tmp_path):
    """Issue 33 item 4 ("state c = K for each"): the anchor column shows the cadence and delay of
    the run's config.json, with a lost anchor after them; without a config it says yes."""
    mod = _tool()
    root = tmp_path / "runs"
    recs = [_holdout(0, 0.30, 0.02, 41.0), _step(1, 0.1, 30, 70, 2000, 70.0), _holdout(1, 0.25, 0.02, 41.0)]
    lost = [_holdout(0, 0.30, 0.02, 41.0), _step(1, 0.1, 30, 70, 2000, 70.0, **{"anchor/alive": 0}),
            _holdout(1, 0.25, 0.02, 41.0)]
    cfg = lambda c, k: {"optim": {"seed": 1}, "codec": {"boundary_codec": "mask"},  # noqa: E731
                        "anchor": {"anchor_ranks": 1, "anchor_interval": c, "anchor_delay": k}}
    arm = lambda seed: {"arm": "mask_anchor", "seed": seed, "codec": "mask", "anchor": True}  # noqa: E731
    _write_run(root / "mask_anchor-s1", recs, arm=arm(1), config=cfg(8, 8))
    _write_run(root / "mask_anchor-s2", recs, arm=arm(2), config=cfg(8, 4))
    _write_run(root / "mask_anchor-s3", lost, arm=arm(3), config=cfg(4, 4))
    _write_run(root / "mask_anchor-s4", recs, arm=arm(4))
    docs = tmp_path / "docs"
    assert mod.main([str(root), "--docs", str(docs)]) == 0
    md = (docs / "study.md").read_text()
    assert "| mask_anchor | 1 | mask | c = K = 8 | 1 |" in md
    assert "| mask_anchor | 2 | mask | c = 8, K = 4 | 1 |" in md
    assert "| mask_anchor | 3 | mask | c = K = 4, **lost at step 1** | 1 |" in md
    assert "| mask_anchor | 4 | mask | yes | 1 |" in md
    summary = json.loads((docs / "study" / "summary.json").read_text())
    assert [(a["anchor_interval"], a["anchor_delay"]) for a in summary["arms"]] == [(8, 8), (8, 4), (4, 4), (None, None)]


def test_base_arm_is_the_longest_named_prefix():
    mod = _tool()
    names = {"dense", "dense_filter", "mask", "mask_anchor", "mask_anchor_dense16", "pcaq/every=2:lrq",
             "pcaq/every=2:lrq_anchor", "lowrank_anchorq"}
    assert mod.base_arm("dense_filter", names) == "dense"
    assert mod.base_arm("mask_anchor_dense16", names) == "mask_anchor"
    assert mod.base_arm("mask_anchor_dense16_filter", names) == "mask_anchor_dense16"
    assert mod.base_arm("mask_anchor", names) == "mask"
    assert mod.base_arm("pcaq/every=2:lrq_anchor", names) == "pcaq/every=2:lrq"
    assert mod.base_arm("lowrank_anchorq", names) is None  # no "lowrank" arm
    assert mod.base_arm("dense", names) is None


def test_a_variant_is_paired_with_the_arm_it_varies(paired_study, tmp_path):
    """dense_filter at seed 1 (dynamic sampling: 2.5 generation rounds an iteration, 30 s of training
    where dense took 20) against dense at seed 1: both gains, gain per training hour, and the paired
    difference of the after-evaluations on the same rows; a variant whose base did not run at its seed
    gets no row."""
    mod = _tool()
    after = [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]  # dense s1's after plus row 20
    recs = [{"step": 0, "val/holdout/acc": 0.2, "val/holdout/acc_stderr": _se(_BEFORE),
             "val/holdout/num_rows": 10, "timing_s/eval": 1.0},
            _step(1, 0.5, 30, 70, 2000, 12.0, **{"batch/num_gen_batches": 2, "timing_s/gen": 8.0}),
            _step(2, 0.5, 30, 70, 2000, 18.0, **{"batch/num_gen_batches": 3, "timing_s/gen": 12.0}),
            {"step": 2, "val/holdout/acc": 0.7, "val/holdout/acc_stderr": _se(after),
             "val/holdout/num_rows": 10, "timing_s/eval": 1.0}]
    for seed in (1, 3):  # seed 3: dense did not run there
        run = paired_study / f"dense_filter-s{seed}"
        _write_run(run, recs, arm={"arm": "dense_filter", "seed": seed, "codec": "dense", "anchor": False})
        _rows_file(run, "holdout", 0, _BEFORE)
        _rows_file(run, "holdout", 2, after)
    s = mod.write_report(str(paired_study), str(tmp_path / "docs"))
    v = {(e["arm"], e["seed"]): e for e in s["variants"]}
    assert set(v) == {("dense_filter", 1)}  # seed 3 has no dense; mask_anchor's base, mask, did not run
    e = v[("dense_filter", 1)]
    assert (e["base"], e["train_s"], e["base_train_s"], e["gen_rounds_mean"]) == ("dense", 30.0, 20.0, 2.5)
    assert e["gain"] == pytest.approx(0.5) and e["base_gain"] == pytest.approx(0.4)
    assert e["gain_per_hour"] == pytest.approx(0.5 / (30 / 3600)) and e["base_gain_per_hour"] == pytest.approx(72.0)
    # after - dense's after = [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]: mean 0.1, sample variance 0.9 / 9
    assert (e["diff"], e["rows"], e["arm_only"], e["base_only"]) == (pytest.approx(0.1), 10, 1, 0)
    assert e["se"] == pytest.approx(math.sqrt(0.1 / 10), rel=1e-12) and e["z"] == pytest.approx(0.1 / math.sqrt(0.01))
    md = (tmp_path / "docs" / "study.md").read_text()
    assert ("| dense_filter | 1 | dense | +0.500 / +0.400 | 0.5 / 0.3 | +60.000 / +72.000 | 2.50 | +0.100 | 0.100 | "
            "+1.0 | 1 / 0 | - |") in md
    assert e["same_step"] is None  # dense scored the held-out rows only before and after


def test_a_shorter_variant_is_also_paired_at_its_own_last_iteration(tmp_path):
    """dense ran 4 iterations and scored the held-out rows at 2 as well (--holdout-eval-interval);
    dense_filter ran 2: besides against dense's after (0.6), it is paired with dense at iteration 2
    (0.4), the same number of steps, on the same rows."""
    mod = _tool()
    mid, after, filt = [1, 1, 0, 0, 0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]

    root = tmp_path / "live"
    dense = root / "dense-s1"
    _write_run(dense, [_ev(0, _BEFORE)] + [_step(t, 0.1, 30, 70, 2000, 10.0) for t in (1, 2)] + [_ev(2, mid)]
               + [_step(t, 0.1, 30, 70, 2000, 10.0) for t in (3, 4)] + [_ev(4, after)],
               arm={"arm": "dense", "seed": 1, "codec": "dense", "anchor": False})
    for t, scores in ((0, _BEFORE), (2, mid), (4, after)):
        _rows_file(dense, "holdout", t, scores)
    run = root / "dense_filter-s1"
    _write_run(run, [_ev(0, _BEFORE)] + [_step(t, 0.1, 30, 70, 2000, 20.0) for t in (1, 2)] + [_ev(2, filt)],
               arm={"arm": "dense_filter", "seed": 1, "codec": "dense", "anchor": False})
    for t, scores in ((0, _BEFORE), (2, filt)):
        _rows_file(run, "holdout", t, scores)
    s = mod.write_report(str(root), str(tmp_path / "docs"))
    (e,) = s["variants"]
    # against dense's after, which is at another step: said in vs_dense and in the paired table
    (f,) = [a for a in s["arms"] if a["arm"] == "dense_filter"]
    assert f["vs_dense"]["dense_iterations"] == 4 and f["vs_dense"]["diff"] == pytest.approx(-0.1)
    assert "| -0.100 (dense after 4 iterations) | 0.100 | -1.0 | 0 / 1 |" in (tmp_path / "docs" / "study.md").read_text()
    # against dense's after: filt - after = [0, 0, 0, -1, 0, ...]
    assert (e["diff"], e["arm_only"], e["base_only"]) == (pytest.approx(-0.1), 0, 1)
    # at iteration 2: filt - mid = [0, 0, 1, 0, ...]: mean 0.1, sample variance 0.9 / 9, SE sqrt(0.1 / 10)
    st = e["same_step"]
    assert (st["step"], st["rows"], st["arm_only"], st["base_only"]) == (2, 10, 1, 0)
    assert st["base_acc"] == pytest.approx(0.4) and st["diff"] == pytest.approx(0.1)
    assert st["se"] == pytest.approx(0.1, rel=1e-12) and st["z"] == pytest.approx(1.0)
    md = (tmp_path / "docs" / "study.md").read_text()
    assert "| -0.100 | 0.100 | -1.0 | 0 / 1 | iteration 2: 0.400, +0.100 (0.100, +1.0) |" in md


def test_progress_reports_an_unfinished_arm_with_its_paired_gain_so_far(tmp_path, capsys):
    """--progress: a run of 4 iterations stopped after iteration 3, held-out rows scored at 0 and 2:
    the line gives 3/4, the minutes of its steps and the paired gain at 2 (hand-computed); a finished
    arm without per-row files gets its gains without the paired fields; nothing is written."""
    mod = _tool()
    mid = [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]  # against _BEFORE: rows 0-2 fixed, none broken

    root = tmp_path / "live"
    run = root / "dense-s1"
    _write_run(run, [_ev(0, _BEFORE)] + [_step(t, 0.1, 30, 70, 2000, 30.0) for t in (1, 2)] + [_ev(2, mid)]
               + [_step(3, 0.1, 30, 70, 2000, 60.0)],
               arm={"arm": "dense", "seed": 1, "codec": "dense", "anchor": False},
               config={"optim": {"seed": 1, "train_iters": 4}}, done=False)
    _rows_file(run, "holdout", 0, _BEFORE)
    _rows_file(run, "holdout", 2, mid)
    p = mod.progress(str(run))
    assert (p["iterations"], p["train_iters"], p["finished"], p["state"]) == (3, 4, False, "running")
    assert (p["pace_s"], p["eta_min"]) == (30.0, 0.5)  # median of 30, 30, 60 s; 1 iteration left
    assert p["train_min"] == pytest.approx(2.0)
    (e,) = p["heldout"]
    # d = mid - before = [1, 1, 1, 0, ...]: mean 0.3, sample variance (3 * 0.49 + 7 * 0.09) / 9 = 2.1 / 9
    assert (e["step"], e["fixed"], e["broken"]) == (2, 3, 0)
    assert e["gain"] == pytest.approx(0.3) and e["se"] == pytest.approx(math.sqrt(2.1 / 9 / 10))
    _paired_run(root, "mask_anchor", 1, mid, rows=False)
    before_files = sorted(p.name for p in tmp_path.rglob("*"))
    assert mod.main([str(root), "--progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    se = f"{math.sqrt(2.1 / 9 / 10):.3f}"
    assert out == [f"dense s1: 3/4 iterations (running, 0.5 min of training left at 30 s an iteration), 2.0 min "
                   f"of training; held-out 0.200 at 0, "
                   f"0.500 at 2 (+0.300, paired SE {se}, z +{0.3 / math.sqrt(2.1 / 9 / 10):.1f}: 3 fixed, 0 broken)",
                   "mask_anchor s1: 2/? iterations (finished), 0.3 min of training; held-out 0.200 at 0, "
                   "0.500 at 2 (+0.300)"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before_files
    # no line written for longer than STALE_MIN: idle, and for how long (the clock moved, not the files)
    later = os.path.getmtime(run / "metrics.jsonl") + 60 * (mod.STALE_MIN + 27)
    p = mod.progress(str(run), now=later)
    assert (p["state"], round(p["idle_min"]), p["eta_min"]) == ("idle", mod.STALE_MIN + 27, 0.5)
    hour_ago = time.time() - 3600
    for f in ("metrics.jsonl", "train.log"):
        if (run / f).exists():
            os.utime(run / f, (hour_ago, hour_ago))
    assert mod.main([str(root), "--progress"]) == 0
    assert capsys.readouterr().out.startswith("dense s1: 3/4 iterations (no output for 60 min: stopped, or "
                                              "waiting for the study's lock), 2.0 min of training;")


def test_progress_shows_the_drift_signs_at_each_evaluation(tmp_path, capsys):
    """Each held-out evaluation's share of answers cut at the length limit and the last drift probe's
    KL to the base at or before it (a probe after the evaluation is not its KL); step 0's cut share."""
    mod = _tool()
    mid = [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    run = tmp_path / "live" / "dense-s1"
    _write_run(run, [dict(_ev(0, _BEFORE), **{"val/holdout/response_length/clip_ratio": 0.3}),
                     _step(1, 0.1, 30, 70, 2000, 30.0, **{"probe/kl_to_base": 0.01}),
                     _step(2, 0.1, 30, 70, 2000, 30.0),
                     dict(_ev(2, mid), **{"val/holdout/response_length/clip_ratio": 0.1}),
                     _step(3, 0.1, 30, 70, 2000, 30.0, **{"probe/kl_to_base": 0.5})],
               arm={"arm": "dense", "seed": 1, "codec": "dense", "anchor": False}, done=False)
    p = mod.progress(str(run))
    (e,) = p["heldout"]
    assert p["truncated_before"] == 0.3
    assert (e["truncated"], e["kl_to_base"], e["kl_to_base_step"]) == (0.1, 0.01, 1)
    assert mod.main([str(tmp_path / "live"), "--progress"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dense s1: 3/? iterations (running), 1.5 min of training; held-out 0.200 at 0 (cut 0.30), "
        "0.500 at 2 (+0.300; cut 0.10; KL to base 0.01 at 1)"]


def test_progress_reports_a_bad_arm_on_its_own_line_and_goes_on(tmp_path, capsys):
    """An arm whose per-row file is not its own (its accuracy disagrees with metrics.jsonl) gets one
    error line naming the folder; the other arms still print; exit 2."""
    mod = _tool()
    root = tmp_path / "live"
    _paired_run(root, "dense", 1, [1] * 10)
    bad = _paired_run(root, "mask_anchor", 1, [1] * 10)
    _rows_file(bad, "holdout", 2, [0] * 10)  # overwrites: 0.0, where metrics.jsonl logs 1.0
    assert mod.main([str(root), "--progress"]) == 2
    cap = capsys.readouterr()
    assert cap.out.splitlines() == ["dense s1: 2/? iterations (finished), 0.3 min of training; held-out 0.200 at 0, "
                                    "1.000 at 2 (+0.800, paired SE 0.133, z +6.0: 8 fixed, 0 broken)"]
    (line,) = cap.err.splitlines()
    assert line.startswith("error: mask_anchor-s1: ") and "0.0000" in line and "1.0000" in line
