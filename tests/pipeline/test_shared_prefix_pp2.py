"""Shared-prefix passes through a real PP = 2 gloo pipeline (megatron-core 1F1B, dense codec;
shared_prefix_worker.py): for G = 2 and 4, ragged prompts (12..23 tokens) and responses (1..5),
the forward-only log-probs, the update's losses and log-probs and every gradient on both stages
equal the unshared pipeline's within the fp32 tolerances measured at PP = 1
(test_shared_prefix_pp1.py), and the boundary carries each group once: the forward and backward
bytes are the packed tensors' ``[L, mbs / G, d]`` instead of ``[S, mbs, d]``, exactly. With
``pcaq/prepass=1`` the first stage's prepass runs in the packed layout: it observes, micro-batch by
micro-batch, exactly the ``[L, mbs / G, d]`` states the pass then sends.
"""

import os

import torch

from distributed_util import run_ranks
from shared_prefix_cases import scored
from test_shared_prefix_pp1 import GRAD_ATOL, GRAD_REL, LOSS_ATOL, LP_ATOL

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared_prefix_worker.py")


def _ceil8(n: int) -> int:
    return -(-n // 8) * 8


def _check_equal(plain, shared, ok):
    for key in ("fwd_logprobs", "logprobs"):
        torch.testing.assert_close(torch.cat(shared[key])[ok], torch.cat(plain[key])[ok], rtol=0, atol=LP_ATOL)
    for a, b in zip(shared["losses"], plain["losses"]):
        torch.testing.assert_close(a, b, rtol=0, atol=LOSS_ATOL)
    assert sum(abs(float(x)) for x in plain["losses"]) > 1e-3


def test_shared_prefix_pipeline_equals_unshared_and_sends_each_prompt_once(tmp_path):
    # (and pcaq/prepass=1's prepass observes, in the packed layout, what the shared pass sends)
    run_ranks([WORKER, "--out", str(tmp_path)], 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    d, elem = ranks[0]["hidden"], 4  # fp32 boundary tensors
    for g in (2, 4):
        first, last = ranks[0][g], ranks[1][g]
        b = last["batch"]
        p, r, n = b["prompt_lengths"], b["response_lengths"], last["rows"]
        ok = scored({"tokens": b["loss_mask"], "prompt_lengths": p, "response_lengths": r})
        _check_equal(last["plain"], last["shared"], ok)
        for rank in ranks:  # every gradient of both stages (the tied embedding summed over them)
            pg, sg = rank[g]["plain"]["grads"], rank[g]["shared"]["grads"]
            assert set(pg) == set(sg) and len(pg) > 5
            for name, grad in pg.items():
                assert float(grad.abs().max()) > 0, name
                torch.testing.assert_close(sg[name], grad, rtol=0, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")
                assert float((sg[name] - grad).norm() / grad.norm()) < GRAD_REL, name
        # the lengths from the token counts: S the longest row, L the longest group [prompt, r_1..r_G]
        s = _ceil8(int((p + r).max()))
        packed = _ceil8(max(int(p[k * g] + r[k * g:(k + 1) * g].sum()) for k in range(n // g)))
        assert (first["seq"], first["packed"]) == (s, packed)
        # forward: 2 passes (forward-only, update) sent by stage 0; backward: the update's, sent by stage 1
        for side, direction, passes in ((first, "fwd", 2), (last, "bwd", 1)):
            plain_b, shared_b = (side[k]["meter"][f"comm/{direction}_bytes"] for k in ("plain", "shared"))
            assert plain_b == passes * n * s * d * elem
            assert shared_b == passes * (n // g) * packed * d * elem
            assert shared_b * g * s == plain_b * packed  # the ratio L / (G S), exactly
        print(f"G={g}: S={s} L={packed} boundary bytes shared/unshared = {packed / (g * s):.4f}; real tokens "
              f"{int(p[::g].sum() + r.sum())}/{int((p + r).sum())}")

    # pcaq/prepass=1 (G = 2): the first stage's prepass sees the packed states the pass sends
    (prepassed, observed, sent), (last_prepassed, last_observed, _) = (r[2]["prepass"] for r in ranks)
    micro_batches, packed, d = ranks[1][2]["rows"] // 4, ranks[0][2]["packed"], ranks[0]["hidden"]
    assert (prepassed, last_prepassed, last_observed) == (micro_batches, 0, [])  # the last stage runs none
    assert len(observed) == len(sent) == micro_batches
    for seen, out in zip(observed, sent):
        assert seen.shape == (packed, 2, d)  # [L, mbs / G, d]: each group's prompt once
        torch.testing.assert_close(seen, out, rtol=0, atol=1e-6)
