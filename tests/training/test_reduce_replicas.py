"""``StageMetricsReducer.merge_replicas`` (issue 14): one stage's data-parallel replicas merged by
each key's declared rule before the stages are reduced."""

import pytest

from megatron_cegrpo.training.reduce import StageMetricsReducer


def _reducer():
    return (StageMetricsReducer().declare("comm/", "sum").declare("anchor/alive", "min")
            .declare("anchor/fire", "first").declare("_weight/", "stages").declare("anchor/sign_dev", "max"))


def test_replicas_merge_by_the_declared_rule():
    r = _reducer()
    merged = r.merge_replicas([
        {"comm/fwd_bytes": 100, "anchor/alive": 1, "anchor/fire": 1, "_weight/diff_sq": 2.5, "anchor/sign_dev": 0.0},
        {"comm/fwd_bytes": 60, "anchor/alive": 0, "anchor/fire": 0, "_weight/diff_sq": 9.9, "anchor/sign_dev": 0.5},
    ])
    # bytes add up; alive only if every replica is; a shared value (the weights, the fire flag) is
    # replica 0's (the replicas are given different values so that "first" is told from min and max)
    assert merged == {"comm/fwd_bytes": 160, "anchor/alive": 0, "anchor/fire": 1, "_weight/diff_sq": 2.5,
                      "anchor/sign_dev": 0.5}
    # then the stages reduce as before: "stages" keeps one value per stage, "max" the largest
    out = r.derive(lambda m: {"n_stages": len(m["_weight/diff_sq"])}).reduce(
        [merged, {"comm/fwd_bytes": 40, "_weight/diff_sq": 1.0, "anchor/sign_dev": 0.0}])
    assert out == {"comm/fwd_bytes": 200, "anchor/alive": 0, "anchor/fire": 1, "anchor/sign_dev": 0.5,
                   "n_stages": 2}


def test_an_undeclared_key_is_refused():
    with pytest.raises(KeyError, match="stage metric 'actor/loss' has no declared reduction"):
        _reducer().merge_replicas([{"actor/loss": 1.0}])


def test_tp_ranks_merge_by_adding_their_shard_sums():
    """``merge_tp_ranks``: each TP rank reports what it sent and its shards' sums (the replicated
    parameters on TP rank 0 only), so ``sum`` and ``stages`` add (a per-step list elementwise)."""
    r = _reducer().declare("_fidelity/", "stages")
    merged = r.merge_tp_ranks([
        {"comm/fwd_bytes": 100, "anchor/alive": 1, "anchor/fire": 1, "_weight/diff_sq": 2.5,
         "_fidelity/dot": [1.0, 2.0], "anchor/sign_dev": 0.0},
        {"comm/fwd_bytes": 100, "anchor/alive": 0, "anchor/fire": 0, "_weight/diff_sq": 0.5,
         "_fidelity/dot": [0.25, 0.5], "anchor/sign_dev": 0.5},
    ])
    # min, first and max told apart: the ranks differ in alive, fire and sign_dev
    assert merged == {"comm/fwd_bytes": 200, "anchor/alive": 0, "anchor/fire": 1, "_weight/diff_sq": 3.0,
                      "_fidelity/dot": [1.25, 2.5], "anchor/sign_dev": 0.5}
    with pytest.raises(KeyError, match="stage metric 'actor/loss' has no declared reduction"):
        r.merge_tp_ranks([{"actor/loss": 1.0}])
