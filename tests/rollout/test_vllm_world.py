"""vLLM beside a multi-rank trainer (issue 36): in-process vLLM starts on one rank of a two-rank gloo
world without waiting for the other rank (``vllm_engine._own_distributed_world``), and the trainer's
world is intact afterwards: the default group, its rank and size, and collectives over it (an
all-reduce and a broadcast before the engine starts, between updates and generations, and after the
engine is shut down). The engine sits on rank 1, so its groups' rank lookups go through a trainer
rank that is not vLLM's 0. Its weights equal the trainer's rounded to bf16 after an update, and its
seeded samples repeat.

Skipped where vLLM is not installed (CI's lean venv; ``make venv VLLM=1``).
"""

import ast

import pytest

pytest.importorskip("vllm")

from distributed_util import run_ranks  # noqa: E402

WORKER = r'''
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
out = {}

def trainer_collectives(tag):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    b = torch.tensor([float(rank * 10 + 7)])
    dist.broadcast(b, src=1)
    out[tag] = (t.item(), b.item(), dist.get_rank(), dist.get_world_size())

trainer_collectives("before")
if rank == 1:
    import sys
    sys.path.insert(0, "tests/rollout")
    from test_vllm_engine import perturbed, tiny64
    from megatron_cegrpo.models import load_tokenizer, resolve_model
    from megatron_cegrpo.rollout import vllm_engine as ve
    cfg, sd = tiny64("llama")
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    eng = ve.VLLMRolloutEngine(cfg, sd, tok, dtype="bf16", max_model_len=128, kv_cache_mb=8)
    out["default_is_trainer"] = dist.distributed_c10d._get_default_group().size() == world
dist.barrier()
trainer_collectives("started")
if rank == 1:
    prompts = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])]
    a = eng.generate(prompts, max_new_tokens=8, temperature=1.0, generator_seed=3)
    sd = perturbed(sd, 0)
    eng.update_weights(sd)
    got, ref = eng.engine_weights(), ve.rounded_reference(sd, "bf16", eng.tied)
    out["weights_equal"] = sorted(got) == sorted(ref) and all(torch.equal(got[k] + 0, ref[k] + 0) for k in ref)
    b = eng.generate(prompts, max_new_tokens=8, temperature=1.0, generator_seed=3)
    c = eng.generate(prompts, max_new_tokens=8, temperature=1.0, generator_seed=3)
    out["tokens"] = [r.numel() for r in a.response_ids]
    out["repeat"] = all(torch.equal(x, y) for x, y in zip(b.response_ids, c.response_ids))
trainer_collectives("generated")
if rank == 1:
    eng.close()
trainer_collectives("closed")
dist.barrier()
dist.destroy_process_group()
print("RESULT", repr(out))
'''


def test_vllm_starts_beside_a_two_rank_trainer_and_leaves_its_world_intact():
    outs = run_ranks(["-c", WORKER], world_size=2, timeout=420)
    res = [ast.literal_eval(next(line for line in o.splitlines() if line.startswith("RESULT "))[7:]) for o in outs]
    for r, got in enumerate(res):
        for tag in ("before", "started", "generated", "closed"):
            # all-reduce of 1 + 2, rank 1's broadcast 17, the trainer's rank and world size
            assert got[tag] == (3.0, 17.0, r, 2), (r, tag, got[tag])
    assert res[1]["default_is_trainer"] is True
    assert res[1]["weights_equal"] is True
    assert res[1]["repeat"] is True
    assert all(0 < n <= 8 for n in res[1]["tokens"])
