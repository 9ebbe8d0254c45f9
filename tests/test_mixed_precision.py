"""--bf16 (optim/mixed_precision.py): bf16 compute over fp32 masters, gradients summed in fp32."""

import pytest
import torch

from megatron_cegrpo.optim.mixed_precision import (
    MixedPrecision,
    attach_mixed_precision,
    compute_precision,
    mixed_precision_of,
)


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8))


def _batches(n=3):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(5, 16, generator=g) for _ in range(n)]


def test_gradients_are_bf16_passes_summed_in_fp32():
    net = _net()
    masters = [p.detach().clone() for p in net.parameters()]
    mp = attach_mixed_precision(net)
    xs = _batches()
    with compute_precision(net):
        assert all(p.dtype == torch.bfloat16 for p in net.parameters())
        for x in xs:
            out = net(x.bfloat16())
            assert out.dtype == torch.bfloat16
            out.float().square().mean().backward()
    # back to the very same fp32 masters, gradients fp32
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert all(torch.equal(p, m) for p, m in zip(net.parameters(), masters))
    assert all(p.grad.dtype == torch.float32 for p in net.parameters())
    assert mixed_precision_of(net) is mp

    # reference: a bf16 copy of the net, one backward per batch, each bf16 gradient added in fp32
    ref = _net()
    ref.load_state_dict({k: v.bfloat16() for k, v in ref.state_dict().items()})
    ref.bfloat16()
    want = [torch.zeros_like(m) for m in masters]
    for x in xs:
        ref.zero_grad(set_to_none=True)
        ref(x.bfloat16()).float().square().mean().backward()
        for w, p in zip(want, ref.parameters()):
            w.add_(p.grad)
    for p, w in zip(net.parameters(), want):
        assert torch.equal(p.grad, w)


def test_a_gradient_held_before_the_pass_is_added_to():
    net = _net()
    attach_mixed_precision(net)
    before = [torch.full_like(p, 0.5) for p in net.parameters()]
    for p, b in zip(net.parameters(), before):
        p.grad = b.clone()
    x = _batches(1)[0]
    with compute_precision(net):
        net(x.bfloat16()).float().sum().backward()
    fresh = _net()
    attach_mixed_precision(fresh)
    with compute_precision(fresh):
        fresh(x.bfloat16()).float().sum().backward()
    for p, q, b in zip(net.parameters(), fresh.parameters(), before):
        assert torch.equal(p.grad, b + q.grad)


