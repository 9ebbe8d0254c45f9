"""The CPU compat layer: what it patches, that megatron's CUDA-isms now run on CPU, RNG."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_cegrpo.compat import cpu as compat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")

EXPECTED_PATCHES = [
    "torch.cuda.current_device",
    "torch.cuda.synchronize",
    "torch.zeros",
    "torch.ones",
    "torch.tensor",
    "torch.Tensor.cuda",
    "torch.cuda.manual_seed",
    "torch.cuda.get_rng_state",
    "megatron.core.tensor_parallel.random._get_cuda_rng_state",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state",
]


def _run_python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:]
    return p.stdout


def test_apply_is_idempotent_and_patch_list_is_explicit():
    assert compat.apply_cpu_compat() is True
    n = len(compat.PATCHED)
    assert compat.apply_cpu_compat() is True
    assert compat.is_active()
    assert compat.PATCHED == EXPECTED_PATCHES
    assert len(compat.PATCHED) == n


def test_current_device_and_cuda_factories_give_cpu_tensors():
    compat.apply_cpu_compat()
    dev = torch.cuda.current_device()
    assert torch.device(dev).type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    for d in ("cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0):
        z = torch.zeros(2, 3, dtype=torch.int, device=d)
        o = torch.ones(2, device=d)
        t = torch.tensor([1.5, 2.5], dtype=torch.float, device=d)
        assert (z.device.type, o.device.type, t.device.type) == ("cpu", "cpu", "cpu")
        assert z.shape == (2, 3) and z.dtype == torch.int and int(z.sum()) == 0
        assert float(o.sum()) == 2.0 and t.tolist() == [1.5, 2.5]
    # calls without a device, or with a CPU device, are untouched
    assert torch.zeros(2).device.type == "cpu" and torch.tensor(3).item() == 3
    assert torch.ones(1, device="cpu").device.type == "cpu"
    x = torch.arange(4.0)
    assert x.cuda() is x and x.cuda(non_blocking=True) is x
    assert torch.cuda.synchronize() is None
    # the megatron call sites that motivated the patches
    from megatron.core.transformer.utils import get_default_causal_mask

    m = get_default_causal_mask(4)
    assert m.device.type == "cpu" and m.dtype == torch.bool
    assert torch.equal(m, torch.triu(torch.ones(4, 4, device="cpu"), diagonal=1).bool())


def _scripted_factories(x: torch.Tensor) -> torch.Tensor:
    return x + torch.zeros(3) + torch.ones(3) + torch.tensor([1.0, 2.0, 3.0])


def test_torchscript_still_compiles_patched_factories():
    compat.apply_cpu_compat()
    f = torch.jit.script(_scripted_factories)
    assert f(torch.ones(3)).tolist() == [3.0, 4.0, 5.0]


def test_rng_tracker_seed_and_fork_are_deterministic(megatron_single_process):
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    def draws():
        model_parallel_cuda_manual_seed(123)
        with get_cuda_rng_tracker().fork():
            a = torch.randn(6)
        with get_cuda_rng_tracker().fork():
            b = torch.randn(6)
        c = torch.randn(6)  # default (data-parallel) stream
        return a, b, c

    a1, b1, c1 = draws()
    a2, b2, c2 = draws()
    assert torch.equal(a1, a2) and torch.equal(b1, b2) and torch.equal(c1, c2)
    assert not torch.equal(a1, b1)  # the forked stream advances
    assert not torch.equal(a1, c1)  # and differs from the default stream
    # the default stream is seeded with the data-parallel seed and forks do not consume it
    torch.manual_seed(123)
    assert torch.equal(c1, torch.randn(6))
    # the model-parallel stream is seeded with seed + 2718 (+ tp_rank 0)
    g = torch.Generator().manual_seed(123 + 2718)
    assert torch.equal(a1, torch.randn(6, generator=g))
    assert torch.equal(b1, torch.randn(6, generator=g))


def test_inactive_when_cuda_reported_available():
    out = _run_python(
        """
        import torch
        orig = (torch.cuda.current_device, torch.zeros, torch.Tensor.cuda, torch.cuda.manual_seed)
        torch.cuda.is_available = lambda: True
        from megatron_cegrpo.compat import apply_cpu_compat, is_active
        from megatron_cegrpo.compat import cpu
        assert apply_cpu_compat() is False
        assert apply_cpu_compat() is False
        assert not is_active() and cpu.PATCHED == []
        assert orig == (torch.cuda.current_device, torch.zeros, torch.Tensor.cuda,
                        torch.cuda.manual_seed)
        # nothing was redirected: the real CUDA calls still fail on this CPU-only build
        for fn in (torch.cuda.current_device, lambda: torch.zeros(1, device="cuda")):
            try:
                fn()
            except (AssertionError, RuntimeError):
                pass
            else:
                raise SystemExit("expected a CUDA error")
        print("INACTIVE-OK")
        """
    )
    assert "INACTIVE-OK" in out


def test_from_pretrained_is_exact_in_a_process_that_installed_the_layer_first(tmp_path):
    """torch caches the factories a ``with torch.device(...)`` context redirects on first use: the layer
    must not leave its wrappers in that cache (from_pretrained's rotary ``inv_freq`` was garbage, and
    tests/checkpointing/test_ckpt_convert.py failed after any test that had run ``train.main`` in
    process). Here the layer is the process's first act, then a saved tiny-llama loads: every buffer bit
    for bit, the logits to attention-kernel rounding."""
    out = _run_python(f"""
        from megatron_cegrpo.compat import apply_cpu_compat
        assert apply_cpu_compat()
        import torch
        from transformers import AutoModelForCausalLM
        from megatron_cegrpo.models import build_hf_model, load_hf_state_dict, resolve_model
        cfg, sd = load_hf_state_dict(resolve_model("tiny-llama"))
        built = build_hf_model(cfg, sd)
        built.save_pretrained({str(tmp_path)!r})
        loaded = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        want, got = dict(built.named_buffers()), dict(loaded.named_buffers())
        assert want.keys() == got.keys() and any("inv_freq" in k for k in want)
        for k in want:
            assert torch.equal(want[k], got[k]), (k, want[k][:4], got[k][:4])
        ids = torch.tensor([[1, 5, 9, 2]])
        # eager (built) against sdpa (loaded) attention: 3e-7 apart; the garbage inv_freq gave ~1e-2
        torch.testing.assert_close(loaded(ids).logits, built(ids).logits, rtol=0, atol=1e-5)
        print("exact")
    """)
    assert out.strip().endswith("exact"), out[-2000:]
