"""One rank of ``test_tensor_parallel_train.py``: GRPO training at TP = T x PP = 2 (x DP) (no anchor).

``python tp_train_worker.py OUT TP [resume | dp DP | codecs SPEC,SPEC...]`` (RANK, WORLD_SIZE, MASTER_* set by
``distributed_util.run_ranks``; world = 2 x TP x DP, DP = 1 unless given). From the same seeds as
every other launch:

- ``mask``: ``--boundary-codec mask`` (keep 0.25), 2 iterations, KL to the reference, the drift probe
  and (at DP = 1) the gradient-fidelity probe at iteration 2, ``--tied-embedding-sync sparse``, a
  checkpoint at 2 (with ``resume``: at 1 and 2); the fidelity probe never changes the run
  (``training/fidelity.py``), so a DP > 1 run without it still trains like the DP = 1 record;
- with ``resume``, ``resumed``: a new trainer loads ``mask``'s checkpoint at 1 and trains iteration 2;
- with ``dp DP``, also ``dense``: the same as ``mask`` with ``--boundary-codec dense``, no checkpoint;
- with ``codecs SPECS`` (comma-separated), instead of ``mask``: one run per codec, named by its spec
  with ``:`` and ``/`` as ``_``, the same flags with ``--boundary-codec SPEC``, no checkpoint (the
  stateful codecs at TP > 1, ``test_tensor_parallel_train.py::test_tp2_stateful_codecs_train_like_tp1``).

Each trainer rank writes ``OUT/<run>/rank<r>.pt``: its place (pp_rank, tp_rank, dp_rank), its stage's
final parameters (its TP shards) and theta_0 (the reference it started from).
"""

import faulthandler
import os
import signal
import sys

import torch

from megatron_cegrpo.bootstrap import bootstrap

bootstrap(cpu_compat=True)

import torch.distributed as dist  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from megatron_cegrpo.arguments import build_config, parse_args  # noqa: E402
from megatron_cegrpo.initialize import initialize_distributed, set_seed, shutdown_distributed  # noqa: E402
from tests.distributed_util import tiny_args  # noqa: E402  (run_ranks puts the repository on PYTHONPATH)

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks: kill -USR1 <pid>
SEED = 1234
OUT, TP = sys.argv[1], int(sys.argv[2])
RESUME = len(sys.argv) > 3 and sys.argv[3] == "resume"
DP = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "dp" else None  # None: the mask run alone
CODECS = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[3] == "codecs" else None
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = tiny_args(
    micro_batch_size=2, max_new_tokens=8, lr="1e-3",
    deepspeed_config=os.path.join(REPO, "ds_configs", "cpu_adamw.json"),
    tensor_model_parallel_size=TP, anchor_ranks=0,
    # the fp32 sampler sync, as recorded: its bytes equal TP = 1's exactly, where the bf16 delta's
    # changed-entry count follows the weights' fp32 rounding, which the TP ranks' sums change
    rollout_dtype="fp32",
    boundary_codec="mask", boundary_keep_ratio=0.25, seed=SEED,
    drift_probe_interval=2, grad_fidelity_interval=None if (DP or 1) > 1 else 2,
    custom_reward_function=os.path.join(OUT, "reward.py") + ":parity_reward",
)


def train(run: str, iters: int, *extra: str) -> None:
    from megatron_cegrpo.training import GRPOTrainer

    cfg = build_config(parse_args(ARGS + ["--train-iters", str(iters), "--log-dir", os.path.join(OUT, run),
                                          *extra]))
    cfg.validate(world_size=dist.get_world_size())
    set_seed(SEED)  # as train.main: initialize_distributed seeded every RNG just before the trainer
    model_parallel_cuda_manual_seed(SEED)
    trainer = GRPOTrainer(cfg, CTX)
    trainer.train()
    st = trainer.stage
    out = {"pp_rank": CTX.pp_rank, "tp_rank": CTX.tp_rank, "dp_rank": CTX.dp_rank,
           "params": {n: p.detach().clone() for n, p in st.model.named_parameters()},
           "theta0": {n: p0.detach().clone() for (n, _), p0 in zip(st.model.named_parameters(), st.theta0)}}
    torch.save(out, os.path.join(OUT, run, f"rank{CTX.rank}.pt"))
    dist.barrier()


CTX = initialize_distributed(2, SEED, 1, anchor_ranks=0, tensor_model_parallel_size=TP)
try:
    if CODECS is not None:  # the stateful codecs, one run each
        for spec in CODECS:
            train(spec.replace(":", "_").replace("/", "_"), 2, "--boundary-codec", spec)
        sys.exit(0)
    ckpt = os.path.join(OUT, "mask", "ckpt")
    train("mask", 2, "--save", ckpt, *(["--save-interval", "1"] if RESUME else []))
    if RESUME:  # a new trainer from mask's checkpoint at 1 trains iteration 2 again
        train("resumed", 2, "--load", os.path.join(ckpt, "iter_0000001"),
              "--save", os.path.join(OUT, "resumed", "ckpt"), "--save-interval", "1")
    if DP is not None:  # the same run with the dense codec
        train("dense", 2, "--boundary-codec", "dense")
finally:
    shutdown_distributed()
