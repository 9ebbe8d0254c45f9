"""Thread counts follow the cores this process may run on (its affinity), not the host's count:
the trainer ranks' (``initialize.py`` through ``compat.placement.trainer_threads``) and the driver's
generation and evaluation threads (``training/driver.all_cores``)."""

import os

import pytest
import torch

from megatron_cegrpo.compat import placement
from megatron_cegrpo.training import driver


def test_all_cores_follows_the_affinity_and_restores_the_thread_count(monkeypatch):
    outer = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a big host ...
    # ... this process on three of its cores; the count before differs from both 3 and 64 (the suite
    # runs at one thread: with 1 before and a 1-core affinity, an all_cores that set nothing passed)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 9}, raising=False)
    assert placement.usable_cores() == 3
    torch.set_num_threads(2)
    try:
        with driver.all_cores():
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(outer)


def test_trainer_threads_share_the_affinity_between_the_host_ranks(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert [placement.trainer_threads(n) for n in (1, 2, 3, 4, 6, 8)] == [6, 3, 2, 1, 1, 1]
    assert placement.trainer_threads(0) == 6  # LOCAL_WORLD_SIZE unset or 0: one rank


@pytest.mark.parametrize("err", [AttributeError, OSError])
def test_without_an_affinity_call_the_host_count(monkeypatch, err):
    def raise_(pid):
        raise err("no affinity here")

    monkeypatch.setattr(os, "sched_getaffinity", raise_, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert placement.usable_cores() == 3
    assert placement.trainer_threads(2) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert placement.usable_cores() == 1
