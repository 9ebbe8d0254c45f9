"""One rank of ``test_tied_embedding_sync.py``: several GRPO runs in one process group.

``python tied_sync_worker.py OUT PP ANCHORS RESUME [extra flags]`` (RANK, WORLD_SIZE, MASTER_* set by
``distributed_util.run_ranks``). Runs, each from the same seeds:

- ``allreduce``: ``--tied-embedding-sync allreduce``, 3 iterations (saves at the last);
- ``sparse``: the same with ``--tied-embedding-sync sparse``;
- with RESUME=1, ``resumed``: sparse for 1 iteration (saves at the end), then a new trainer loads
  that checkpoint and trains iterations 2 and 3 (saving at 2 and 3, as ``sparse`` does). Why
  after 1: DeepSpeedCPUAdam's C++ side keeps beta^t as a running product and a fresh optimizer
  recomputed it with pow(beta, t); in fp32 0.999^3 differs in the last bit between the two
  (0.9970031 vs 0.997003), so a resume at step 3 of any run was off by an ulp, independently
  of the embedding exchange (now replayed on load: optim/factory.replay_cpu_adam_bias_correction).

Each trainer rank writes ``OUT/<run>/rank<r>.pt``: its stage's final parameters, the driver's
sampler weights (rank 0), and the bytes it really passed to ``torch.distributed.send`` on the
embedding group (a counting wrapper around the call the exchange makes).
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
OUT, PP, ANCHORS, RESUME = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
EXTRA = sys.argv[5:]
ARGS = tiny_args(
    pipeline_model_parallel_size=PP, micro_batch_size=2, max_new_tokens=8, lr="1e-3",
    deepspeed_config=os.path.join(OUT, "ds_wd.json"), anchor_ranks=ANCHORS, seed=SEED, boundary_codec="mask",
    custom_reward_function=os.path.join(OUT, "reward.py") + ":parity_reward",
) + EXTRA  # the caller's flags last, as they were
SENT = {"bytes": 0}


def _counting_send(real):
    def send(tensor, dst=None, group=None, tag=0, **kw):
        if group is not None and group is CTX.embd_group:
            SENT["bytes"] += tensor.numel() * tensor.element_size()
        return real(tensor, dst=dst, group=group, tag=tag, **kw)
    return send


def train(run: str, mode: str, iters: int, *extra: str) -> None:
    SENT["bytes"] = 0
    trainer = train_or_anchor(ARGS + ["--tied-embedding-sync", mode, "--train-iters", str(iters),
                                      "--log-dir", os.path.join(OUT, run), *extra], CTX, SEED)
    if trainer is None:
        return
    out = {"params": {n: p.detach().clone() for n, p in trainer.stage.model.named_parameters()},
           "sent": SENT["bytes"]}
    if trainer.driver is not None:
        out["sampler"] = {k: v.clone() for k, v in trainer.driver.rollout.model.state_dict().items()}
    torch.save(out, os.path.join(OUT, run, f"rank{CTX.rank}.pt"))
    dist.barrier()


CTX = initialize_distributed(PP, SEED, 1, anchor_ranks=ANCHORS)
dist.send = _counting_send(dist.send)
try:
    for mode in ("allreduce", "sparse"):
        train(mode, mode, 3, "--save", os.path.join(OUT, mode, "ckpt"), "--save-interval", "2")
    if RESUME:
        ckpt = os.path.join(OUT, "resumed", "ckpt")
        train("resumed", "sparse", 1, "--save", ckpt, "--save-interval", "2")
        train("resumed", "sparse", 3, "--save", ckpt, "--save-interval", "2", "--load", ckpt)
finally:
    shutdown_distributed()
