"""Automatic restart under torchrun's elastic agent, without processes (megatron_cegrpo/restart.py):
what a restarted worker loads, what the supervisor says, and how the iterations recomputed are
counted. The real restart is tests/e2e/test_elastic_restart.py."""

import json
import signal

from megatron_cegrpo import restart, supervisor
from megatron_cegrpo.metrics import logged_restarts, lost_iterations, truncate_metrics

FIRST = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "2"}
SECOND = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2"}
SPENT = {"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "2"}


def test_elastic_restarts_only_under_the_agent_with_restarts():
    assert restart.elastic_restarts({}) is None  # the DeepSpeed launcher, a plain process
    assert restart.elastic_restarts({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    r = restart.elastic_restarts(SECOND)
    assert (r.count, r.max, r.left, r.restarted) == (1, 2, 1, True)
    assert restart.restarts_left(SPENT) == 0 and restart.restarts_left(FIRST) == 2


def _checkpoint(save, it):
    d = save / f"iter_{it:07d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"iteration": it}))
    (save / "latest").write_text(d.name)


def test_a_restarted_worker_loads_the_newest_checkpoint_under_save(tmp_path):
    save, init = str(tmp_path / "ckpt"), str(tmp_path / "init")
    # a first start, or no restarts: --load as given
    assert restart.restart_load_dir(save, None, FIRST) is None
    assert restart.restart_load_dir(save, init, {}) == init
    # a restart before the first checkpoint: from where the run started (iteration 0, or --load)
    assert restart.restart_load_dir(save, None, SECOND) == save  # --save X --load X: fresh, log kept
    assert restart.restart_load_dir(save, init, SECOND) == init
    # once --save holds a checkpoint, the restart resumes from it
    _checkpoint(tmp_path / "ckpt", 2)
    assert restart.restart_load_dir(save, None, SECOND) == save
    assert restart.restart_load_dir(save, init, SECOND) == save
    # no --save: nothing to resume from
    assert restart.restart_load_dir(None, init, SECOND) == init


def test_the_supervisor_says_what_happens_next(tmp_path):
    save = tmp_path / "ckpt"
    argv = ["--model", "tiny-llama", "--save", str(save), "--save-interval", "2"]
    assert supervisor.restart_line(argv, {}) is None and supervisor.restart_line(argv, SPENT) is None
    assert supervisor.restart_line(argv, SECOND) == (
        "torchrun restarts every rank (restart 2 of 2) to start over from iteration 0 (no checkpoint written yet)")
    _checkpoint(save, 4)
    assert supervisor.restart_line(argv, FIRST) == (
        f"torchrun restarts every rank (restart 1 of 2) to resume from the newest complete checkpoint "
        f"{save / 'iter_0000004'}")
    # without restarts: one more line naming torchrun --max-restarts
    assert "torchrun --max-restarts N" in restart.how_to_restart({})
    assert restart.how_to_restart(SPENT).startswith("[cegrpo] the 2 restart(s) of torchrun --max-restarts are spent")


def _run_supervised(monkeypatch, tmp_path, rank, env, capsys):
    """supervise() of a child killed by SIGKILL; returns (status, printed)."""
    class Child:
        pid = 4242

        def wait(self):
            return -signal.SIGKILL

        def poll(self):
            return -signal.SIGKILL

    monkeypatch.setattr(supervisor.subprocess, "Popen", lambda *a, **k: Child())
    monkeypatch.setattr(supervisor.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    monkeypatch.setattr(supervisor.sys, "argv", ["train.py", "--anchor-ranks", "1", "--pipeline-model-parallel-size",
                                                 "2", "--save", str(tmp_path / "ckpt")])
    monkeypatch.setattr(supervisor.sys, "orig_argv", ["python", "train.py"], raising=False)
    rc = supervisor.supervise(dict(env, RANK=str(rank), WORLD_SIZE="3"))
    return rc, capsys.readouterr().out


def test_an_anchor_death_restarts_the_run_while_restarts_are_left(monkeypatch, tmp_path, capsys):
    rc, out = _run_supervised(monkeypatch, tmp_path, 2, FIRST, capsys)
    assert rc == 137 and "rank 2 (anchor, pid 4242) was killed by SIGKILL" in out
    assert "torchrun restarts every rank (restart 1 of 2)" in out
    rc, out = _run_supervised(monkeypatch, tmp_path, 2, SPENT, capsys)  # none left: survived as before
    assert rc == 0 and "the pipeline stages go on without the sign correction" in out
    rc, out = _run_supervised(monkeypatch, tmp_path, 1, {}, capsys)  # the DeepSpeed launcher: a stage ends the run
    assert rc == 137 and out.splitlines()[-1].startswith("[cegrpo] to restart every rank automatically")


def test_lost_iterations_counts_the_steps_after_the_checkpoint_over_every_restart(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert lost_iterations(str(path), 0) == 0
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "x"')
    assert lost_iterations(str(path), 2) == 1  # step 3 (the half-written 4 was never logged)
    truncate_metrics(str(path), 2)
    with open(path, "a") as f:  # the first restart logs 3..5, then dies again; resumes from 4
        f.writelines(json.dumps({"step": s, "recovery/lost_iterations": 1}) + "\n" for s in (3, 4, 5))
    assert lost_iterations(str(path), 4) == 2
    assert lost_iterations(str(path), 0) == 6  # a restart before any checkpoint: 1 earlier + 1..5


def test_a_restart_counts_one_more_than_the_start_that_logged_last(tmp_path):
    """On several hosts an agent whose workers were stopped for another host's failure keeps its
    count (pytorch/pytorch#108158); the driver counts from the log instead (``Driver.resume_log``)."""
    path = tmp_path / "metrics.jsonl"
    assert logged_restarts(str(path)) == 0
    path.write_text("".join(json.dumps({"step": s, "recovery/restarts": r}) + "\n"
                            for s, r in ((1, 0), (2, 0), (3, 1), (4, 1), (5, 2))) + '{"step": 6, "recovery/restarts"')
    assert logged_restarts(str(path)) == 2  # the half-written last line is not a record


def test_the_heartbeat_status_passes_the_supervisor_silently(monkeypatch, tmp_path, capsys):
    from megatron_cegrpo.heartbeat import EXIT_NO_HEARTBEAT

    class Child:
        pid = 4242

        def wait(self):
            return EXIT_NO_HEARTBEAT

    monkeypatch.setattr(supervisor.subprocess, "Popen", lambda *a, **k: Child())
    monkeypatch.setattr(supervisor.signal, "signal", lambda *a: None)
    monkeypatch.setattr(supervisor.sys, "argv", ["train.py", "--save", str(tmp_path / "ckpt")])
    monkeypatch.setattr(supervisor.sys, "orig_argv", ["python", "train.py"], raising=False)
    for env, rank in ((FIRST, 1), ({}, 1), (FIRST, 2), ({}, 0)):  # the watchdog printed the line already
        assert supervisor.supervise(dict(env, RANK=str(rank), WORLD_SIZE="3")) == EXIT_NO_HEARTBEAT
        assert capsys.readouterr().out == ""
