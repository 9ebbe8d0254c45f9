"""Distributed start-up: DeepSpeed's init, megatron-core's groups, seeds, threads.

Works under ``deepspeed --num_gpus N`` (which passes ``--local_rank`` and sets
RANK/WORLD_SIZE/MASTER_*), under ``torchrun`` (env only), and as a plain
single process (PP=1) where the env is filled in here. Groups are returned in
a :class:`DistContext` and passed down explicitly; library code never reads
megatron's globals.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_cegrpo.compat import apply_cpu_compat
from megatron_cegrpo.compat.placement import process_group_backend, trainer_threads
from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.layout import Layout

__all__ = ["DistContext", "initialize_distributed", "shutdown_distributed", "set_seed", "PEER_LIFETIME_TIMEOUT"]

#: Timeout of the groups whose waits last as long as the schedule makes them (DESIGN.md section 4):
#: the stages waiting while the driver generates or evaluates, the anchor waiting c iterations for
#: the next shipment, a stage waiting for the anchor's fire. These waits are bounded by the peer's
#: life, not by a timer: a peer that dies closes its connections and the wait fails at once (gloo
#: and NCCL report "connection closed"), so the timer only has to outlast any healthy wait.
#: (A gloo timeout is not retryable: it closes the pair, so it cannot serve as a poll either.)
PEER_LIFETIME_TIMEOUT = timedelta(days=30)


@dataclass
class DistContext:
    """This rank's place and groups. ``tp_rank``/``tp_size``/``tp_group``: its tensor-parallel
    group inside a stage (``--tensor-model-parallel-size``; Megatron's rank order, TP fastest, then
    DP, then PP: global rank = (pp_rank * dp_size + dp_rank) * tp_size + tp_rank for a trainer rank)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    pp_rank: int
    pp_size: int
    pp_group: Any
    embd_group: Any
    pg_collection: Any
    device: torch.device
    anchor_rank: Optional[int] = None  # global rank of the anchor (None: no anchor circuit)
    is_anchor: bool = False
    # the trainer ranks again, with PEER_LIFETIME_TIMEOUT: the rollout batch broadcast and the
    # barriers after driver-only phases (generation and evaluation take as long as they take)
    rollout_group: Any = None
    # every rank (stages + anchor), with PEER_LIFETIME_TIMEOUT: all anchor traffic (anchor/transport.py)
    anchor_group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    # --- data parallel (issue 14): this stage's replicas, megatron-core's dp group (None at DP = 1)
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    # global ranks of data-parallel replica 0's stages, stage order (the pipeline the driver, the
    # sampler sync, checkpoints and the anchor talk to)
    stage_ranks: Optional[list] = None
    layout: Optional[Layout] = None  # the launch's rank layout (layout.py)

    @property
    def is_driver(self) -> bool:
        """Rank 0: holds the sampler, the data and the log (DESIGN.md section 1)."""
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica of trainer rank ``rank`` (``Layout.replica_of``)."""
        return self.layout.replica_of(rank)

    @property
    def is_pipeline_leader(self) -> bool:
        """A rank of the driver's pipeline (data-parallel replica 0, TP rank 0): the ranks that
        send the sampler's weights and the stage metrics to the driver; the other TP ranks of a
        stage contribute through their TP group first."""
        return self.dp_rank == 0 and self.tp_rank == 0

    @property
    def is_replica_leader(self) -> bool:
        """Data-parallel rank 0 of its stage: the replica that syncs the sampler, writes
        checkpoints and talks to the anchor (the others receive what it receives)."""
        return self.dp_rank == 0

    @property
    def last_stage_rank(self) -> int:
        return dist.get_global_rank(self.pp_group, self.pp_size - 1)


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and, through megatron, the model-parallel RNG tracker)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def initialize_distributed(pipeline_model_parallel_size: int, seed: int,
                           num_threads: Optional[int] = None, anchor_ranks: int = 0,
                           timeout_minutes: float = 10.0, tensor_model_parallel_size: int = 1) -> DistContext:
    """Init torch.distributed through DeepSpeed, then megatron-core's model-parallel groups.

    Backend: gloo without CUDA (the compat layer is applied first), nccl with it.
    Without anchor ranks, megatron's ``parallel_state`` builds the groups over the world.
    With ``anchor_ranks`` extra ranks at the end of the world (DESIGN.md section 1), the
    trainer's groups come from megatron-core's ``HyperCommGrid`` over ranks
    ``0 .. P-1`` and the anchor gets a grid of its own (P stages + 1 anchor is not a
    shape ``parallel_state`` can express); the groups travel in the DistContext's
    ``pg_collection`` like in the plain case.

    ``tensor_model_parallel_size`` (``--tensor-model-parallel-size``, TP): megatron's TP groups
    (TP fastest); with an anchor rank the trainer grid holds them too (``_initialize_with_anchor``).
    Data parallel (issue 14): DP from the ``Layout`` (layout.py); its megatron group: ``DistContext.dp_group``.

    ``timeout_minutes`` (``--distributed-timeout-minutes``) bounds the trainer's collectives
    and pipeline transfers; the waits the schedule sizes (driver-only phases, the anchor
    link) use ``rollout_group`` / ``anchor_group`` with :data:`PEER_LIFETIME_TIMEOUT`.

    Raises:
        ConfigError: world size - anchor ranks not a multiple of TP x PP, or more than one anchor
            rank (``TrainConfig.validate(world_size)`` catches both earlier, with the launch fix).
    """
    cpu = apply_cpu_compat()
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        # gloo on CPU hosts; "cpu:gloo,cuda:nccl" on GPU hosts, so that each collective routes by its
        # tensors' device (the CPU control plane through gloo, CUDA activations through NCCL)
        _init_default_group(process_group_backend(), timedelta(minutes=timeout_minutes))
        if cpu:
            _unlink_deepspeed_shm_buffer()
    world = dist.get_world_size()
    tp, pp = int(tensor_model_parallel_size), pipeline_model_parallel_size
    layout = _check_layout(world, pp, tp, anchor_ranks)
    dp = layout.dp
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not cpu:
        torch.cuda.set_device(local_rank)
    torch.set_num_threads(num_threads or trainer_threads(local_world))

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    device = torch.device("cpu") if cpu else torch.device("cuda", local_rank)
    if anchor_ranks:
        return _initialize_with_anchor(layout, seed, local_rank, local_world, device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pipeline_model_parallel_size
        )
    rollout_group = _pipeline_groups_with_peer_lifetime_timeout(world, pipeline_model_parallel_size)
    if dp > 1 or tp > 1:  # every trainer rank (TP = DP = 1: the one pipeline group above, unchanged)
        rollout_group = dist.new_group(list(range(world)), timeout=PEER_LIFETIME_TIMEOUT)
    set_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    pg = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "pp", "cp", "embd", "pos_embd", "dp_cp", "dp", "mp", "tp_cp"]
    )
    return DistContext(
        rank=dist.get_rank(), world_size=world, local_rank=local_rank, local_world_size=local_world,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=pipeline_model_parallel_size,
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        embd_group=parallel_state.get_embedding_group(check_initialized=False),
        pg_collection=pg,
        device=device,
        rollout_group=rollout_group,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp_size=tp,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_rank=parallel_state.get_data_parallel_rank(), dp_size=dp,
        dp_group=parallel_state.get_data_parallel_group() if dp > 1 else None,
        stage_ranks=layout.stage_ranks, layout=layout,
    )


def _init_default_group(backend: str, timeout: timedelta) -> None:
    """``deepspeed.init_distributed`` (the default process group from the launcher's environment).

    On a restart by torchrun's elastic agent (``restart.py``) whose workers share the agent's
    store (``TORCHELASTIC_USE_AGENT_STORE=True``: the static rendezvous, and c10d's by default),
    the group is first started on that store under a prefix of this restart, as torch's elastic
    once did (``/worker/attempt_N``): the store outlives the dead start, whose process groups left
    their addresses under the same keys (a restarted rank connected to a dead peer's port:
    "Connection refused", pytorch/pytorch#135712); deepspeed then adopts that group. Then every
    rank takes the world's restart count (:func:`_agree_on_restart_count`)."""
    import deepspeed

    from megatron_cegrpo.restart import elastic_restarts

    r = elastic_restarts()
    if r is not None and r.restarted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        world = int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                              is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"cegrpo/restart_{r.count}/", store),
                                rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    _agree_on_restart_count()


def _agree_on_restart_count() -> None:
    """Under torchrun ``--max-restarts`` on several hosts, each host's agent counts only its own
    workers' failures (pytorch/pytorch#108158): a host whose workers were stopped because another
    host's failed restarts them with its count unchanged (0 on the first restart). Every rank takes
    the largest count of the world (one all-reduce on the default group) into
    ``TORCHELASTIC_RESTART_COUNT``, so that the driver's ``recovery/*`` metrics and the anchor
    client's restarts left agree on every host (``restart.py``). Still a lower bound of the restarts
    when hosts fail in turn, so the driver also counts from its log (``Driver.resume_log``)."""
    from megatron_cegrpo.restart import ENV_COUNT, elastic_restarts

    r = elastic_restarts()
    if r is None or dist.get_world_size() == 1:
        return
    count = torch.tensor([r.count], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    os.environ[ENV_COUNT] = str(int(count.item()))


def _check_layout(world: int, pp: int, tp: int, anchor_ranks: int) -> Layout:
    """The launch's :class:`Layout` once it fits TP x PP x DP + anchor ranks (``Layout.check``;
    ``TrainConfig.validate(world_size)`` catches a misfit earlier, with the same line). Raises
    ConfigError naming the flags."""
    if anchor_ranks not in (0, 1):
        raise ConfigError(f"--anchor-ranks must be 0 or 1 in this version, got {anchor_ranks}; fix: pass 0 or 1")
    layout = Layout(world, pp, tp, anchor_ranks)
    layout.check()
    return layout


def _pipeline_groups_with_peer_lifetime_timeout(world: int, pp: int) -> Any:
    """A copy of this rank's pipeline group with :data:`PEER_LIFETIME_TIMEOUT` (every rank creates
    every copy, in the same order, as ``new_group`` requires; PP is megatron's slowest dimension, so
    its pipeline groups are ``range(i, world, world // pp)`` for any TP x DP). At DP > 1 the rollout
    group is every trainer rank instead (``initialize_distributed``); these copies are still created,
    so that every launch creates the same groups in the same order."""
    from megatron.core import parallel_state

    mine = None
    n = world // pp
    for i in range(n):
        ranks = list(range(i, world, n))
        g = dist.new_group(ranks, timeout=PEER_LIFETIME_TIMEOUT)
        if dist.get_rank() in ranks:
            mine = g
            if ranks != dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()):
                raise RuntimeError(f"pipeline group {ranks} differs from megatron's; rank layout changed")
    return mine


def _unlink_deepspeed_shm_buffer() -> None:
    """DeepSpeed's CPU backend maps a 66 MB ``/dev/shm/deepspeed_allreduce_buffer_*`` per rank
    (for its shared-memory inference all-reduce, which this trainer never calls) and never
    removes the file, so every launch leaks tmpfs memory until the machine runs out. Once
    every rank has mapped its peers' buffers, unlink ours: the mapping lives until exit."""
    import glob

    dist.barrier()
    pattern = (f"/dev/shm/deepspeed_allreduce_buffer_*_{os.environ.get('MASTER_ADDR', '*')}_"
               f"{os.environ.get('MASTER_PORT', '*')}_{dist.get_rank()}")
    for path in glob.glob(pattern):
        try:
            os.unlink(path)
        except OSError:
            pass


def _grid_collection(grid) -> Any:
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    for name in ("tp", "cp", "pp", "dp"):
        setattr(pgc, name, grid.create_pg(name))
    pgc.dp_cp = grid.create_pg(["cp", "dp"])
    pgc.mp = grid.create_pg(["tp", "pp"])
    pgc.tp_cp = grid.create_pg(["tp", "cp"])
    pgc.pos_embd = None
    return pgc


def _initialize_with_anchor(layout: Layout, seed: int, local_rank: int, local_world: int,
                            device: torch.device) -> DistContext:
    """Trainer grid on ranks 0..tp*dp*pp-1 (megatron's order, TP fastest: ``Layout``), anchor grid
    on the last rank (every rank joins every new_group, in the same order). The embedding groups
    join the first and last stage of each (replica, TP rank), as ``parallel_state`` does; the RNG
    tracker is seeded with this rank's TP rank."""
    from megatron.core import parallel_state
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dims = ["tp", "cp", "dp", "pp"]
    tp, dp, pp, world = layout.tp, layout.dp, layout.pp, layout.world
    per_stage, trainers = layout.per_stage, layout.trainers
    trainer = _grid_collection(HyperCommGrid([tp, 1, dp, pp], dims, rank_offset=0))
    anchor = _grid_collection(HyperCommGrid([1, 1, 1, 1], dims, rank_offset=trainers))
    rank = dist.get_rank()
    embd = None
    for first in range(per_stage):  # one {first, last} embedding group per pipeline (replica, TP rank)
        g = dist.new_group([first, (pp - 1) * per_stage + first]) if pp > 1 else None
        if rank < trainers and rank % per_stage == first:
            embd = g
    rollout_group = dist.new_group(list(range(trainers)), timeout=PEER_LIFETIME_TIMEOUT)
    anchor_group = dist.new_group(list(range(world)), timeout=PEER_LIFETIME_TIMEOUT)
    is_anchor = layout.is_anchor(rank)
    pgc = anchor if is_anchor else trainer
    pgc.embd = None if is_anchor else embd
    tp_rank = 0 if is_anchor else layout.tp_rank(rank)
    # what megatron otherwise gets from parallel_state.initialize_model_parallel
    parallel_state._set_global_memory_buffer()
    set_seed(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
    return DistContext(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        pp_rank=0 if is_anchor else layout.pp_rank(rank), pp_size=1 if is_anchor else pp, pp_group=pgc.pp,
        embd_group=pgc.embd, pg_collection=pgc, device=device, anchor_rank=trainers, is_anchor=is_anchor,
        rollout_group=None if is_anchor else rollout_group, anchor_group=anchor_group,
        tp_rank=tp_rank, tp_size=1 if is_anchor else tp, tp_group=None if is_anchor or tp == 1 else pgc.tp,
        dp_rank=0 if is_anchor else layout.replica_of(rank), dp_size=1 if is_anchor else dp,
        dp_group=pgc.dp if dp > 1 and not is_anchor else None, stage_ranks=layout.stage_ranks, layout=layout,
    )


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state._GLOBAL_MEMORY_BUFFER = None
    if dist.is_initialized():
        dist.destroy_process_group()
