"""The gradient-fidelity probe in real training launches (torchrun, PP=2, tiny model, mask codec).

A run with ``--grad-fidelity-interval 1`` equals the same run without it bit for bit — every
logged metric and the final weights — except for the added ``fidelity/*`` keys (and timings);
two optimizer steps per iteration (``--global-batch-size 4``) exercise the per-step mean.
``codec/error_persistence`` is logged from the second iteration on, in both runs alike.
"""

import json
import math
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from distributed_util import PARITY_REWARD, REPO, free_port, metric_diffs, tiny_args
from megatron_cegrpo.training.perf import without_wall_clock

ARGS = tiny_args(micro_batch_size=2, lr="1e-3", global_batch_size=4, train_iters=2, anchor_ranks=0,
                 boundary_codec="mask", boundary_keep_ratio=0.25, save_interval=2)


def _launch(tmp_path, name, *extra):
    run = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "megatron_cegrpo/train.py", *ARGS, "--log-dir", str(run), "--save", str(run / "ckpt"),
           "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p, run):
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-6000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    weights = [load_file(str(run / "ckpt" / "iter_0000002" / f"stage_{r:02d}" / "model.safetensors"))
               for r in range(2)]
    return metrics, weights


def test_probe_adds_fidelity_metrics_and_changes_nothing_else(tmp_path):
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    procs = [_launch(tmp_path, "plain"), _launch(tmp_path, "probed", "--grad-fidelity-interval", "1")]
    (plain, w_plain), (probed, w_probed) = [_finish(p, tmp_path / n) for p, n in zip(procs, ("plain", "probed"))]
    assert [m["step"] for m in probed] == [1, 2]
    for a, b in zip(plain, probed):
        added = {k for k in b if k not in a}
        assert added - {"timing_s/fidelity"} == {"fidelity/cos", "fidelity/cos/stage_0", "fidelity/cos/stage_1",
                                                 "fidelity/sign_agreement", "fidelity/norm_ratio"}
        strip = {k: v for k, v in without_wall_clock(b).items() if k in a}
        diffs = metric_diffs(strip, without_wall_clock(a))
        assert not diffs, diffs
        assert b["actor/num_optimizer_steps"] == 2
        for k in ("fidelity/cos", "fidelity/cos/stage_0", "fidelity/cos/stage_1"):
            assert -1.0 <= b[k] <= 1.0 and b[k] < 1.0 - 1e-6, (k, b[k])  # the mask changes the gradient
        assert 0.0 < b["fidelity/sign_agreement"] < 1.0 and b["fidelity/norm_ratio"] > 0.0
    for sa, sb in zip(w_plain, w_probed):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # boundary error persistence: defined from iteration 2, equal with and without the probe
    assert "codec/error_persistence" not in plain[0]
    c = plain[1]["codec/error_persistence"]
    assert math.isfinite(c) and -1.0 <= c <= 1.0 and c == plain[1]["codec/error_persistence/boundary_0"]
