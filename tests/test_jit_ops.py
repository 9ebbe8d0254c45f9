"""A killed JIT build's lock on a DeepSpeed op stops start-up with one line, not a silent hang."""

import os
import subprocess
import threading
import time

import pytest

from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.optim.jit_ops import STALE_LOCK_S, build_lock_path, builders_in, check_build_locks


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return tmp_path / "ext"


def _lock(ext_dir, name, age_s, now):
    d = ext_dir / name
    d.mkdir(parents=True, exist_ok=True)
    lock = d / "lock"
    lock.write_text("")
    os.utime(lock, (now - age_s, now - age_s))
    return lock


def test_the_lock_is_in_the_extension_build_folder(ext_dir):
    assert build_lock_path("cpu_adam") == str(ext_dir / "cpu_adam" / "lock")


def test_a_stale_lock_names_itself_its_age_and_the_fix(ext_dir):
    now = time.time()
    lock = _lock(ext_dir, "cpu_adam", 7200, now)
    with pytest.raises(ConfigError, match=r"cpu_adam/lock is 120 min old") as e:
        check_build_locks(["cpu_adam", "deepspeed_shm_comm"], now=now)
    assert str(e.value) == (
        f"torch extension build lock {lock} is 120 min old: a build of DeepSpeed's cpu_adam op was killed "
        f"and every load of it would wait forever; fix: delete {lock.parent} (it is rebuilt on next use) "
        "or set TORCH_EXTENSIONS_DIR to another folder")


def test_a_build_in_progress_and_no_lock_pass(ext_dir):
    now = time.time()
    lock = _lock(ext_dir, "cpu_adam", STALE_LOCK_S - 60, now)  # another rank building right now:
    # ninja works in the build folder for a second, then torch releases the lock
    builder = subprocess.Popen(["sh", "-c", "sleep 1; rm lock"], cwd=lock.parent)
    try:
        time.sleep(0.2)
        assert builder.pid in builders_in(str(lock.parent))  # sh, and its sleep
        t0 = time.monotonic()
        check_build_locks(["cpu_adam", "deepspeed_shm_comm"], now=now, grace_s=0.5)
        assert time.monotonic() - t0 > 0.5  # it waited for the build, beyond one grace
    finally:
        builder.wait()
    _lock(ext_dir, "cpu_adam", STALE_LOCK_S + 60, now)
    with pytest.raises(ConfigError, match=r"cpu_adam/lock is \d+ min old"):
        check_build_locks(["cpu_adam"], now=now)
    check_build_locks(["deepspeed_shm_comm"], now=now)  # only the named ops are looked at


def test_a_lock_whose_compilers_outlive_the_killed_build_is_caught_when_they_end(ext_dir):
    """The build's Python parent killed, its compiler still running: the lock is never released.
    The check waits while the compiler works and then calls the lock orphaned."""
    now = time.time()
    lock = _lock(ext_dir, "cpu_adam", 30, now)
    compiler = subprocess.Popen(["sleep", "1"], cwd=lock.parent)
    try:
        with pytest.raises(ConfigError, match="is held by no running build"):
            check_build_locks(["cpu_adam"], now=now, grace_s=0.5)
    finally:
        compiler.wait()


def test_another_users_lock_is_left_to_the_age_rule(ext_dir):
    """Another user's build: their processes are not readable, so a young lock of theirs passes."""
    now = time.time()
    lock = _lock(ext_dir, "cpu_adam", 60, now)
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    os.chown(lock, 12345, 12345)
    check_build_locks(["cpu_adam"], now=now, grace_s=0.3)
    assert lock.exists()  # left to its owner


def test_a_young_lock_no_process_builds_under_is_a_killed_build(ext_dir):
    """A build killed a minute ago: its lock is young, but no ninja or compiler works in the folder
    (the hang of 2026-12-05: a test run killed mid-build, the next launch waited forever)."""
    now = time.time()
    lock = _lock(ext_dir, "cpu_adam", 60, now)
    assert builders_in(str(lock.parent)) == []
    with pytest.raises(ConfigError, match=r"cpu_adam/lock is held by no running build") as e:
        check_build_locks(["cpu_adam"], now=now, grace_s=0.3)
    assert str(e.value) == (
        f"torch extension build lock {lock} is held by no running build (no process in its folder for 0.3 s): "
        f"a build of DeepSpeed's cpu_adam op was killed and every load of it would wait forever; fix: delete "
        f"{lock.parent} (it is rebuilt on next use) or set TORCH_EXTENSIONS_DIR to another folder")


def test_a_lock_released_within_the_grace_passes(ext_dir):
    """torch holds the lock without a builder only while it writes build.ninja: a lock that goes
    within the grace was a live load's."""
    now = time.time()
    lock = _lock(ext_dir, "cpu_adam", 0, now)
    threading.Timer(0.3, lock.unlink).start()
    check_build_locks(["cpu_adam"], now=now, grace_s=3.0)
    assert not lock.exists()  # it returned once the lock went, not before
