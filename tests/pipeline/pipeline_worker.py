"""Worker for the multi-process pipeline tests (run as a subprocess, not collected by pytest).

    python pipeline_worker.py --mode pipeline --codec mask --out DIR   (RANK/WORLD_SIZE/MASTER_* in env)
    python pipeline_worker.py --mode reference --codec mask --pp 2 --out DIR

``pipeline``: one rank of a real gloo pipeline running megatron-core's 1F1B schedule
through CompressedP2PCommunicator, the codec's masks prefetched on a background thread. ``reference``: one process, the whole model (PP=1),
with ``codec.forward_map`` applied to the hidden states at each stage boundary with
the same (seed, boundary, step, sample ids). Both save the per-micro-batch losses,
log-probs and every parameter gradient under global layer names.
"""

import argparse
import os
import re
import sys

import torch

SEED = 4321
STEP = 7
N, S, MBS = 8, 16, 2


def make_batch(vocab: int, prompt_len: int = 0):
    """N random rows; with ``prompt_len`` the rows of each micro-batch share their first tokens
    (one prompt's responses, as in the trainer's batches)."""
    g = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, vocab, (N, S), generator=g)
    for i in range(N):
        tokens[i, :prompt_len] = tokens[i - i % MBS, :prompt_len]
    labels = torch.roll(tokens, -1, dims=1)
    mask = (torch.rand(N, S, generator=g) > 0.3).float()
    weights = torch.randn(N, S, generator=g)
    return {
        "tokens": tokens, "labels": labels, "loss_mask": mask, "weights": weights,
        "position_ids": torch.arange(S).unsqueeze(0).expand(N, S).contiguous(),
        "sample_ids": torch.arange(N) + 100,  # global ids need not start at 0
    }


def loss_fn(total_tokens, mb, logits):
    from megatron_cegrpo.grpo.core_algos import logprobs_from_logits

    lp = logprobs_from_logits(logits, mb["labels"])
    loss = -(lp * mb["weights"] * mb["loss_mask"]).sum() / total_tokens
    return loss, mb["loss_mask"].sum().int(), {"loss": loss.detach().clone(), "logprobs": lp.detach()}


def global_name(name: str, offset: int) -> str:
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def build(pp_rank, pp_size, tf_kwargs):
    from megatron_cegrpo.models import (build_stage, hf_to_megatron, load_hf_state_dict, load_stage_weights,
                                        resolve_model, transformer_config_from_hf)

    hf_config, hf_sd = load_hf_state_dict(resolve_model(os.environ.get("CEGRPO_TEST_MODEL", "tiny-llama")))
    tf = transformer_config_from_hf(hf_config, pipeline_model_parallel_size=pp_size,
                                    calculate_per_token_loss=True, **tf_kwargs)
    model = build_stage(hf_config, tf, pp_rank=pp_rank, pp_size=pp_size)
    load_stage_weights(model, hf_to_megatron(hf_sd, hf_config, tf, pp_rank, pp_size))
    return hf_config, tf, model


#: lowrank at d = 64: T = 8 sequences x 16 tokens x 3 crossings (forward-only, update forward and
#: backward) = 384, fast-owned basis (q = 1): r = floor(0.25 * 64 * 384 / (384 + 64)) = 13
LOWRANK = {"keep_ratio": 0.25, "q_owner": "fast", "tokens_per_iteration": N * S * 3}


def codec_for(name):
    from megatron_cegrpo.compression import build_codec

    if ":" in name:  # a FWD:BWD pair (compression/spec.py), sized for keep ratio 0.25
        return build_codec(name, 0.25)
    if name == "lowrank":
        return build_codec(name, **LOWRANK)
    return build_codec(name, 0.25 if name == "mask" else 0.05)


