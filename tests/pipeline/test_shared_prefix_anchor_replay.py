"""The anchor's replay under ``--shared-prefix`` (``anchor/replay.py``, issue 32 item 1: "in every
pass ... the anchor's replay"): the gradient it accumulates equals the unshared replay's within the
fp32 reduction-order tolerance of test_shared_prefix_pp1.py, with a k3 KL term to a reference that
differs from the policy, for G = 2 and 4, ragged prompts and responses; and the unshared replay's
micro-batching adds up to one pass over the whole batch (the token mean is over the batch)."""

import pytest
import torch

from shared_prefix_cases import GRPO, TEMPERATURE, make_batch
from test_shared_prefix_pp1 import GRAD_ATOL, GRAD_REL, _tiny_stage


def _grads(model, ref, batch, mbs, group):
    from megatron_cegrpo.anchor.replay import replay_backward

    model.zero_grad(set_to_none=True)
    replay_backward(model, ref, batch, micro_batch_size=mbs, grpo=GRPO, temperature=TEMPERATURE,
                    shared_prefix_group=group)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got, want):
    assert set(got) == set(want)
    for name, g in want.items():
        assert float(g.abs().max()) > 0, name  # every parameter is reached: a real gradient
        torch.testing.assert_close(got[name], g, rtol=0, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")
        assert float((got[name] - g).norm() / g.norm()) < GRAD_REL, name


@pytest.mark.parametrize("group, mbs", [(2, 4), (4, 8)])
def test_anchor_replay_shared_prefix_equals_unshared(megatron_single_process, group, mbs):
    hf_config, model = _tiny_stage()
    _, ref = _tiny_stage()  # the same weights, then moved: the KL term and its gradient are not 0
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
            p.requires_grad_(False)
    batch = make_batch(hf_config.vocab_size, group, 16 // group, seed=10 + group)
    plain = _grads(model, ref, batch, mbs, 0)
    assert len(plain) == len(list(model.parameters()))
    _assert_close(_grads(model, ref, batch, mbs, group), plain)
    _assert_close(_grads(model, ref, batch, 16, 0), plain)  # one micro-batch of every row


def test_anchor_replay_refuses_a_group_that_does_not_divide_the_micro_batch(megatron_single_process):
    from megatron_cegrpo.anchor.replay import replay_backward

    hf_config, model = _tiny_stage()
    batch = make_batch(hf_config.vocab_size, 4, 2, seed=3)
    with pytest.raises(ValueError, match="group size 4 does not divide the micro-batch size 2"):
        replay_backward(model, None, batch, micro_batch_size=2, grpo=GRPO, temperature=TEMPERATURE,
                        shared_prefix_group=4)
