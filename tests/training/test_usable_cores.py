"""``training/driver.py``'s thread count for generation and evaluation: the cores this process may
run on (its affinity), not the host's count."""

import os

import pytest
import torch

from megatron_cegrpo.training import driver


def test_all_cores_follows_the_affinity_and_restores_the_thread_count(monkeypatch):
    prev = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a big host ...
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # ... this process on one core
    assert driver.usable_cores() == 1
    with driver.all_cores():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == prev


@pytest.mark.parametrize("err", [AttributeError, OSError])
def test_without_an_affinity_call_the_host_count(monkeypatch, err):
    def raise_(pid):
        raise err("no affinity here")

    monkeypatch.setattr(os, "sched_getaffinity", raise_, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert driver.usable_cores() == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert driver.usable_cores() == 1
