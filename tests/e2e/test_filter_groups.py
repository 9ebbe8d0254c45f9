"""``--filter-groups`` end to end (tiny random model, 2 iterations): the
``batch/*`` metrics are logged, the bound is honoured and the batch's groups have mixed scores
(one rank, no pipeline split: the filter is the driver's alone, the batch keeps its B x G shape).

The reward (the parity reward of the other e2e tests) returns 0 for its first 16 calls: the 2
rounds of iteration 1 (2 prompts x 4 responses each) are all tied, the bound
(``--max-num-gen-batches 2``) is hit and tied groups fill the batch; from then on it scores
by parity, which gives mixed groups."""

import json
import os
import subprocess

from distributed_util import REPO, free_port, launcher, tiny_args

REWARD = '''
CALLS = [0]
def parity_reward(response, ground_truth):
    CALLS[0] += 1
    return 0.0 if CALLS[0] <= 16 else float(len(response) % 2 == 0)
'''
B, BOUND = 2, 2
ARGS = tiny_args(pipeline_model_parallel_size=1, rollout_batch_size=B, kl_coef=0, anchor_ranks=0, train_iters=2,
                 filter_groups=True, max_num_gen_batches=BOUND)
KEYS = ("batch/num_gen_batches", "batch/kept_groups", "batch/tied_groups_dropped", "batch/filled_with_tied",
        "batch/mixed_groups_unused")


def test_filter_groups_keeps_mixed_groups(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "run"
    cmd = [launcher("deepspeed"), "--num_gpus", "1", "--master_port", str(free_port()), "megatron_cegrpo/train.py",
           *ARGS, "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward", "--log-dir", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-6000:]
    recs = [json.loads(x) for x in open(out / "metrics.jsonl") if x.strip()]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert all(k in r for k in KEYS), sorted(r)
        # sampling stops when the batch holds B mixed groups or at the bound, never otherwise
        assert r["batch/kept_groups"] == B or r["batch/num_gen_batches"] == BOUND, r
        # the batch holds B groups; kept_groups is measured on the batch trained on
        assert r["batch/kept_groups"] + r["batch/filled_with_tied"] == B
        assert r["batch/num_gen_batches"] * B == sum(r[k] for k in KEYS[1:])
    first = recs[0]  # every group tied: the bound is hit, the last round fills the batch
    assert (first["batch/num_gen_batches"], first["batch/kept_groups"], first["batch/filled_with_tied"],
            first["batch/tied_groups_dropped"]) == (BOUND, 0, B, B)
    assert first["critic/score/max"] == 0.0 and first["actor/grad_norm"] == 0.0
    assert f"iteration 1: 0 groups of {B} with mixed scores after {BOUND} generation rounds" in p.stdout
    second = recs[1]  # parity: mixed groups drawn within the bound, so only mixed groups trained on
    assert second["batch/kept_groups"] == B and second["batch/filled_with_tied"] == 0, second
    assert second["critic/score/max"] > second["critic/score/min"] and second["actor/grad_norm"] > 0
