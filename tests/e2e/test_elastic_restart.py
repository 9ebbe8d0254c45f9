"""Automatic restart (issue 35, item 1): torchrun's elastic agent with ``--max-restarts 1``, PP=2,
tiny model, a checkpoint every 2 iterations, 6 iterations. A rank is SIGKILLed as soon as
iteration 3 is logged (after the checkpoint at 2, before the one at 4): the agent restarts every
rank, they resume from the checkpoint at 2 with nobody involved, and the run exits 0 with the
final weights bit-identical to a fault-free run of the same command and ``recovery/restarts`` 1,
``recovery/lost_iterations`` 1 (iteration 3, done twice).

- ``stage``: pipeline stage 1's supervised worker (no anchor, 2 ranks); every logged metric of
  the restarted run also equals the fault-free run's.
- ``anchor-process`` (slow: 3 ranks): the process torchrun launched for the anchor rank (its
  supervisor, as when the anchor's host dies), c = K = 2; this ended the whole run before.
- ``before-first-checkpoint`` (slow): stage 1 killed once iteration 1 is logged: the restart starts
  over from iteration 0 and recomputes iteration 1.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from distributed_util import PARITY_REWARD, REPO, RESUME_VOLATILE, complete_metrics, stage_weights
from distributed_util import supervised_worker, tiny_args
from megatron_cegrpo.training.perf import without_wall_clock

ARGS = tiny_args(temperature=None, anchor_ranks=0, train_iters=6, save_interval=2)
ANCHOR = ["--anchor-ranks", "1", "--anchor-interval", "2", "--anchor-delay", "2"]
#: victim -> (ranks, extra flags, rank killed, its supervised worker (else the launched process), the
#: iteration logged when it is killed (3: the newest checkpoint is iteration 2; 1: none is written yet))
FAULTS = {"stage": (2, [], 1, True, 3), "anchor-process": (3, ANCHOR, 2, False, 3),
          "before-first-checkpoint": (2, [], 1, True, 1)}


def _cmd(tmp_path, run, victim):
    ranks, extra, _, _, _ = FAULTS[victim]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts", "1",
            "--standalone", "megatron_cegrpo/train.py", *ARGS, *extra,
            "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward",
            "--save", str(tmp_path / run / "ckpt"), "--log-dir", str(tmp_path / run)]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _comparable(records):
    """{step: record} without what differs between like runs (wall clock, the restart's own keys
    and those a resume legitimately changes)."""
    drop = RESUME_VOLATILE + ("recovery/",)
    return {r["step"]: without_wall_clock(r, drop) for r in records}


def _killed_run(tmp_path, victim):
    """The faulty run: SIGKILL the victim once its iteration is logged. Returns the exit status, the
    output, and the seconds from the kill to that iteration logged again by the restarted run."""
    _, _, rank, supervised, kill_after = FAULTS[victim]
    metrics = tmp_path / "killed" / "metrics.jsonl"
    log = tmp_path / "killed.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(tmp_path, "killed", victim), cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while not any(r["step"] == kill_after for r in complete_metrics(metrics)):
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
                time.sleep(0.05)
            supervised_worker(proc.pid, rank, supervised).send_signal(signal.SIGKILL)
            t_kill = time.time()
            # the restarted run truncates the log to the checkpoint, then logs kill_after again
            while not any(r["step"] == kill_after and "recovery/restarts" in r and r["recovery/restarts"] == 1
                          for r in complete_metrics(metrics)):
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
                time.sleep(0.05)
            recovered = time.time() - t_kill
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, log.read_text(), recovered


@pytest.mark.parametrize("victim", ["stage", pytest.param("anchor-process", marks=pytest.mark.slow),
                                    pytest.param("before-first-checkpoint", marks=pytest.mark.slow)])
def test_killed_rank_restarts_and_resumes_bit_identical(tmp_path, victim):
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    p = subprocess.run(_cmd(tmp_path, "straight", victim), cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:]
    rc, text, recovered = _killed_run(tmp_path, victim)
    assert rc == 0, text[-6000:]
    kill_after = FAULTS[victim][4]
    resumed_at = kill_after - kill_after % 2 + 1  # after the newest checkpoint (every 2 iterations)
    print(f"{victim}: recovered in {recovered:.1f} s (kill -> resumed iteration {kill_after} logged)")
    if victim == "stage":  # (a killed supervisor says nothing; torchrun reports the exit -9)
        assert "rank 1 (pipeline stage 1" in text and "torchrun restarts every rank (restart 1 of 1)" in text, \
            text[-4000:]
    assert ("restart 1 of 1 (torchrun --max-restarts): " + ("resuming from the newest complete checkpoint"
            if resumed_at > 1 else "no checkpoint under --save")) in text, text[-4000:]
    assert f"restart 1: resuming at iteration {resumed_at}; iterations recomputed over the run: 1" in text, text[-4000:]

    a = complete_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = complete_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]  # each step once: the dead start's 3 was dropped
    assert [(r["recovery/restarts"], r["recovery/lost_iterations"]) for r in a] == [(0, 0)] * 6
    assert [(r["recovery/restarts"], r["recovery/lost_iterations"]) for r in b] == \
        [(0, 0)] * (resumed_at - 1) + [(1, 1)] * (7 - resumed_at)
    ca, cb = _comparable(a), _comparable(b)
    for step in range(1, 3 if victim == "anchor-process" else 7):  # the anchor's bytes differ after its restart
        #  (the stages' hello again, test_resume.py), the rest is the weights below
        assert ca[step] == cb[step], (step, {k: (v, cb[step].get(k)) for k, v in ca[step].items()
                                             if v != cb[step].get(k)})
    if victim == "anchor-process":  # the anchor came back: alive, firing and correcting as in the fault-free run
        for step in range(3, 7):
            assert [cb[step][k] for k in ("anchor/alive", "anchor/fire", "anchor/correction_applied")] == \
                [ca[step][k] for k in ("anchor/alive", "anchor/fire", "anchor/correction_applied")], step
        assert cb[4]["anchor/alive"] == cb[4]["anchor/correction_applied"] == 1
    wa = stage_weights(tmp_path / "straight" / "ckpt" / "iter_0000006")
    wb = stage_weights(tmp_path / "killed" / "ckpt" / "iter_0000006")
    for sa, sb in zip(wa, wb):
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])]
