"""Resume through the deepspeed launcher (PP=2, tiny model) when something is off:

* a partial last line in metrics.jsonl (killed mid-write) is dropped with a warning and the
  run resumes, training past its old --train-iters (constant LR: allowed);
* a stage file corrupted in place (right size, wrong sha256) is found by stage 1 while
  loading: every stage stops there, rank 0 prints one line, exit status 2, no traceback;
* a changed --lr is refused at start-up, naming both values (the options were recorded by
  the trainer's own save).
"""

import json
import os
import subprocess

from distributed_util import PARITY_REWARD, REPO, free_port, launcher, tiny_args

ARGS = tiny_args(max_new_tokens=8, temperature=None, kl_coef=0, anchor_ranks=0)


def _run(tmp_path, *extra):
    ckpt = str(tmp_path / "ckpt")
    cmd = [launcher("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "megatron_cegrpo/train.py",
           *ARGS, "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward",
           "--save", ckpt, "--load", ckpt, "--log-dir", str(tmp_path / "run"), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_resume_past_a_partial_log_line_then_refuse_a_corrupt_file_and_a_changed_lr(tmp_path):
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    p = _run(tmp_path, "--train-iters", "1")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    log = tmp_path / "run" / "metrics.jsonl"
    with open(log, "a") as f:
        f.write('{"step": 2, "critic/sc')  # the run died while writing its next line

    p = _run(tmp_path, "--train-iters", "2")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "resuming from" in p.stdout
    assert f"[cegrpo] warning: {log}: dropped its last line, which is not a complete JSON record" in p.stdout
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2]
    meta = json.loads((tmp_path / "ckpt" / "iter_0000002" / "meta.json").read_text())
    assert meta["options"]["--lr"] == 1e-4 and meta["options"]["--seed"] == 1234
    assert "--train-iters" not in meta["options"]  # constant LR: it may grow

    stage1 = tmp_path / "ckpt" / "iter_0000002" / "stage_01" / "model.safetensors"
    data = bytearray(stage1.read_bytes())
    data[-1] ^= 0xFF
    stage1.write_bytes(bytes(data))
    p = _run(tmp_path, "--train-iters", "3")
    assert p.returncode == 2, p.stdout[-4000:] + p.stderr[-4000:]
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if "[cegrpo] error" in ln]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"[cegrpo] error: {stage1} is corrupt: sha256 ")
    assert "Traceback" not in p.stdout + p.stderr

    p = _run(tmp_path, "--train-iters", "3", "--lr", "2e-4")
    assert p.returncode == 2
    assert (f"[cegrpo] error: {tmp_path}/ckpt/iter_0000002/meta.json: this run changes options the checkpoint "
            "was trained with (checkpoint -> this run): --lr 0.0001 -> 0.0002; fix:") in p.stderr
    assert "Traceback" not in p.stdout + p.stderr
