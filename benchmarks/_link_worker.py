"""One rank of bench_link (started by benchmarks/bench_link.py; RANK/WORLD_SIZE/MASTER_* in env).

Builds this rank's pipeline stage, one LinkCommunicator + PipelineRunner per codec (all
sharing one LinkModel), and runs the GRPO training step for every (link setting, codec)
pair, interleaved round by round (codec order alternating) so that both codecs see the same
machine load; ``--warmup`` untimed steps come first:

    old log-probs: forward-only pipeline pass (log-prob + entropy on the last stage)
    update:        forward+backward pipeline pass, clipped-ratio GRPO loss (token-mean)
    batch:         the driver's rollout batch to every stage (benchmarks/whole_step.py)
    embd_sync:     the tied embedding's exchange (first <-> last stage): the dense all-reduce,
                   or the rows of the batch's tokens (variant ``after``)
    optimizer:     global grad-norm clip (all-reduce over the pipeline) + DeepSpeedCPUAdam step
    sampler_sync:  stage weights to the driver (fp32, or the modelled bf16 delta)
    anchor:        the anchor shipments' link time per step (modelled: no anchor rank)

``--codecs`` names the variants of benchmarks/whole_step.py: dense (dense-everything), mask
(today), after (this issue).

Iteration time is rank 0's wall time between two pipeline-wide barriers. Rank 0 writes
all measurements as JSON to --result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from functools import partial

import torch
import torch.distributed as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam

from megatron_cegrpo.bootstrap import bootstrap
from megatron_cegrpo.compression import ByteMeter, build_codec
from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.initialize import initialize_distributed, shutdown_distributed
from megatron_cegrpo.arguments import GRPOConfig
from megatron_cegrpo.grpo.loss import grpo_token_loss
from megatron_cegrpo.models.stage import build_policy_stage
from megatron_cegrpo.optim.hooks import GradClipHook

SEED = 1234
# user-facing link setting -> (LinkModel mode, tbf qdisc on the rank's interface)
SETTINGS = {"off": ("off", False), "sim": ("sim", False), "tbf": ("latency", True)}


def make_batch(n: int, s: int, vocab: int, group_size: int = 8, seed: int = SEED):
    """A packed GRPO batch: prompts of s/4 tokens, responses fill the rest; +-1 advantages per group."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (n, s), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    prompt = max(1, s // 4)
    loss_mask = torch.zeros(n, s)
    loss_mask[:, prompt - 1: s - 1] = 1.0
    scores = (torch.rand(n, generator=g) > 0.5).float()
    adv = ca.compute_grpo_outcome_advantage(scores, min(group_size, n)) if n % min(group_size, n) == 0 else scores
    return {
        "tokens": tokens, "labels": labels, "loss_mask": loss_mask,
        "position_ids": torch.arange(s).unsqueeze(0).expand(n, s).contiguous(),
        "advantages": adv.view(n, 1) * loss_mask,
        "old_logprobs": torch.zeros(n, s),
        "sample_ids": torch.arange(n, dtype=torch.long),
    }


def logprob_loss(mb, logits):
    logits = logits.float()
    out = {"logprobs": ca.logprobs_from_logits(logits, mb["labels"]).detach(),
           "entropy": ca.entropy_from_logits(logits).detach()}
    return torch.zeros(()), torch.tensor(0, dtype=torch.int), out


def update_loss(num_tokens: float, mb, logits):
    """The trainer's GRPO token loss (``grpo/loss.py``) at its defaults: clip 0.2 / 0.2,
    token-mean, T = 1, no KL term (the benchmark has no reference model)."""
    loss, stats = grpo_token_loss(logits, mb, GRPOConfig(), temperature=1.0, num_tokens=num_tokens,
                                  num_seqs=float(mb["tokens"].shape[0]), old_logprobs=mb["old_logprobs"])
    return loss, stats["tokens"].to(torch.int), {"loss": loss.detach()}


