"""``distributed_util.metric_diffs``, the run-vs-run comparison of the launch tests: every metric
exact, but the sampler/trainer mismatch within ``MISMATCH_ATOL`` (distributed_util.py says why)."""

from distributed_util import MISMATCH_ATOL, metric_diffs


def test_metric_diffs_is_exact_but_for_the_sampler_mismatch():
    base = {"step": 1, "actor/pg_loss": -0.0019134978453318279, "mismatch/abs_logprob_diff_mean": 0.14137451350688934,
            "mismatch/logprob_diff_mean": 0.0035337507724761963}
    assert metric_diffs(base, dict(base)) == {}
    # CI's fidelity-probe case: the sampler's last bits, same everything else
    ci = dict(base, **{"mismatch/abs_logprob_diff_mean": 0.14146815240383148,
                       "mismatch/logprob_diff_mean": 0.003520190715789795})
    assert metric_diffs(base, ci) == {}
    # a trainer metric one ulp off, a mismatch past the bound, a key only one side logs: all reported
    off = dict(base, **{"actor/pg_loss": -0.0019134978453318277,
                        "mismatch/logprob_diff_mean": base["mismatch/logprob_diff_mean"] + 1.01 * MISMATCH_ATOL})
    assert set(metric_diffs(base, off)) == {"actor/pg_loss", "mismatch/logprob_diff_mean"}
    assert metric_diffs(base, dict(base, extra=0.0)) == {"extra": (None, 0.0)}
    assert metric_diffs({k: v for k, v in base.items() if k != "mismatch/logprob_diff_mean"}, base) == \
        {"mismatch/logprob_diff_mean": (None, base["mismatch/logprob_diff_mean"])}