def test_small_steps_survive_in_the_masters_not_in_bf16_parameters():
    # lr 1e-5 relative to a weight of 1: below bf16's resolution (2^-8), kept by an fp32 master
    net = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    attach_mixed_precision(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-5)
    with compute_precision(net):
        net(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert torch.all(net.weight < 1.0) and net.weight.dtype == torch.float32

    plain = torch.nn.Linear(4, 4, bias=False).bfloat16()
    with torch.no_grad():
        plain.weight.fill_(1.0)
    plain(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum().backward()
    torch.optim.SGD(plain.parameters(), lr=1e-5).step()
    assert torch.all(plain.weight == 1.0)  # --params-dtype bf16 loses the step


def test_reentrant_and_frozen_parameters():
    net = _net()
    net[0].weight.requires_grad_(False)
    attach_mixed_precision(net)
    with compute_precision(net):
        with compute_precision(net):  # nested: nothing more to do
            net(_batches(1)[0].bfloat16()).float().sum().backward()
        assert net[2].weight.dtype == torch.bfloat16
    assert net[0].weight.grad is None and net[2].weight.grad.dtype == torch.float32
    assert compute_precision(None, torch.nn.Linear(2, 2)) is not None  # no view: a no-op context


def test_non_fp32_masters_are_refused():
    with pytest.raises(ValueError, match="fp32 master parameters"):
        MixedPrecision(torch.nn.Linear(2, 2).bfloat16())


def test_megatron_stage_runs_bf16_with_fp32_gradients(megatron_single_process):
    """A tiny-llama stage built for --bf16 through the trainer's own runner: bf16 logits, fp32
    weights and gradients after, and gradients within bf16 rounding of the fp32 stage's."""
    from megatron_cegrpo.compat.placement import place_batch
    from megatron_cegrpo.models.stage import build_policy_stage
    from megatron_cegrpo.pipeline.schedule import PipelineRunner
    from megatron.core.process_groups_config import ProcessGroupCollection

    def grads(precision):
        torch.manual_seed(0)
        pol = build_policy_stage("tiny-llama", params_dtype=precision, per_token_loss=True,
                                 pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        g = torch.Generator().manual_seed(3)
        n, s = 4, 12
        tokens = torch.randint(0, pol.hf_config.vocab_size, (n, s), generator=g)
        batch = place_batch({"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(n, s),
                             "position_ids": torch.arange(s).expand(n, s).contiguous(), "sample_ids": torch.arange(n)})
        seen = []

        def loss_fn(mb, logits):
            seen.append(logits.dtype)
            lp = torch.log_softmax(logits.float(), -1).gather(-1, mb["labels"][..., None])[..., 0]
            return -(lp * mb["loss_mask"]).sum(), mb["loss_mask"].sum().int(), {}

        PipelineRunner(None, None, 2, 1).run(pol.model, batch, step=1, forward_only=False, loss_fn=loss_fn)
        return pol, seen

    mixed, seen_mixed = grads("bf16-mixed")
    full, seen_full = grads("fp32")
    assert seen_mixed == [torch.bfloat16] * 2 and seen_full == [torch.float32] * 2
    assert mixed.tf_config.pipeline_dtype == torch.bfloat16 and mixed.tf_config.params_dtype == torch.float32
    for (n, p), q in zip(mixed.model.named_parameters(), full.model.parameters()):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
        assert torch.equal(p, q), n  # the masters are the loaded fp32 weights, untouched
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cos > 0.99, (n, float(cos))


def test_precision_choice_follows_the_hosts_bf16_support(monkeypatch):
    from types import SimpleNamespace

    from megatron_cegrpo.compat import precision as pr

    cfg = SimpleNamespace(model=SimpleNamespace(bf16=True, params_dtype="fp32"),
                          rollout=SimpleNamespace(dtype="bf16", compute_dtype="auto", engine="hf"))
    monkeypatch.setattr(pr.torch.cuda, "is_available", lambda: False)
    for amx, avx, flags in ((False, False, ""), (True, False, pr.BF16_FLAGS), (False, True, pr.BF16_FLAGS)):
        monkeypatch.setattr(pr.torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(pr.torch.cpu, "_is_avx512_bf16_supported", lambda v=avx: v)
        assert pr.recommended_precision_flags() == flags
        assert pr.cpu_bf16_kernels() == ("amx" if amx else "avx512_bf16" if avx else "emulated")
        warning = pr.precision_warning(cfg)
        assert (warning == "") == bool(flags)
        if warning:
            assert warning.startswith("warning: --bf16 on a CPU without AMX or AVX512-BF16") and "fix: drop" in warning
        # the sampler holds bf16 weights; under auto it runs in bf16 only where that is native
        assert pr.rollout_compute_dtype(cfg.rollout) == ("bf16" if flags else "fp32")
    cfg.model.bf16 = False
    assert pr.precision_warning(cfg) == ""  # fp32 passes, fp32 sampler compute: nothing to say
    monkeypatch.setattr(pr.torch.cpu, "_is_avx512_bf16_supported", lambda: False)  # a host that emulates bf16
    cfg.rollout.compute_dtype = "bf16"  # asked for explicitly
    assert pr.rollout_compute_dtype(cfg.rollout) == "bf16"
    assert pr.precision_warning(cfg).startswith("warning: a bf16 sampler (--rollout-compute-dtype) on a CPU without")
    cfg.rollout = SimpleNamespace(dtype="fp32", compute_dtype="auto", engine="hf")
    assert pr.rollout_compute_dtype(cfg.rollout) == "fp32"
    cfg.rollout = SimpleNamespace(dtype="bf16", compute_dtype="auto", engine="vllm")
    assert pr.rollout_compute_dtype(cfg.rollout) == "bf16"  # vLLM runs in its weights' dtype


def test_matmul_speed_is_the_flops_over_the_clock(monkeypatch):
    """A clock that advances 0.1 s a reading: the loop stops after the first reading past
    ``seconds`` and the rate is 2 m k n products over the time between the first and last readings;
    the caller's thread count comes back."""
    from megatron_cegrpo.compat import precision

    ticks = iter(0.1 * i for i in range(100))
    monkeypatch.setattr(precision.time, "perf_counter", lambda: next(ticks))
    threads = torch.get_num_threads()
    # readings: t0 = 0.0; the checks after products 2, 3, 4 read 0.1, 0.2, 0.3 (> 0.25: stop); the rate 0.4
    got = precision.matmul_gflops(torch.float32, seconds=0.25, threads=1)
    assert got == pytest.approx(2 * 512 * 576 * 1536 * 4 / 0.4 / 1e9, rel=1e-12)
    assert torch.get_num_threads() == threads
