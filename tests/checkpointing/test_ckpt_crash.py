"""A save killed with SIGKILL at any point leaves the previous checkpoint and ``latest`` valid."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_cegrpo import checkpointing as ck

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_crash_helper.py")
CFG = {"model_type": "llama", "vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 2}


def _save_prev(save_dir):
    tmp = ck.begin_save(save_dir, 1)
    for r in range(2):
        ck.write_stage_file(tmp, r, "model", {"w": torch.full((1000,), 1.0)})
    ck.write_stage_blob(tmp, 0, "trainer_state", {"iteration": 1, "consumed": 64})
    return ck.commit_save(save_dir, tmp, 1, ck.make_meta(hf_config=CFG, pp_size=2))


def _run_and_kill(save_dir, mode, wait_for, extra_delay=0.0):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.Popen([sys.executable, HELPER, save_dir, "2", mode], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    lines, deadline = [], time.time() + 90
    try:
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.strip() == wait_for:
                time.sleep(extra_delay)
                p.send_signal(signal.SIGKILL)
                break
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL, f"helper was not killed as planned: {lines}"
    tmp = next(l.split(" ", 1)[1] for l in lines if l.startswith("TMP "))
    return tmp, lines


@pytest.mark.parametrize("mode,wait_for,delay", [
    ("mid-write", "WRITING 2", 0.05),     # killed while the third 64 MiB file is being written
    ("before-commit", "READY", 0.0),      # all stage files written, commit never reached
    ("before-latest", "RENAMED", 0.0),    # renamed to iter_0000002, latest not yet rewritten
])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, mode, wait_for, delay):
    save = str(tmp_path / "run")
    prev = _save_prev(save)
    latest_before = open(os.path.join(save, "latest")).read()
    tmp, lines = _run_and_kill(save, mode, wait_for, delay)

    assert open(os.path.join(save, "latest")).read() == latest_before == "iter_0000001"
    assert ck.resolve_load_dir(save) == (prev, 1)
    ck.verify_checkpoint(prev)
    assert torch.equal(ck.read_stage_file(prev, 1)["w"], torch.full((1000,), 1.0))
    assert ck.read_stage_blob(prev, 0, "trainer_state") == {"iteration": 1, "consumed": 64}
    if mode == "before-latest":
        # the new checkpoint is complete (meta.json is written before the rename) but not current
        assert not os.path.exists(tmp)
        assert [it for it, _ in ck.list_checkpoints(save)] == [1, 2]
        ck.verify_checkpoint(os.path.join(save, "iter_0000002"))
    else:
        assert os.path.isdir(tmp) and os.listdir(os.path.join(tmp, "stage_00"))  # the debris is there
        assert [it for it, _ in ck.list_checkpoints(save)] == [1]
        assert not os.path.exists(os.path.join(tmp, "meta.json"))
    # the next successful save publishes normally and removes the debris
    nxt = ck.begin_save(save, 3)
    for r in range(2):
        ck.write_stage_file(nxt, r, "model", {"w": torch.full((10,), 3.0)})
    final = ck.commit_save(save, nxt, 3, ck.make_meta(hf_config=CFG, pp_size=2), keep_last=2)
    assert ck.resolve_load_dir(save) == (final, 3)
    assert not any(".tmp-" in e for e in os.listdir(save)), os.listdir(save)
