"""Worker of test_shared_prefix_pp2.py (run as a subprocess, not collected by pytest).

    python shared_prefix_worker.py --out DIR   (RANK/WORLD_SIZE/MASTER_* in env, 2 ranks)

One rank of a real gloo pipeline (megatron-core 1F1B through CompressedP2PCommunicator, dense
codec). For G = 2 and 4 it runs the same batch unshared, then with ``shared_prefix_group=G``: a
forward-only pass (log-probs), then an update pass (GRPO loss with KL, backward), and saves the
log-probs, losses, every gradient (global layer names) and the byte meter of each. For G = 2 it
then runs the first stage's ``pcaq/prepass=1`` prepass in the shared layout (``PREPASS_SPEC``, a
forward-only pass after it) and saves what the codec observed and what the pass encoded.
"""

import argparse
import os
import sys
from functools import partial

import torch

from shared_prefix_cases import add_policies, logprob_fn, loss_fn, make_batch

SEED, STEP, MBS = 4321, 5, 4
GROUPS = {2: 6, 4: 3}  # G -> prompts (12 rows each)
PREPASS_SPEC = "pcaq/rank=16/prepass=1:lrq"


def run_prepass(runner, model, batch, comm, spec):
    """``PipelineRunner.boundary_prepass`` in the runner's layout, then one forward-only pass, with
    ``spec``'s codec: (micro-batches prepassed, the boundary states the codec observed, the ones
    the pass encoded for sending), the states on the first stage only (fp32 copies)."""
    from megatron_cegrpo.compression import ByteMeter, build_codec

    codec = build_codec(spec, 0.25)
    observed, sent = [], []
    observe, encode = codec.observe_prepass, codec.encode_forward
    codec.observe_prepass = lambda t, ctx: (observed.append(t.detach().float().clone()), observe(t, ctx))[1]
    codec.encode_forward = lambda t, ctx: (sent.append(t.detach().float().clone()), encode(t, ctx))[1]
    with comm.using(codec, ByteMeter()), torch.no_grad():
        prepassed = runner.boundary_prepass(model, batch, step=STEP)
        runner.run(model, batch, step=STEP, forward_only=True, loss_fn=logprob_fn)
    return prepassed, observed, sent


def run_one(runner, model, batch, meter, ctx, offset, seed):
    """One forward-only and one update pass; ``seed``: the first run (the unshared one) sets the
    batch's old / reference log-probs from its forward-only pass on the last stage (the loss runs there)."""
    from megatron_cegrpo.models import allreduce_tied_embedding_grads
    from pipeline_worker import global_name

    with torch.no_grad():
        fwd = runner.run(model, batch, step=STEP, forward_only=True, loss_fn=logprob_fn)
    if seed is not None and ctx.is_last_stage:
        add_policies(batch, torch.cat([o["logprobs"] for o in fwd]), seed=seed)
    model.zero_grad(set_to_none=True)
    upd = runner.run(model, batch, step=STEP, forward_only=False,
                     loss_fn=partial(loss_fn, float(batch["loss_mask"].sum()), float(batch["tokens"].shape[0])))
    allreduce_tied_embedding_grads(model, ctx.embd_group)
    return {"fwd_logprobs": [o["logprobs"] for o in fwd], "losses": [o["loss"] for o in upd],
            "logprobs": [o["logprobs"] for o in upd], "meter": meter.snapshot_and_reset(),
            "grads": {global_name(n, offset): p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None}}


def main(args):
    from megatron_cegrpo.compression import ByteMeter, build_codec
    from megatron_cegrpo.initialize import initialize_distributed
    from megatron_cegrpo.models import stage_layer_range
    from megatron_cegrpo.pipeline.communicator import CompressedP2PCommunicator
    from megatron_cegrpo.pipeline.schedule import PipelineRunner
    from pipeline_worker import build

    ctx = initialize_distributed(int(os.environ["WORLD_SIZE"]), SEED, num_threads=1)
    hf_config, tf, model = build(ctx.pp_rank, ctx.pp_size, {})
    meter = ByteMeter()
    comm = CompressedP2PCommunicator(ctx.pp_group, tf, build_codec("dense"), meter, seed=SEED)
    offset = stage_layer_range(tf, ctx.pp_rank, ctx.pp_size)[0]
    out = {"hidden": tf.hidden_size}
    for g, prompts in GROUPS.items():
        batch = make_batch(hf_config.vocab_size, g, prompts, seed=g, prompt_len=(12, 24), response_len=(1, 6))
        shared = PipelineRunner(comm, ctx.pg_collection, MBS, ctx.pp_size, shared_prefix_group=g)
        out[g] = {"plain": run_one(PipelineRunner(comm, ctx.pg_collection, MBS, ctx.pp_size), model, batch, meter,
                                   ctx, offset, seed=g),
                  "shared": run_one(shared, model, batch, meter, ctx, offset, seed=None),
                  "seq": int(batch["tokens"].shape[1]), "packed": shared.plan(batch)[1], "rows": int(batch["tokens"].shape[0]),
                  "batch": {k: batch[k] for k in ("prompt_lengths", "response_lengths", "loss_mask")}}
        if g == 2:
            out[g]["prepass"] = run_prepass(shared, model, batch, comm, PREPASS_SPEC)
    torch.save(out, os.path.join(args.out, f"rank{ctx.rank}.pt"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    main(ap.parse_args())
    sys.exit(0)
