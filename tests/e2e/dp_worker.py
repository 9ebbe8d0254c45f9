"""One rank of ``test_data_parallel.py``: several GRPO runs in one process group.

``python dp_worker.py OUT PP DP`` (RANK, WORLD_SIZE, MASTER_* set by ``distributed_util.run_ranks``;
world = PP x DP + 1 anchor rank). Each run from the same seeds, the anchor at c = K = 2 (the fire
at 2 replays theta(0), the same weights in every run, and folds sign(M) into step 2):

- ``dense``: ``--boundary-codec dense``, 2 iterations;
- ``rpq``: ``--boundary-codec rpq/rank=8:lrq`` (per-micro-batch bases) with ``--grad-fidelity-interval 1``,
  2 iterations;
- ``mask``: ``--boundary-codec mask``, 2 iterations (at DP > 1 with checkpoints at 1 and 2);
- at DP > 1, ``resumed``: a new trainer loads ``mask``'s checkpoint at 1 and trains iteration 2,
  saving at 2 like ``mask`` (see ``tied_sync_worker.py`` on why a resume at 1).

Each trainer rank writes ``OUT/<run>/rank<r>.pt``: its stage's final parameters and the signs its
anchor correction holds.
"""

import faulthandler
import os
import signal
import sys

import torch

from megatron_cegrpo.bootstrap import bootstrap

bootstrap(cpu_compat=True)

import torch.distributed as dist  # noqa: E402

from megatron_cegrpo.initialize import initialize_distributed, shutdown_distributed  # noqa: E402
from tests.distributed_util import tiny_args  # noqa: E402  (run_ranks puts the repository on PYTHONPATH)
from worker_common import train_or_anchor  # noqa: E402

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks: kill -USR1 <pid>
SEED = 1234
RPQ = "rpq/rank=8:lrq"  # rank 8: the tiny model's micro-batches leave room for no more
OUT, PP, DP = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ARGS = tiny_args(
    pipeline_model_parallel_size=PP, micro_batch_size=2, max_new_tokens=8, lr="1e-3",
    deepspeed_config=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                  "ds_configs", "cpu_adamw.json"),
    anchor_ranks=1, anchor_interval=2, anchor_delay=2, seed=SEED,
    custom_reward_function=os.path.join(OUT, "reward.py") + ":parity_reward",
)


def train(run: str, codec: str, iters: int, *extra: str) -> None:
    trainer = train_or_anchor(ARGS + ["--boundary-codec", codec, "--train-iters", str(iters),
                                      "--log-dir", os.path.join(OUT, run), *extra], CTX, SEED)
    if trainer is None:
        return
    signs = trainer.circuits[0].correction.signs
    out = {"params": {n: p.detach().clone() for n, p in trainer.stage.model.named_parameters()},
           "signs": [s.clone() for s in signs] if signs is not None else None}
    torch.save(out, os.path.join(OUT, run, f"rank{CTX.rank}.pt"))
    dist.barrier()


CTX = initialize_distributed(PP, SEED, 1, anchor_ranks=1)
try:
    train("dense", "dense", 2)
    # a replica-invariant codec with per-micro-batch bases (rpq:lrq) and the gradient-fidelity probe
    train("rpq", RPQ, 2, "--grad-fidelity-interval", "1")
    if DP == 1:
        train("mask", "mask", 2)
    else:  # checkpoints at 1 and 2, and a resume from the one at 1
        train("mask", "mask", 2, "--save", os.path.join(OUT, "mask", "ckpt"), "--save-interval", "1")
        # a new trainer from mask's checkpoint at 1 trains iteration 2 again
        train("resumed", "mask", 2, "--load", os.path.join(OUT, "mask", "ckpt", "iter_0000001"),
              "--save", os.path.join(OUT, "resumed", "ckpt"), "--save-interval", "1")
finally:
    shutdown_distributed()
