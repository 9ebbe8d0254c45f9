"""Shared-prefix passes at PP = 1 (``PipelineRunner(shared_prefix_group=G)``, issue 32 item 1):
the GRPO loss, the per-token log-probs and every parameter gradient of tiny-llama equal the
unshared pass (autograd of the rows one by one) within fp32 reduction-order tolerance, for G = 2
and 4 with ragged prompts and responses.

Tolerance (fp32, measured on this CPU over the three cases below): log-probs differ by at most
1.9e-6 (|lp| up to 11.2 nats: two ulps), the micro-batch losses by 6.0e-8, gradients by 2.2e-7
elementwise (largest entry 0.20) and 7.9e-7 in relative norm per parameter. For scale, the
unshared pass against itself at another micro-batch size (4 vs 8 rows) differs by 3.4e-8 and
1.8e-7 in the same gradient measures: the same order, fp32 summation order. The asserts allow
about 5-10x the measured: LP_ATOL 1e-5, LOSS_ATOL 5e-7, GRAD_ATOL 2e-6 and a relative norm of 1e-5.
"""

import pytest
import torch

from shared_prefix_cases import add_policies, loss_fn, logprob_fn, make_batch, scored

LP_ATOL, LOSS_ATOL, GRAD_ATOL, GRAD_REL = 1e-5, 5e-7, 2e-6, 1e-5


def _tiny_stage():
    from megatron_cegrpo.models import (build_stage, hf_to_megatron, load_hf_state_dict, load_stage_weights,
                                        resolve_model, transformer_config_from_hf)

    hf_config, hf_sd = load_hf_state_dict(resolve_model("tiny-llama"))
    tf = transformer_config_from_hf(hf_config, calculate_per_token_loss=True)
    model = build_stage(hf_config, tf, pp_rank=0, pp_size=1)
    load_stage_weights(model, hf_to_megatron(hf_sd, hf_config, tf, 0, 1))
    return hf_config, model


def _update(model, runner, batch):
    from functools import partial

    model.zero_grad(set_to_none=True)
    outs = runner.run(model, batch, step=3, forward_only=False,
                      loss_fn=partial(loss_fn, float(batch["loss_mask"].sum()), float(batch["tokens"].shape[0])))
    return outs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("group, mbs", [(2, 4), (4, 4), (4, 8)])
def test_shared_prefix_equals_unshared_pp1(megatron_single_process, group, mbs):
    from megatron_cegrpo.pipeline.schedule import PipelineRunner

    hf_config, model = _tiny_stage()
    batch = make_batch(hf_config.vocab_size, group, 16 // group, seed=group)
    plain, shared = PipelineRunner(None, None, mbs, 1), PipelineRunner(None, None, mbs, 1, shared_prefix_group=group)
    ok = scored(batch)
    with torch.no_grad():
        lp_plain = torch.cat([o["logprobs"] for o in plain.run(model, batch, step=3, forward_only=True,
                                                               loss_fn=logprob_fn)])
        lp_shared = torch.cat([o["logprobs"] for o in shared.run(model, batch, step=3, forward_only=True,
                                                                 loss_fn=logprob_fn)])
    torch.testing.assert_close(lp_shared[ok], lp_plain[ok], rtol=0, atol=LP_ATOL)
    assert float(lp_plain[ok].abs().max()) > 1.0  # real log-probs of a random model, not zeros
    add_policies(batch, lp_plain, seed=group)
    outs_p, grads_p = _update(model, plain, batch)
    outs_s, grads_s = _update(model, shared, batch)
    for a, b in zip(outs_s, outs_p):
        torch.testing.assert_close(a["loss"], b["loss"], rtol=0, atol=LOSS_ATOL)
    assert sum(abs(float(o["loss"])) for o in outs_p) > 1e-3
    torch.testing.assert_close(torch.cat([o["logprobs"] for o in outs_s])[ok],
                               torch.cat([o["logprobs"] for o in outs_p])[ok], rtol=0, atol=LP_ATOL)
    assert set(grads_s) == set(grads_p) and len(grads_p) == len(list(model.parameters()))
    for name, g in grads_p.items():
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(grads_s[name], g, rtol=0, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")
        assert float((grads_s[name] - g).norm() / g.norm()) < GRAD_REL, name


def test_shared_prefix_runner_refuses_a_group_that_does_not_divide_the_micro_batch():
    from megatron_cegrpo.pipeline.schedule import PipelineRunner

    with pytest.raises(ValueError, match="group size 4 does not divide the micro-batch size 6"):
        PipelineRunner(None, None, 6, 1, shared_prefix_group=4)


@pytest.mark.parametrize("group", [0, 4])
def test_update_flops_count_the_shape_the_pass_computes(megatron_single_process, group):
    """``perf/update_flops`` (training/perf.py) at the runner's ``pass_shape``: with shared prefixes
    the N / G packed rows of length L, not the N rows of S; torch's FLOP counter over a real update
    pass (forward and backward, every matmul and bmm) agrees exactly."""
    from functools import partial

    from torch.utils.flop_counter import FlopCounterMode

    from megatron_cegrpo.pipeline.schedule import PipelineRunner
    from megatron_cegrpo.training.perf import update_pass_flops

    hf_config, model = _tiny_stage()
    batch = make_batch(hf_config.vocab_size, 4, 4, seed=7)
    with torch.no_grad():
        lp = torch.cat([o["logprobs"] for o in PipelineRunner(None, None, 8, 1).run(
            model, batch, step=3, forward_only=True, loss_fn=logprob_fn)])
    add_policies(batch, lp, seed=7)
    runner = PipelineRunner(None, None, 8, 1, shared_prefix_group=group)
    n, s = batch["tokens"].shape
    lengths = [int(batch["prompt_lengths"][k * 4]) + int(batch["response_lengths"][k * 4:(k + 1) * 4].sum())
               for k in range(4)]
    packed = -(-max(lengths) // 8) * 8  # L: the longest group, rounded up to 8
    assert runner.pass_shape(batch) == ((n, s) if not group else (n // 4, packed))
    assert not group or packed < 4 * s  # the packed rows are shorter than the G rows they replace
    with FlopCounterMode(display=False) as counter:
        runner.run(model, batch, step=3, forward_only=False,
                   loss_fn=partial(loss_fn, float(batch["loss_mask"].sum()), float(n)))
    tf = model.config
    assert counter.get_total_flops() == update_pass_flops(model, tf, tf.num_layers, *runner.pass_shape(batch))
