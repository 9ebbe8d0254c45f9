"""``Driver.evaluate_on_cadence``: which evaluations run after an iteration, and their time."""

from types import SimpleNamespace

from megatron_cegrpo.training.driver import Driver


def _driver(eval_interval, holdout_eval_interval, train_iters=8):
    d = Driver.__new__(Driver)
    d.cfg = SimpleNamespace(data=SimpleNamespace(eval_interval=eval_interval,
                                                 holdout_eval_interval=holdout_eval_interval),
                            optim=SimpleNamespace(train_iters=train_iters))
    d.calls = []
    d.evaluate_suite = lambda t: d.calls.append(("suite", t)) or {"val/mawps/acc": 0.5, "timing_s/eval": 30.0}
    d.evaluate_holdout = lambda t: d.calls.append(("holdout", t)) or {
        "val/holdout/acc": 0.25, "val/holdout/acc_stderr": 0.02, "timing_s/eval/holdout": 12.0, "timing_s/eval": 12.0}
    return d


def test_the_cadences_and_the_time_of_both_evaluations():
    d = _driver(eval_interval=4, holdout_eval_interval=2)
    got = {t: d.evaluate_on_cadence(t) for t in range(1, 9)}
    # the held-out rows at 2, 4, 6 (not 8: the trainer scores them after training), the suite at 4, 8
    assert d.calls == [("holdout", 2), ("suite", 4), ("holdout", 4), ("holdout", 6), ("suite", 8)]
    assert got[1] == got[3] == {}
    assert got[2]["timing_s/eval"] == 12.0 and got[8] == {"val/mawps/acc": 0.5, "timing_s/eval": 30.0}
    assert got[4]["timing_s/eval"] == 42.0  # both evaluations' time, not the last one's
    assert got[4]["val/mawps/acc"] == 0.5 and got[4]["val/holdout/acc"] == 0.25


def test_no_cadence_no_evaluation():
    d = _driver(eval_interval=0, holdout_eval_interval=0)
    assert all(d.evaluate_on_cadence(t) == {} for t in range(1, 9)) and d.calls == []
