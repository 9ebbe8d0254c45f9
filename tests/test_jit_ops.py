"""A killed JIT build's lock on a DeepSpeed op stops start-up with one line, not a silent hang."""

import os
import time

import pytest

from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.optim.jit_ops import STALE_LOCK_S, build_lock_path, check_build_locks


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
    with pytest.raises(ConfigError) as e:
        check_build_locks(["cpu_adam", "deepspeed_shm_comm"], now=now)
    assert str(e.value) == (
        f"torch extension build lock {lock} is 120 min old: a build of DeepSpeed's cpu_adam op was killed "
        f"and every load of it would wait forever; fix: delete {lock.parent} (it is rebuilt on next use) "
        "or set TORCH_EXTENSIONS_DIR to another folder")


def test_a_build_in_progress_and_no_lock_pass(ext_dir):
    now = time.time()
    _lock(ext_dir, "cpu_adam", STALE_LOCK_S - 60, now)  # another rank building right now
    check_build_locks(["cpu_adam", "deepspeed_shm_comm"], now=now)
    _lock(ext_dir, "cpu_adam", STALE_LOCK_S + 60, now)
    with pytest.raises(ConfigError):
        check_build_locks(["cpu_adam"], now=now)
    check_build_locks(["deepspeed_shm_comm"], now=now)  # only the named ops are looked at
