"""truncate_metrics: a resumed run's metrics.jsonl keeps each step up to the checkpoint once,
and a partial last line (the run was killed mid-write) is dropped with a warning, not fatal."""

import json

from megatron_cegrpo.metrics import MetricsWriter, truncate_metrics


def _log(tmp_path, steps, tail=""):
    w = MetricsWriter(str(tmp_path))
    for s in steps:
        w.write({"step": s, "critic/score/mean": s / 10})
    if tail:
        with open(w.path, "a") as f:
            f.write(tail)
    return w.path


def _steps(path):
    return [json.loads(x)["step"] for x in open(path)]


def test_drops_steps_after_the_checkpoint(tmp_path):
    path = _log(tmp_path, [0, 1, 2, 3, 4, 5])
    assert truncate_metrics(path, 3) == []
    assert _steps(path) == [0, 1, 2, 3]


def test_a_partial_last_line_is_dropped_and_reported(tmp_path):
    path = _log(tmp_path, [1, 2, 3, 4], tail='{"step": 5, "critic/sco')
    warnings = truncate_metrics(path, 3)
    assert warnings == [f"{path}: dropped its last line, which is not a complete JSON record "
                        "('{\"step\": 5, \"critic/sco'; a write cut short by a kill)"]
    assert _steps(path) == [1, 2, 3]
    # the resumed run appends on a line of its own
    MetricsWriter(str(tmp_path), resume=True).write({"step": 4})
    assert _steps(path) == [1, 2, 3, 4]


def test_a_damaged_middle_line_is_reported_with_its_number(tmp_path):
    path = _log(tmp_path, [1])
    with open(path, "a") as f:
        f.write("[1, 2]\n")  # valid JSON, not a record
    MetricsWriter(str(tmp_path), resume=True).write({"step": 2})
    (w,) = truncate_metrics(path, 5)
    assert "dropped line 2 of 3" in w
    assert _steps(path) == [1, 2]


def test_a_missing_file_stays_missing(tmp_path):
    assert truncate_metrics(str(tmp_path / "metrics.jsonl"), 3) == []
    assert not (tmp_path / "metrics.jsonl").exists()
