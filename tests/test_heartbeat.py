"""The heartbeat watchdog (``megatron_cegrpo/heartbeat.py``, issue 35 item 3) across real processes:
three ranks (PP=2 + the anchor), each with its gloo default group and the watchdog on rank 0's store,
timeout 2 s (beats every 0.33 s).

- a rank stopped with SIGSTOP (alive, no progress): the other two end with ``EXIT_NO_HEARTBEAT``
  within the bound; the lowest live rank prints the one line naming it, its role, its last mark and
  pid; the other ends quietly;
- the store's host (rank 0) stopped: the two others lose the store and end the same way, naming the
  lost link;
- a rank that finishes early (``done``) is never named: the other two work 3 bounds longer and exit 0.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from distributed_util import REPO, free_port
from megatron_cegrpo.heartbeat import EXIT_NO_HEARTBEAT

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heartbeat_worker.py")
TIMEOUT_S = 2.0
INTERVAL_S = TIMEOUT_S / 6  # Heartbeat's default beat and watch period at this bound


def _start(seconds: float, done_rank: int = -1):
    port = free_port()
    procs = []
    for r in range(3):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, WORKER, str(TIMEOUT_S), str(seconds), str(done_rank)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:  # every rank's watchdog started
        assert p.stdout.readline().strip() == "ready" or p.poll() is not None, p.stdout.read()
    return procs


def _finish(procs, timeout=60):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.parametrize("stopped", [1, 0], ids=["stage-1-stopped", "store-host-stopped"])
def test_a_stopped_rank_ends_its_peers_and_is_named(stopped):
    procs = _start(seconds=60)
    time.sleep(1.0)  # a few beats: the mark (iteration 7) is posted
    os.kill(procs[stopped].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    others = [r for r in range(3) if r != stopped]
    took = None
    try:
        for r in others:
            procs[r].wait(timeout=30)
        took = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        pass
    finally:
        procs[stopped].kill()
    outs = _finish(procs, timeout=30)  # a killed worker under load can take seconds to close its pipe
    assert [procs[r].returncode for r in others] == [EXIT_NO_HEARTBEAT] * 2, outs
    # the peers saw the stopped rank's last beat at most one period before SIGSTOP, so they fire after
    # the bound less one period at the earliest; at the latest after the bound, one watch period, the
    # quiet rank's wait for the reporter (2 periods + 1 s) and 3 s to exit a loaded machine's process
    assert took is not None and TIMEOUT_S - INTERVAL_S < took < TIMEOUT_S + 3 * INTERVAL_S + 1 + 3, took
    lines = [line for out in outs for line in out.splitlines() if "heartbeat" in line]
    assert len(lines) == 1, outs
    if stopped == 1:
        assert lines[0].startswith(f"[cegrpo] rank 1 (pipeline stage 1) sent no heartbeat for 2 s, last at iteration 7 "
                                   f"(iteration), pid {procs[1].pid}: hung, or its host or the link to it is down "
                                   "(--heartbeat-timeout-minutes 0.0333333); rank 0 stops; the run stops"), lines
        assert "[cegrpo] to restart every rank automatically from the newest checkpoint, launch with torchrun " \
               "--max-restarts N" in outs[0]
    else:  # rank 1 (the lowest of the two, local rank 0 here) says it lost the store
        assert lines[0].startswith("[cegrpo] rank 1 (pipeline stage 1) reached no peer's heartbeat for 2 s "
                                   "(--heartbeat-timeout-minutes 0.0333333): its link to the run's store "
                                   "(MASTER_ADDR) or that host is down; it stops; the run stops"), lines


def test_a_finished_rank_is_not_named():
    procs = _start(seconds=3 * TIMEOUT_S, done_rank=2)
    outs = _finish(procs)
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert not any("[cegrpo]" in out for out in outs), outs


def test_the_bound_is_on_by_default_only_under_torchrun_restarts():
    from megatron_cegrpo.heartbeat import DEFAULT_TIMEOUT_MINUTES, heartbeat_timeout_s

    elastic = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert heartbeat_timeout_s(None, elastic) == DEFAULT_TIMEOUT_MINUTES * 60 == 60.0
    assert heartbeat_timeout_s(None, {}) is None  # the DeepSpeed launcher: today's behaviour
    assert heartbeat_timeout_s(None, dict(elastic, TORCHELASTIC_MAX_RESTARTS="0")) is None
    assert heartbeat_timeout_s(0.25, {}) == 15.0 and heartbeat_timeout_s(0, elastic) is None
