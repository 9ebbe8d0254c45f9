"""Shared pytest fixtures."""

import pytest


@pytest.fixture
def megatron_single_process(tmp_path):
    """One-process megatron: gloo world of 1 (FileStore in tmp_path), CPU compat layer,
    parallel_state with TP=PP=1 and model_parallel_cuda_manual_seed(1234).  Torn down after
    the test (destroy_model_parallel + destroy_process_group, if this fixture created it)."""
    import torch

    from megatron_cegrpo.models.builder import (
        destroy_single_process_megatron,
        init_single_process_megatron,
    )

    torch.set_num_threads(1)
    created = init_single_process_megatron(seed=1234, init_file=str(tmp_path / "pg_filestore"))
    try:
        yield
    finally:
        destroy_single_process_megatron(destroy_process_group=created)


def pytest_sessionstart(session):
    """Stop the whole run at once, with the one line and its fix, when a killed build left a
    lock on a DeepSpeed op (every training test would otherwise wait on it until its own
    timeout: CI of stop 22 spent 90 minutes that way)."""
    from megatron_cegrpo.errors import ConfigError
    from megatron_cegrpo.optim.jit_ops import check_build_locks

    try:
        check_build_locks()
    except ConfigError as e:
        pytest.exit(f"[cegrpo] error: {e}", returncode=3)
