"""Entry of the anchor rank: build the dense model and reference, then follow the trainer."""

from __future__ import annotations

import os
import time

from megatron_cegrpo import checkpointing as ck
from megatron_cegrpo import heartbeat
from megatron_cegrpo.anchor.transport import TAG_SAVE, TAG_SAVE_DONE, recv_object, send_object
from megatron_cegrpo.anchor.worker import AnchorWorker
from megatron_cegrpo.models.stage import build_policy_stage
from megatron_cegrpo.plan import plan_for

__all__ = ["run_anchor"]

ANCHOR_BLOB = "anchor_state"


def run_anchor(cfg, ctx, plan=None) -> None:
    """Run the anchor circuit on this rank until the trainer's last iteration.

    ``plan``: the run plan start-up resolved (``plan.RunPlan``: the codec, the resume decision);
    None: resolved here the same way (``plan.plan_for``).

    On each checkpoint iteration the driver sends the checkpoint's temporary directory and
    the anchor writes its state (M, the ring and the pending batches) to
    ``anchor/anchor_state.pt`` there before the stages commit it (``anchor/transport.py``);
    on ``--load`` it restores that state. When the trainer's connection closes (the run
    ended or a stage died) it stops with one line instead of a traceback.
    """
    t0 = time.perf_counter()
    if cfg.anchor.anchor_nice:  # off the critical path: where it shares cores with the stages, they go first
        os.nice(cfg.anchor.anchor_nice)
    # the whole model densely (PP = 1); a reference only when the objective has a KL term
    dense = build_policy_stage(cfg.model.model, params_dtype=cfg.model.precision,
                               pg_collection=ctx.pg_collection, with_reference=cfg.grpo.kl_coef > 0,
                               per_token_loss=False)
    model, ref = dense.model, dense.ref_model
    model.eval()
    pp = cfg.parallel.pipeline_model_parallel_size
    start, state = 0, None
    plan = plan_for(cfg, ctx, dense.hf_config, plan)
    point = plan.resume  # the trainer's resume decision
    if point is not None and point.continues:  # trainer_state.pt, or trainer_state_tp00.pt at TP > 1
        start = point.iteration
        if f"{ANCHOR_BLOB}.pt" in ck.stage_file_names(point.meta, ck.ANCHOR):
            state = ck.read_stage_blob(point.ckpt_dir, ck.ANCHOR, ANCHOR_BLOB, meta=point.meta)
        else:  # saved without an anchor: the anchor starts empty at the trainer's iteration
            print(f"[cegrpo anchor] {point.ckpt_dir} has no anchor state; M and the ring start empty", flush=True)
    try:
        worker = AnchorWorker(cfg, model, ref, stage_ranks=ctx.stage_ranks or list(range(pp)), start_iteration=start,
                              group=ctx.anchor_group, codec=plan.codec)
        if state is not None:
            worker.load_state_dict(state)

        def on_iteration_end(t: int) -> None:
            heartbeat.mark("anchor iteration", t)
            c = cfg.checkpoint
            if not ck.is_save_iteration(t, c.save, c.save_interval, cfg.optim.train_iters):
                return
            tmp, _ = recv_object(0, TAG_SAVE, ctx.anchor_group)
            try:
                ck.write_stage_blob(tmp, ck.ANCHOR, ANCHOR_BLOB, worker.state_dict())
                reply = "ok"
            except (OSError, ck.CheckpointError) as e:
                reply = f"{type(e).__name__}: {e}"
            send_object(reply, 0, TAG_SAVE_DONE, ctx.anchor_group)

        print(f"[cegrpo anchor] rank {ctx.rank}: dense replica ready in {time.perf_counter() - t0:.1f} s, "
              f"interval c={cfg.anchor.anchor_interval}, delay K={cfg.anchor.anchor_delay}", flush=True)
        worker.run(on_iteration_end)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "closed" not in first.lower():
            raise
        print(f"[cegrpo anchor] rank {ctx.rank}: the trainer's connection closed ({first[:160]}); stopping",
              flush=True)
