"""Worker for the sampler weight-sync test (a subprocess, not collected by pytest).

    python sync_worker.py --out DIR      (RANK/WORLD_SIZE/MASTER_* in env; tiny-llama, PP = WORLD_SIZE)

Runs STEPS "optimizer steps" (seeded perturbations of every stage's fp32 parameters), after each
one the bf16 delta sync (``--rollout-dtype bf16``) into a bf16 HF sampler on the driver and the
fp32 gather (``--rollout-dtype fp32``) as the reference, and injects one fault per step in
FAULTS on the last stage (or, for "mirror", in the driver's copy). Writes ``rank{r}.json``:
the bytes this rank handed to ``dist.send`` during each bf16 sync and, on the driver, per step
the sync metrics and the checks (hashes of the sampler's weights against the trainer's weights
rounded to bf16; the fp32 gather against each stage's own digest).
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pipeline_worker import SEED, build  # noqa: E402

STEPS = 7
#: step -> fault injected in that step's bf16 sync (step 4 replays step 3's rejected delta; in the
#: last step the full copy is corrupted too: both ends raise)
FAULTS = {3: "corrupt", 4: "replay", 5: "drop", 6: "mirror", 7: "corrupt_twice"}
QUIET = 2  # a step with no parameter change: an empty delta


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().data).hexdigest()


def perturb(model, rank: int, step: int, scale: float) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


class SendCounter:
    """Counts the bytes of every tensor this rank hands to dist.send while ``on``."""

    def __init__(self):
        self.on, self.bytes, self._send = False, 0, dist.send
        dist.send = self

    def __call__(self, tensor, *a, **k):
        if self.on:
            self.bytes += tensor.numel() * tensor.element_size()
        return self._send(tensor, *a, **k)


def tamper(sync, kind, cache: dict) -> None:
    """Wrap the last stage's ``sync._send`` for one step: record what it sends and, by ``kind``,
    corrupt the payload or replay the previous step's header and payload."""
    real = type(sync)._send.__get__(sync)
    calls = cache["calls"] = []

    def send(t, peer):
        calls.append(t.clone())
        n = len(calls)
        if (kind == "corrupt" and n == 2) or (kind == "corrupt_twice" and n in (2, 4)):  # one flipped bit
            bad = t.clone()
            bad[bad.numel() // 2] ^= 4
            return real(bad, peer)
        if kind == "replay" and n <= 2:  # the previous step's header and payload again
            return real(cache["prev"][n - 1], peer)
        return real(t, peer)

    sync._send = send


def main(out: str) -> None:
    from megatron_cegrpo.initialize import initialize_distributed
    from megatron_cegrpo.models import hf_to_megatron, load_hf_state_dict, load_tokenizer, resolve_model
    from megatron_cegrpo.pipeline.delta_codec import bf16_bits
    from megatron_cegrpo.pipeline.weight_sync import build_weight_sync
    from megatron_cegrpo.rollout.hf_engine import HFRolloutEngine

    t0 = time.perf_counter()
    ctx = initialize_distributed(int(os.environ["WORLD_SIZE"]), SEED, num_threads=1)
    rank, pp, last = ctx.pp_rank, ctx.pp_size, ctx.pp_size - 1
    hf_config, tf, model = build(rank, pp, {"num_layers_in_first_pipeline_stage": 2} if pp == 3 else {})
    src = resolve_model("tiny-llama")
    _, hf_sd = load_hf_state_dict(src)
    lines = []
    baseline = (lambda r: hf_to_megatron(hf_sd, hf_config, tf, r, pp)) if rank == 0 else None
    delta = build_weight_sync(model, ctx.pp_group, "bf16", baseline=baseline)
    delta.log = lambda msg: (lines.append(msg), print(f"[cegrpo] warning: {msg}", flush=True))
    dense = build_weight_sync(model, ctx.pp_group, "fp32")
    engine = HFRolloutEngine(hf_config, hf_sd, load_tokenizer(src), dtype="bf16") if rank == 0 else None
    counter, cache, record = SendCounter(), {}, {"sent": [], "steps": []}
    t_setup = time.perf_counter() - t0
    for step in range(1, STEPS + 1):
        if step != QUIET:
            perturb(model, rank, step, 3e-5)
        fault = FAULTS.get(step)
        if rank == last:
            tamper(delta, fault, cache)
        if rank == last and fault == "drop":  # a delta numbered seq+1 was sent and lost
            delta.state, delta.seq = bf16_bits(list(model.parameters())), delta.seq + 1
            perturb(model, rank, 100 + step, 3e-5)
        if rank == 0 and fault == "mirror":  # the driver's copy of the last stage goes bad in memory
            delta.mirrors[last][7] ^= 1
        counter.on, counter.bytes = True, 0
        if fault == "corrupt_twice":  # the last step: the full copy is corrupted as well
            try:
                delta.gather()
            except RuntimeError as e:
                record["error"] = str(e)
            break
        sds = delta.gather()
        counter.on = False
        record["sent"].append(counter.bytes)
        if rank == last:  # what this step really carried, for the next step's replay
            cache["prev"] = cache["calls"][:2]
            del delta._send
        own = {n: digest(p) for n, p in model.named_parameters()}
        owns = [None] * pp if rank == 0 else None
        dist.gather_object(own, owns, dst=dist.get_global_rank(ctx.pp_group, 0), group=ctx.pp_group)
        counter.on, counter.bytes = True, 0
        fp32 = dense.gather()
        counter.on = False
        record["sent_fp32"] = record.get("sent_fp32", []) + [counter.bytes]
        if rank == 0:
            record["steps"].append(check(step, sds, fp32, owns, engine, (delta, dense), (hf_config, tf, pp)))
    record["lines"] = lines
    print(f"rank {rank}: set up {t_setup:.1f} s, {STEPS} steps {time.perf_counter() - t0 - t_setup:.1f} s", flush=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def check(step, sds, fp32, owns, engine, syncs, model_cfg):
    """The driver's checks after one step (hash equalities, dtypes, metrics)."""
    from megatron_cegrpo.models import megatron_to_hf

    delta, dense = syncs
    hf_config, tf, pp = model_cfg
    fp32_exact = all(digest(t) == owns[r][n] and t.dtype == torch.float32
                     for r, sd in enumerate(fp32) for n, t in sd.items())
    engine.update_weights(megatron_to_hf(sds, hf_config, tf, pp))
    want = megatron_to_hf([{n: t.to(torch.bfloat16) for n, t in sd.items()} for sd in fp32], hf_config, tf, pp)
    have = engine.model.state_dict()
    hashes_equal = all(have[k].dtype == torch.bfloat16 and digest(have[k]) == digest(v) for k, v in want.items())
    return {"step": step, "fp32_exact": fp32_exact, "hashes_equal": hashes_equal, "keys": len(want),
            "metrics": delta.metrics(), "fp32_metrics": dense.metrics()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    main(ap.parse_args().out)
    sys.exit(0)
