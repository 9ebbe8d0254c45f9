"""Shared pytest fixtures, and the suite's tiers.

Every test carries one tier marker (``pytest.ini``), given here from what its module does unless
the test names one itself: ``e2e`` (it launches the trainer: ``train.py`` under deepspeed or
torchrun, or a module under ``tests/e2e``), ``integration`` (it starts processes: real gloo
ranks through ``distributed_util.run_ranks``, a subprocess, ``torch.multiprocessing``), ``unit``
(one process). ``make test-unit``, ``make test-integration`` and ``make test-e2e`` run one tier
of the default suite (``docs/testing.md``).
"""

import os

import pytest

#: the tiers, cheapest first
TIERS = ("unit", "integration", "e2e")
#: what a module that launches the trainer contains: the entry point, a launcher, or a helper that
#: launches (distributed_util.launch_train, the equivalence records' runner)
_E2E_SIGNS = ("megatron_cegrpo/train.py", 'launcher("deepspeed")', '_launcher("deepspeed")', "torchrun",
              "launch_train(", "equivalence_runs import")
_PROCESS_SIGNS = ("run_ranks(", "run_single(", "subprocess", "mp.spawn", "multiprocessing")
#: the e2e modules ``make test`` runs (marked ``smoke``): one launch of the main path through the
#: deepspeed launcher with the mask, the anchor, a save, a kill and a resume against its record
#: (equivalence), both launchers, the bad-input lines (each flag's and the launcher's), the entry
#: points, the heartbeat and restart policy, the example scripts' flags. The other e2e modules, the
#: long launches (resume at every path, faults, chaos, elastic, DP/TP, each feature's launch), run in
#: ``make test-launch``, which CI runs after ``make test`` (docs/testing.md)
SMOKE_E2E = ("equivalence/test_equivalence.py", "e2e/test_train_launch.py", "test_reliability.py",
             "test_bootstrap.py", "test_heartbeat.py", "test_restart_policy.py", "e2e/test_example_scripts.py",
             "benchmarks/test_bench_peer.py")
_HERE = os.path.dirname(os.path.abspath(__file__))


def module_tier(path: str) -> str:
    """The tier of the tests in the module at ``path`` (see the module docstring)."""
    with open(path, encoding="utf-8") as f:
        src = f.read()
    if f"{os.sep}e2e{os.sep}" in path or any(s in src for s in _E2E_SIGNS):
        return "e2e"
    if any(s in src for s in _PROCESS_SIGNS):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config, items):
    """Give each test its tier marker (one named on the test itself wins), and ``smoke`` to the tests
    of the :data:`SMOKE_E2E` modules."""
    tiers = {}
    smoke = {os.path.join(_HERE, p) for p in SMOKE_E2E}
    for item in items:
        path = str(item.fspath)
        if path in smoke:
            item.add_marker(pytest.mark.smoke)
        if any(item.get_closest_marker(t) for t in TIERS):
            continue
        if path not in tiers:
            tiers[path] = module_tier(path)
        item.add_marker(getattr(pytest.mark, tiers[path]))


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


def pytest_collection_finish(session):
    """No test module may install the CPU compatibility layer when it is imported (a worker's
    module-level ``bootstrap(cpu_compat=True)`` imported by a test did, and every test after it
    in the process ran with megatron's CUDA calls patched: the HF models of
    ``tests/checkpointing/test_ckpt_convert.py`` then gave other logits)."""
    from megatron_cegrpo.compat import cpu

    if cpu.is_active():
        pytest.exit("a test module installed the CPU compatibility layer at import (bootstrap(cpu_compat=True) "
                    "at module level, or an import of a *_worker.py script): move it into a fixture or main()",
                    returncode=3)