class Qdisc:
    """tbf on this rank's own interface, inside its own network namespace (made by bench_link)."""

    def __init__(self, dev, rate, burst, latency):
        self.dev, self.rate, self.burst, self.latency = dev, rate, burst, latency
        self.on = None

    def set(self, on: bool) -> None:
        if self.dev is None or on == self.on:
            return
        if on:
            cmd = ["tc", "qdisc", "replace", "dev", self.dev, "root", "tbf", "rate", self.rate,
                   "burst", self.burst, "latency", self.latency]
        else:
            cmd = ["tc", "qdisc", "del", "dev", self.dev, "root"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 and on:  # deleting an absent root qdisc fails harmlessly
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        self.on = on


def main():
    bootstrap(cpu_compat=True)  # first: megatron-core (link_model, the schedule) warns at import
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--codecs", default="dense,mask,after")
    ap.add_argument("--sync-fraction", type=float, default=0.022)
    ap.add_argument("--anchor-interval", type=int, default=20)
    ap.add_argument("--keep-ratio", type=float, default=0.05)
    ap.add_argument("--settings", default="off,sim")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bandwidth-mbit", type=float, default=200.0)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--blocking-send", action="store_true")
    ap.add_argument("--transfer", default="rendezvous", choices=["rendezvous", "eager"])
    ap.add_argument("--trace", action="store_true", help="record every received message's timeline")
    ap.add_argument("--ts-file", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--tc-dev", default=None)
    ap.add_argument("--tc-rate", default="200mbit")
    ap.add_argument("--tc-burst", default="32kbit")
    ap.add_argument("--tc-latency", default="400ms")
    args = ap.parse_args()
    t_setup = time.monotonic()

    from benchmarks.link_model import LinkCommunicator, LinkModel
    from benchmarks.whole_step import VARIANTS, WholeStep
    from megatron_cegrpo.pipeline.schedule import PipelineRunner

    ctx = initialize_distributed(args.pp, SEED, num_threads=args.threads)
    policy = build_policy_stage(args.model, pp_rank=ctx.pp_rank, pp_size=ctx.pp_size)
    hf_config, tf, model = policy.hf_config, policy.tf_config, policy.model
    params = [p for p in model.parameters() if p.requires_grad]
    tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
    shared = model.shared_embedding_or_output_weight() if tied else None
    dup = shared if (not ctx.is_first_stage and model.post_process) else None  # counted once in the norm
    optimizer = DeepSpeedCPUAdam(params, lr=1e-7, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw_mode=True)
    optimizer.register_step_pre_hook(GradClipHook(params, [p for p in params if p is not dup], 1.0, group=ctx.pp_group))
    embd_weight = shared if (model.pre_process or model.post_process) else None
    embd_bytes = embd_weight.numel() * embd_weight.element_size() if embd_weight is not None else 0

    link = LinkModel(args.ts_file, args.pp - 1, args.bandwidth_mbit * 1e6, args.latency_ms / 1e3,
                     transfer=args.transfer, blocking_send=args.blocking_send)
    codecs = [c for c in args.codecs.split(",") if c]
    settings = [s for s in args.settings.split(",") if s]
    qdisc = Qdisc(args.tc_dev, args.tc_rate, args.tc_burst, args.tc_latency)
    comms, runners, meters = {}, {}, {}
    whole = WholeStep(model, ctx, link, args.sync_fraction, args.anchor_interval)
    for base in dict.fromkeys(VARIANTS[c][0] for c in codecs):  # variants of one codec share its caches
        codec = build_codec(base, args.keep_ratio if base == "mask" else 0.05)
        meter = ByteMeter()
        comm = LinkCommunicator(ctx.pp_group, tf, codec, meter, seed=SEED, link=link)
        runner = PipelineRunner(comm, ctx.pg_collection, args.micro_batch, ctx.pp_size)
        for c in codecs:
            if VARIANTS[c][0] == base:
                meters[c], comms[c], runners[c] = meter, comm, runner
    batch = make_batch(args.num_seqs, args.seq_len, int(hf_config.vocab_size))
    num_tokens = float(batch["loss_mask"].sum())
    setup_s = time.monotonic() - t_setup

    def step(codec: str, t: int) -> dict:  # codec: the variant (whole_step.VARIANTS)
        runner = runners[codec]
        dist.barrier()
        tb = time.monotonic()
        batch_bytes = whole.batch(batch)
        t0 = time.monotonic()
        model.eval()
        with torch.no_grad():
            outs = runner.run(model, batch, step=t, forward_only=True, loss_fn=logprob_loss)
        if ctx.is_last_stage:
            batch["old_logprobs"] = torch.cat([o["logprobs"] for o in outs])
        t1 = time.monotonic()
        model.train()
        optimizer.zero_grad(set_to_none=True)
        runner.run(model, batch, step=t, forward_only=False, loss_fn=partial(update_loss, num_tokens))
        t2 = time.monotonic()
        embd_sent = whole.embedding(codec, batch["tokens"])
        t3 = time.monotonic()
        optimizer.step()  # the clip hook all-reduces one scalar over the pipeline group
        link.wait_until(time.monotonic() + (ctx.pp_size - 1) * link.collective_delay(0))  # ring: 2(n-1) steps
        t4 = time.monotonic()
        sync_bytes = whole.sampler_sync(codec)
        t5 = time.monotonic()
        anchor_bytes = whole.anchor(codec)
        t6 = time.monotonic()
        dist.barrier()
        t7 = time.monotonic()
        return {"iter_s": t7 - tb, "batch_s": t0 - tb, "old_logprob_s": t1 - t0, "update_s": t2 - t1,
                "embd_sync_s": t3 - t2, "optimizer_s": t4 - t3, "sampler_sync_s": t5 - t4, "anchor_s": t6 - t5,
                "batch_bytes": batch_bytes, "embd_sync_bytes": embd_sent, "sampler_sync_bytes": sync_bytes,
                "anchor_bytes": anchor_bytes}

    records = []
    t = 0
    t0_run = time.monotonic()

    def timed(setting: str, c: str, rnd: int, warm: bool) -> None:
        nonlocal t
        mode, tbf_on = SETTINGS[setting]
        qdisc.set(tbf_on)
        link.set_mode(mode)
        t += 1
        link.reset_stats()
        if args.trace:
            link.trace = []
        meters[c].snapshot_and_reset()
        rec = step(c, t)
        snap = meters[c].snapshot_and_reset()
        rec.update({"round": rnd, "warmup": warm, "setting": setting, "codec": c, "step": t,
                    "wire_bytes": snap["comm/fwd_bytes"] + snap["comm/bwd_bytes"],
                    "dense_equiv_bytes": snap["comm/dense_equiv_bytes"],
                    "link_wait_s": link.stats["link_wait_s"], "recv_bytes": link.stats["recv_bytes"]})
        if args.trace:
            rec["trace"] = [[round(v - t0_run, 6) if isinstance(v, float) else v for v in m] for m in link.trace]
        records.append(rec)
        if ctx.rank == 0:
            tag = "warm-up" if warm else f"round {rnd}"
            print(f"[rank0] {tag:>8} {setting:>4} {c:>6}: {rec['iter_s']:.2f} s/iter", flush=True)

    for w in range(args.warmup):  # untimed: first-step allocations, optimizer state, caches
        timed(settings[0], codecs[w % len(codecs)], -1, True)
    for rnd in range(args.iters):  # every (setting, codec) once per round; codec order alternates
        for setting in settings:
            for c in (codecs if rnd % 2 == 0 else codecs[::-1]):
                timed(setting, c, rnd, False)
    qdisc.set(False)

    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object({"rank": ctx.rank, "pp_rank": ctx.pp_rank, "records": records, "setup_s": setup_s,
                        "embd_bytes": embd_bytes}, gathered, dst=0)
    if ctx.rank == 0:
        out = {"model": args.model, "pp": args.pp, "d": int(tf.hidden_size), "num_layers": int(tf.num_layers),
               "vocab": int(hf_config.vocab_size), "pipeline_dtype": str(tf.pipeline_dtype),
               "k": next((cm.codec.fwd.k(int(tf.hidden_size)) for c, cm in comms.items() if VARIANTS[c][0] == "mask"),
                         None),
               "threads_per_rank": args.threads, "ranks": gathered}
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    shutdown_distributed()


if __name__ == "__main__":
    main()
