"""Faults injected into real launches (deepspeed launcher, PP=2 + 1 anchor rank, tiny model).

- Waits sized to the schedule: one iteration made slower than --distributed-timeout-minutes
  (a reward function that sleeps, as a slow verifier would) must not kill the anchor, which
  waits c iterations for its next shipment, nor the stage that waits for the driver's batch.
- SIGKILL of the anchor rank mid-run: the stages go on without the correction, log
  anchor/alive 0, finish every iteration and write their checkpoint; the launcher exits 0.
- SIGKILL of a stage rank: the launcher exits non-zero within a bounded time, with a line
  naming the rank and the newest checkpoint, which verifies and resumes to the end.
"""

import json
import os
import signal
import subprocess
import time

import psutil

from distributed_util import REPO, free_port, tiny_args
from distributed_util import launcher as _launcher

from megatron_cegrpo import checkpointing as ck

# iteration 3 of a run scores its first response 8 s late (calls 17..24 are iteration 3's batch)
SLOW_REWARD = '''
import time
CALLS = [0]
def slow_parity(response, ground_truth):
    CALLS[0] += 1
    if CALLS[0] == 17:
        time.sleep(8.0)
    return float(len(response) % 2 == 0)
'''

TIMEOUT_MIN = 0.1  # 6 s: shorter than iteration 3 alone, and than the anchor's wait for shipment 3


def _cmd(tmp_path, *extra):
    return [_launcher("deepspeed"), "--num_gpus", "3", "--master_port", str(free_port()),
            "megatron_cegrpo/train.py",
            *tiny_args(temperature=None, anchor_ranks=1, anchor_interval=2, anchor_delay=2),
            "--custom-reward-function", f"{tmp_path / 'reward.py'}:slow_parity", "--log-dir", str(tmp_path / "run"),
            *extra]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _metrics(path):
    """The complete records of a metrics.jsonl the trainer may be writing right now: a last line
    without its newline is a record half written (read mid-write, it failed json.loads once)."""
    if not os.path.exists(path):
        return []
    lines = open(path).read().split("\n")[:-1]  # the piece after the last newline is incomplete
    return [json.loads(x) for x in lines if x.strip()]


def _worker_of_rank(launcher_pid: int, rank: int) -> psutil.Process:
    """The supervised worker process of ``rank`` among the launcher's descendants."""
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("RANK") == str(rank) and env.get("CEGRPO_SUPERVISED") == "1":
            return p
    raise AssertionError(f"no supervised worker of rank {rank} under pid {launcher_pid}")


def _wait_for(cond, proc, what, limit=600):
    deadline = time.time() + limit
    while not cond():
        assert proc.poll() is None, f"training exited before {what}"
        assert time.time() < deadline, f"no {what} within {limit} s"
        time.sleep(0.05)


def test_slow_iteration_then_anchor_killed(tmp_path):
    (tmp_path / "reward.py").write_text(SLOW_REWARD)
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(tmp_path, "--train-iters", "6", "--distributed-timeout-minutes", str(TIMEOUT_MIN),
                                     "--save", str(tmp_path / "ckpt")),
                                cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            metrics = tmp_path / "run" / "metrics.jsonl"
            _wait_for(lambda: len(_metrics(metrics)) >= 4, proc, "iteration 4")
            anchor = _worker_of_rank(proc.pid, 2)
            anchor.send_signal(signal.SIGKILL)
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    m = {x["step"]: x for x in _metrics(tmp_path / "run" / "metrics.jsonl")}
    assert sorted(m) == [1, 2, 3, 4, 5, 6]
    # iteration 3 took longer than the timeout; the anchor and the waiting stage survived it
    assert m[3]["timing_s/step"] > 60 * TIMEOUT_MIN
    assert [m[t]["anchor/fire"] for t in (2, 4)] == [1, 1]
    assert [m[t]["anchor/alive"] for t in (1, 2, 3, 4)] == [1, 1, 1, 1]
    assert m[4]["anchor/branch"] == "forecast" and m[4]["anchor/correction_applied"] == 1
    # killed after iteration 4: noticed at the next exchange (ship at 5, fire at 6) at the latest
    assert m[6]["anchor/alive"] == 0 and m[6]["anchor/fire"] == 0
    assert m[6]["anchor/correction_applied"] == 0
    assert m[6]["actor/grad_norm"] > 0
    assert "rank 2 (anchor" in text and "was killed by SIGKILL" in text, text[-4000:]
    assert "lost the anchor rank 2" in text
    # the final checkpoint is complete, without anchor state
    ckpt, it = ck.resolve_load_dir(str(tmp_path / "ckpt"))
    assert it == 6
    meta = ck.verify_checkpoint(ckpt)
    assert ck.stage_file_names(meta, ck.ANCHOR) == []


def test_stage_killed_exits_with_its_rank_and_a_resumable_checkpoint(tmp_path):
    (tmp_path / "reward.py").write_text(SLOW_REWARD.replace("== 17", "== -1"))
    save = tmp_path / "ckpt"
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(tmp_path, "--train-iters", "6", "--save", str(save), "--save-interval", "2"),
                                cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            latest = save / "latest"
            _wait_for(lambda: latest.exists() and latest.read_text().strip() == "iter_0000002", proc,
                      "the iteration-2 checkpoint")
            _worker_of_rank(proc.pid, 1).send_signal(signal.SIGKILL)
            t0 = time.time()
            proc.wait(timeout=120)
            took = time.time() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert proc.returncode != 0
    assert took < 60, took
    assert "rank 1 (pipeline stage 1" in text and "was killed by SIGKILL" in text, text[-4000:]
    ckpt, it = ck.resolve_load_dir(str(save))
    assert it in (2, 4) and f"the newest complete checkpoint is {save / ck.iter_dir_name(it)}" in text
    ck.verify_checkpoint(ckpt)  # every file's sha256 matches
    p = subprocess.run(_cmd(tmp_path, "--train-iters", "6", "--save", str(save), "--save-interval", "2",
                            "--load", str(save)),
                       cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:]
    assert f"resuming from {ckpt}" in p.stdout
    assert sorted(x["step"] for x in _metrics(tmp_path / "run" / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
