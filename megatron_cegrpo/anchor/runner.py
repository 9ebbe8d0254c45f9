"""Entry of the anchor rank: build the dense model and reference, then follow the trainer."""

from __future__ import annotations

import time

import torch

from megatron_cegrpo.anchor.worker import AnchorWorker

__all__ = ["run_anchor"]

ANCHOR_BLOB = "anchor_state"


def run_anchor(cfg, ctx) -> None:
    """Run the anchor circuit on this rank until the trainer's last iteration.

    Joins the trainer's checkpoint collectives at the same iterations (its state, M, the
    ring and the pending batches, goes to ``stage_<P>/anchor_state.pt``), and on ``--load``
    restores that state.
    """
    from megatron_cegrpo import checkpointing as ck
    from megatron_cegrpo.models import (build_stage, hf_to_megatron, load_hf_state_dict, load_stage_weights,
                                        resolve_model, transformer_config_from_hf)

    t0 = time.perf_counter()
    hf_config, hf_sd = load_hf_state_dict(resolve_model(cfg.model.model))
    dtype = torch.bfloat16 if cfg.model.params_dtype == "bf16" else torch.float32
    tf = transformer_config_from_hf(hf_config, pipeline_model_parallel_size=1, params_dtype=dtype)
    sd = hf_to_megatron(hf_sd, hf_config, tf, 0, 1)
    del hf_sd
    model = build_stage(hf_config, tf, pp_rank=0, pp_size=1, pg_collection=ctx.pg_collection)
    ref = build_stage(hf_config, tf, pp_rank=0, pp_size=1, pg_collection=ctx.pg_collection)
    load_stage_weights(model, sd)
    load_stage_weights(ref, sd)
    ref.requires_grad_(False)
    model.eval()
    ref.eval()
    pp = cfg.parallel.pipeline_model_parallel_size
    start, state = 0, None
    if cfg.checkpoint.load and ck.has_checkpoint(cfg.checkpoint.load):
        ckpt_dir, it = ck.resolve_load_dir(cfg.checkpoint.load)
        meta = ck.read_meta(ckpt_dir)
        if f"{ANCHOR_BLOB}.pt" in ck.stage_file_names(meta, ck.ANCHOR):
            state = ck.read_stage_blob(ckpt_dir, ck.ANCHOR, ANCHOR_BLOB, meta=meta)
            start = it
        elif "trainer_state.pt" in ck.stage_file_names(meta, 0):
            start = it  # saved without an anchor: the anchor starts empty at the trainer's iteration
            print(f"[cegrpo anchor] {ckpt_dir} has no anchor state; M and the ring start empty", flush=True)
    worker = AnchorWorker(cfg, model, ref, stage_ranks=list(range(pp)), start_iteration=start)
    if state is not None:
        worker.load_state_dict(state)

    def on_iteration_end(t: int) -> None:
        c = cfg.checkpoint
        if c.save and ((c.save_interval and t % c.save_interval == 0) or t == cfg.optim.train_iters):
            worker.wait_sends()
            tmp = ck.begin_save(c.save, t)
            ck.write_stage_blob(tmp, ck.ANCHOR, ANCHOR_BLOB, worker.state_dict())
            # rank 0 (a trainer rank) writes meta.json and publishes; every rank joins the collective
            ck.commit_save(c.save, tmp, t, {}, c.keep_last)

    print(f"[cegrpo anchor] rank {ctx.rank}: dense replica ready in {time.perf_counter() - t0:.1f} s, "
          f"interval c={cfg.anchor.anchor_interval}, delay K={cfg.anchor.anchor_delay}", flush=True)
    worker.run(on_iteration_end)
