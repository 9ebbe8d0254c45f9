"""Worker for the tensor-parallel pipeline test (a subprocess, not collected by pytest).

    python tp_worker.py --tp 2 --out DIR        (RANK/WORLD_SIZE/MASTER_* in env; world = tp x 2)

One rank of a real gloo run: TP = ``--tp`` x PP = world / TP, megatron-core's parallel_state
groups (TP fastest), the stage built by ``models.stage.build_policy_stage`` (its TP shard of
the tiny model), megatron-core's 1F1B schedule through CompressedP2PCommunicator. For each
codec (dense, then mask at keep ratio 0.25) it runs the forward-only log-prob pass and the
forward+backward pass of ``pipeline_worker``'s batch, sums the tied-embedding gradients
over megatron's embedding group, and saves per codec: the last stage's losses and log-probs,
every gradient (this rank's TP shard, global layer names), the meter, the global gradient norm
(``optim.hooks.GradClipHook`` over megatron's model-parallel group); plus the stage's
parameters (its TP shard, stage-local names as in a checkpoint) and megatron's own
``partition_dim`` of each TP-split parameter, and the whole stage all-gathered from the TP
ranks (``tp_shard.gather_tp_stage_state_dict``).
"""

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipeline_worker import MBS, SEED, STEP, codec_for, global_name, loss_fn, make_batch  # noqa: E402


def _global_grad_norm(model, ctx) -> float:
    """GradClipHook's norm over the model-parallel group (TP x PP): TP-split gradients from every
    TP rank, replicated ones from TP rank 0 only (megatron's param_is_not_tensor_parallel_duplicate),
    the last stage's tied output copy left out (it duplicates the first stage's embedding)."""
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    from megatron_cegrpo.optim.hooks import GradClipHook

    params = list(model.parameters())
    dup = model.shared_embedding_or_output_weight() if ctx.pp_rank > 0 else None
    counted = [p for p in params if param_is_not_tensor_parallel_duplicate(p, ctx.tp_group) and p is not dup]
    hook = GradClipHook(params, counted, 0.0, group=ctx.pg_collection.mp)
    hook(None, (), {})
    return hook.last_grad_norm


def main(args):
    from megatron_cegrpo.bootstrap import bootstrap

    bootstrap(cpu_compat=True)
    from megatron_cegrpo.compression import ByteMeter
    from megatron_cegrpo.initialize import initialize_distributed
    from megatron_cegrpo.models import allreduce_tied_embedding_grads, stage_layer_range
    from megatron_cegrpo.models.stage import build_policy_stage
    from megatron_cegrpo.pipeline.communicator import CompressedP2PCommunicator
    from megatron_cegrpo.pipeline.schedule import PipelineRunner

    world = int(os.environ["WORLD_SIZE"])
    ctx = initialize_distributed(world // args.tp, SEED, num_threads=1, tensor_model_parallel_size=args.tp)
    policy = build_policy_stage(os.environ.get("CEGRPO_TEST_MODEL", "tiny-llama"), pp_rank=ctx.pp_rank,
                                pp_size=ctx.pp_size, pg_collection=ctx.pg_collection, tp_rank=ctx.tp_rank,
                                tp_size=ctx.tp_size)
    tf, model = policy.tf_config, policy.model
    comm = CompressedP2PCommunicator(ctx.pp_group, tf, codec_for("dense"), ByteMeter(), seed=SEED,
                                     tp_group=ctx.tp_group)
    runner = PipelineRunner(comm, ctx.pg_collection, MBS, ctx.pp_size)
    batch = make_batch(policy.hf_config.vocab_size)
    total = batch["loss_mask"].sum()
    offset = stage_layer_range(tf, ctx.pp_rank, ctx.pp_size)[0]
    out = {"tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank,
           "params": {n: p.detach().clone() for n, p in model.named_parameters()},
           "megatron_partition_dim": {n: int(p.partition_dim)
                                      for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}}
    for name in ("dense", "mask"):
        meter = ByteMeter()
        with comm.using(codec_for(name), meter):
            with torch.no_grad():
                fwd = runner.run(model, batch, step=STEP, forward_only=True, loss_fn=partial(loss_fn, total))
            model.zero_grad(set_to_none=True)
            upd = runner.run(model, batch, step=STEP, forward_only=False, loss_fn=partial(loss_fn, total))
        allreduce_tied_embedding_grads(model, ctx.embd_group)
        out[name + "_grad_norm"] = _global_grad_norm(model, ctx)
        out[name] = {"losses": [o["loss"] for o in upd], "logprobs": [o["logprobs"] for o in upd],
                     "fwd_logprobs": [o["logprobs"] for o in fwd], "meter": meter.snapshot_and_reset(),
                     "grads": {global_name(n, offset): p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}}
    comm.close()
    # the whole stage on every TP rank, for the driver's sampler / evaluation (after the updates' grads:
    # parameters are unchanged, so it must equal the TP = 1 stage)
    from megatron_cegrpo.models.tp_shard import gather_tp_stage_state_dict

    out["gathered"] = gather_tp_stage_state_dict({n: p.detach() for n, p in model.named_parameters()}, ctx.tp_group)
    torch.save(out, os.path.join(args.out, f"tp{args.tp}_rank{ctx.rank}.pt"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    main(ap.parse_args())
    sys.exit(0)