def run_pipeline(args):
    from functools import partial

    from megatron_cegrpo.compression import ByteMeter, MaskHalf
    from megatron_cegrpo.initialize import initialize_distributed
    from megatron_cegrpo.models import allreduce_tied_embedding_grads, stage_layer_range
    from megatron_cegrpo.pipeline.communicator import CompressedP2PCommunicator
    from megatron_cegrpo.pipeline.schedule import PipelineRunner

    ctx = initialize_distributed(int(os.environ["WORLD_SIZE"]), SEED, num_threads=1)
    tf_kwargs = {}
    if args.first_layers:
        tf_kwargs["num_layers_in_first_pipeline_stage"] = args.first_layers
    hf_config, tf, model = build(ctx.pp_rank, ctx.pp_size, tf_kwargs)
    meter = ByteMeter()
    comm = CompressedP2PCommunicator(ctx.pp_group, tf, codec_for(args.codec), meter, seed=SEED)
    runner = PipelineRunner(comm, ctx.pg_collection, MBS, ctx.pp_size)
    batch = make_batch(hf_config.vocab_size, args.prompt_len)
    total = batch["loss_mask"].sum()
    prefix_p = None
    if ctx.pp_rank == 0 and args.prompt_len:  # the common prefix of micro-batch 0's boundary state
        from megatron_cegrpo.compression.prefix import common_prefix
        with torch.no_grad():
            prefix_p = common_prefix(model(input_ids=batch["tokens"][:MBS], position_ids=batch["position_ids"][:MBS],
                                           attention_mask=None))
    queued = runner.prefetch(batch, step=STEP)  # as the trainer does once the batch is known
    prepassed = runner.boundary_prepass(model, batch, step=STEP)  # pcaq/prepass=1 only, as the trainer does
    with torch.no_grad():
        fwd = runner.run(model, batch, step=STEP, forward_only=True, loss_fn=partial(loss_fn, total))
    upd = runner.run(model, batch, step=STEP, forward_only=False, loss_fn=partial(loss_fn, total))
    allreduce_tied_embedding_grads(model, ctx.embd_group)
    offset = stage_layer_range(tf, ctx.pp_rank, ctx.pp_size)[0]
    grads = {global_name(n, offset): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"grads": grads, "meter": meter.snapshot_and_reset(), "codec_state": comm.codec.state_dict(),
                "losses": [o["loss"] for o in upd], "logprobs": [o["logprobs"] for o in upd],
                "fwd_logprobs": [o["logprobs"] for o in fwd], "prefetch_queued": queued, "prepassed": prepassed, "prefix_p": prefix_p,
                "derivations": comm.codec.derivations,
                "k_d": (comm.codec.fwd.k(tf.hidden_size) if isinstance(comm.codec.fwd, MaskHalf) else None,
                        tf.hidden_size)},
               os.path.join(args.out, f"rank{ctx.rank}.pt"))


def run_reference(args):
    from megatron_cegrpo.compression import BoundaryContext
    from megatron_cegrpo.models import init_single_process_megatron, stage_layer_range

    init_single_process_megatron(seed=SEED)
    torch.set_num_threads(1)
    tf_kwargs = {}
    if args.first_layers:
        tf_kwargs["num_layers_in_first_pipeline_stage"] = args.first_layers
    # boundary layers from the PP config, then the whole model at PP=1
    from megatron_cegrpo.models import load_hf_state_dict, resolve_model, transformer_config_from_hf

    hf_config, _ = load_hf_state_dict(resolve_model(os.environ.get("CEGRPO_TEST_MODEL", "tiny-llama")))
    tf_split = transformer_config_from_hf(hf_config, pipeline_model_parallel_size=args.pp, **tf_kwargs)
    ends = [stage_layer_range(tf_split, r, args.pp)[1] for r in range(args.pp - 1)]
    _, tf, model = build(0, 1, {})
    codec = codec_for(args.codec)
    state = {"ids": None, "prepass": False}

    def hook_for(boundary):
        def hook(module, inputs, output):
            h = output[0] if isinstance(output, tuple) else output
            ctx = BoundaryContext(seed=SEED, boundary=boundary, step=STEP, sample_ids=state["ids"])
            if state["prepass"]:  # the first stage's prepass: observe boundary 0's states, change nothing
                if boundary == 0:
                    codec.observe_prepass(h, ctx)
                return output
            h2 = codec.forward_map(h, ctx)
            return (h2,) + tuple(output[1:]) if isinstance(output, tuple) else h2
        return hook

    for b, end in enumerate(ends):
        model.decoder.layers[end - 1].register_forward_hook(hook_for(b))
    batch = make_batch(hf_config.vocab_size, args.prompt_len)
    total = batch["loss_mask"].sum()
    if codec.wants_prepass:  # pcaq/prepass=1: every micro-batch's boundary states first (no gradient)
        state["prepass"] = True
        with torch.no_grad():
            for i in range(0, N, MBS):
                state["ids"] = batch["sample_ids"][i:i + MBS]
                model(input_ids=batch["tokens"][i:i + MBS], position_ids=batch["position_ids"][i:i + MBS],
                      attention_mask=None)
        state["prepass"] = False
    losses, lps = [], []
    for i in range(0, N, MBS):
        mb = {k: v[i:i + MBS] for k, v in batch.items()}
        state["ids"] = mb["sample_ids"]
        logits = model(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None)
        loss, _, d = loss_fn(total, mb, logits)
        loss.backward()
        losses.append(d["loss"])
        lps.append(d["logprobs"])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"grads": grads, "losses": losses, "logprobs": lps}, os.path.join(args.out, "reference.pt"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["pipeline", "reference"], required=True)
    ap.add_argument("--codec", default="dense")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--first-layers", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    (run_pipeline if a.mode == "pipeline" else run_reference)(a)
    sys.exit(0)
