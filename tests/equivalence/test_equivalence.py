"""The tiny recorded run (tests/equivalence/equivalence_runs.py) gives the recorded metrics, bit for bit."""

import json

from equivalence_runs import differences, reference_path, run


def test_tiny_run_matches_the_recorded_metrics(tmp_path):
    with open(reference_path("tiny")) as f:
        expected = [json.loads(x) for x in f if x.strip()]
    got = run("tiny", str(tmp_path))
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert differences(expected, got) == []
