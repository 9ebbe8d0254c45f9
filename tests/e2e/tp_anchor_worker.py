"""One rank of ``test_tensor_parallel_anchor.py`` and ``test_tensor_data_parallel_anchor.py``: GRPO
training at TP = T x PP = 2 (x DP) + 1 anchor rank.

``python tp_anchor_worker.py OUT TP [FLAG ...]`` (extra flags appended; RANK, WORLD_SIZE, MASTER_* set
by ``distributed_util.run_ranks``; world = 2 x TP x DP + 1, DP inferred from the world size, the anchor
last; ``CEGRPO_TEST_RUN`` names the run's folder under OUT, default ``run``). From the same seeds at
every TP and DP size: tiny-llama, the mask codec at keep 0.25, KL to the reference, ``--tied-embedding-sync sparse``,
3 iterations of 8 sequences, the anchor firing every iteration (c = K = 1: fire 1 falls back to theta(0), fires 2 and 3
are secant forecasts), signs applied on the fire step, ``--anchor-debug-dir OUT/run/dump``.

Each trainer rank writes ``OUT/<run>/rank<r>.pt``: its place (pp_rank, tp_rank, dp_rank), its stage's final
parameters (its TP shards) and theta_0.
"""

import faulthandler
import os
import signal
import sys

import torch

from megatron_cegrpo.bootstrap import bootstrap

bootstrap(cpu_compat=True)

import torch.distributed as dist  # noqa: E402

from megatron_cegrpo.arguments import build_config, parse_args  # noqa: E402
from megatron_cegrpo.initialize import initialize_distributed, shutdown_distributed  # noqa: E402
from tests.distributed_util import tiny_args  # noqa: E402  (run_ranks puts the repository on PYTHONPATH)

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks: kill -USR1 <pid>
SEED = 1234
OUT, TP = sys.argv[1], int(sys.argv[2])
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(OUT, os.environ.get("CEGRPO_TEST_RUN", "run"))
ARGS = tiny_args(
    micro_batch_size=2, max_new_tokens=8, lr="1e-3",
    deepspeed_config=os.path.join(REPO, "ds_configs", "cpu_adamw.json"),
    tensor_model_parallel_size=TP, anchor_ranks=1, anchor_interval=1, anchor_delay=1,
    rollout_dtype="fp32", anchor_ship="bf16-delta",  # as recorded (test_tensor_parallel_train.py's reason)
    train_iters=3, boundary_codec="mask", boundary_keep_ratio=0.25, seed=SEED,
    custom_reward_function=os.path.join(OUT, "reward.py") + ":parity_reward",
    log_dir=RUN, anchor_debug_dir=os.path.join(RUN, "dump"),
)

CTX = initialize_distributed(2, SEED, 1, anchor_ranks=1, tensor_model_parallel_size=TP)
try:
    cfg = build_config(parse_args(ARGS + sys.argv[3:]))
    cfg.validate(world_size=dist.get_world_size())
    if CTX.is_anchor:  # as train.main: initialize_distributed seeded every RNG just before
        from megatron_cegrpo.anchor.runner import run_anchor

        run_anchor(cfg, CTX)
    else:
        from megatron_cegrpo.training import GRPOTrainer

        trainer = GRPOTrainer(cfg, CTX)
        trainer.train()
        st = trainer.stage
        out = {"pp_rank": CTX.pp_rank, "tp_rank": CTX.tp_rank, "dp_rank": CTX.dp_rank, "owned": [n for n, _ in st.named_owned],
               "params": {n: p.detach().clone() for n, p in st.model.named_parameters()},
               "theta0": {n: p0.detach().clone() for (n, _), p0 in zip(st.model.named_parameters(), st.theta0)}}
        torch.save(out, os.path.join(RUN, f"rank{CTX.rank}.pt"))
    dist.barrier()
finally:
    shutdown_distributed()
