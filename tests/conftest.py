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
