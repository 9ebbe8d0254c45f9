"""The held-out learning curve (``--holdout-eval-interval``, issue 33 item 5: the long horizon's
evaluation every 40 steps) in real runs.

Tiny random model, PP=2 through the deepspeed launcher, 8 held-out rows, 2 iterations: with
``--holdout-eval-interval 1`` the held-out rows are scored before training, after iteration 1 and
after training (each with its per-row file, the paired statistics' input), and the training is
the run without the curve bit for bit (metrics and final weights): the greedy evaluation draws
nothing from the training's random streams.
"""

import json

import torch

from distributed_util import PARITY_REWARD, launch_train, metric_diffs, stage_weights, tiny_args
from megatron_cegrpo.training.perf import without_wall_clock

ARGS = tiny_args(anchor_ranks=0, train_iters=2, num_holdout=8, save_interval=2)


def _training(m):
    return without_wall_clock(m, ("perf/", "val/holdout/"))


def test_the_curve_scores_the_held_out_rows_between_iterations_and_changes_no_training(tmp_path):
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    runs = {}
    for name, extra in (("plain", []), ("curve", ["--holdout-eval-interval", "1"])):
        runs[name] = launch_train([*ARGS, "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward",
                                   "--save", str(tmp_path / name / "ckpt"), *extra], tmp_path / name)
    plain, curve = runs["plain"], runs["curve"]
    assert sorted(plain) == sorted(curve) == [0, 1, 2]
    assert "val/holdout/acc" not in plain[1]
    assert curve[1]["val/holdout/num_rows"] == 8 and 0.0 <= curve[1]["val/holdout/acc"] <= 1.0
    for t in (1, 2):
        assert not metric_diffs(_training(plain[t]), _training(curve[t])), t
    for t in (0, 2):  # before and after training: the same evaluation in both runs
        assert plain[t]["val/holdout/acc"] == curve[t]["val/holdout/acc"]
    rows = sorted(p.name for p in (tmp_path / "curve" / "eval_rows").iterdir())
    assert rows == ["holdout-step0.jsonl", "holdout-step1.jsonl", "holdout-step2.jsonl"]
    assert sorted(p.name for p in (tmp_path / "plain" / "eval_rows").iterdir()) == \
        ["holdout-step0.jsonl", "holdout-step2.jsonl"]
    header = json.loads((tmp_path / "curve" / "eval_rows" / "holdout-step1.jsonl").read_text().splitlines()[0])
    assert header["step"] == 1 and header["num_rows"] == 8 and header["acc"] == curve[1]["val/holdout/acc"]
    for a, b in zip(stage_weights(tmp_path / "plain" / "ckpt" / "iter_0000002"),
                    stage_weights(tmp_path / "curve" / "ckpt" / "iter_0000002")):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

