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
    """The replay's gradients; every forward of ``model`` and ``ref`` checked to run the layout asked
    for: packed groups [mbs / G, L] with an attention mask, or the rows [mbs, S] without one."""
    from megatron_cegrpo.anchor.replay import replay_backward

    seen = []

    def check(module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        if group:
            assert ids.shape[0] == mbs // group and mask is not None and mask.shape[-1] == ids.shape[1]
        else:
            assert ids.shape == (mbs, batch["tokens"].shape[1]) and mask is None
        seen.append(module)

    hooks = [m.register_forward_pre_hook(check, with_kwargs=True) for m in {id(model): model, id(ref): ref}.values()
             if m is not None]
    model.zero_grad(set_to_none=True)
    try:
        replay_backward(model, ref, batch, micro_batch_size=mbs, grpo=GRPO, temperature=TEMPERATURE,
                        shared_prefix_group=group)
    finally:
        for h in hooks:
            h.remove()
    n_mb = batch["tokens"].shape[0] // mbs
    assert len(seen) == n_mb * (2 if ref is not None else 1)
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
    no_kl = _grads(model, None, batch, mbs, 0)  # the KL term is really in the gradient
    assert max(float((plain[n] - no_kl[n]).abs().max()) for n in plain) > 100 * GRAD_ATOL
    _assert_close(_grads(model, ref, batch, mbs, group), plain)
    _assert_close(_grads(model, ref, batch, 16, 0), plain)  # one micro-batch of every row


def test_anchor_replay_refuses_a_group_that_does_not_divide_the_micro_batch(megatron_single_process):
    from megatron_cegrpo.anchor.replay import replay_backward

    hf_config, model = _tiny_stage()
    batch = make_batch(hf_config.vocab_size, 4, 2, seed=3)
    with pytest.raises(ValueError, match="group size 4 does not divide the micro-batch size 2"):
        replay_backward(model, None, batch, micro_batch_size=2, grpo=GRPO, temperature=TEMPERATURE,
                        shared_prefix_group=4)


def test_anchor_worker_replays_shared_only_with_the_lengths(monkeypatch):
    """``AnchorWorker._replay`` asks for the shared layout under ``--shared-prefix``, and falls back to
    the unshared replay for a batch without the lengths (received before a resume that switched the
    flag on)."""
    from types import SimpleNamespace

    from megatron_cegrpo.anchor import worker as worker_mod

    calls = []
    monkeypatch.setattr(worker_mod, "replay_backward", lambda *a, **k: calls.append(k["shared_prefix_group"]))
    cfg = SimpleNamespace(grpo=SimpleNamespace(num_generations=4), parallel=SimpleNamespace(shared_prefix=True,
                                                                                        micro_batch_size=8))
    fake = SimpleNamespace(cfg=cfg, model=None, ref_model=None)
    with_lengths = {"tokens": None, "prompt_lengths": None, "response_lengths": None}
    worker_mod.AnchorWorker._replay(fake, with_lengths, 1.0)
    worker_mod.AnchorWorker._replay(fake, {"tokens": None}, 1.0)
    cfg.parallel.shared_prefix = False
    worker_mod.AnchorWorker._replay(fake, with_lengths, 1.0)
    assert calls == [4, 0, 0]
