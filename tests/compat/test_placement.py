"""compat/placement.py on a CPU host: the backend string, the batch a stage trains on, and tensors
meeting a parameter (the CUDA side: tests/gpu/test_cuda_paths.py)."""

import torch

from megatron_cegrpo.compat import placement
from megatron_cegrpo.optim.hooks import SignCorrectionHook


def test_backend_routes_cpu_tensors_through_gloo_on_gpu_hosts(monkeypatch):
    assert placement.process_group_backend() == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    monkeypatch.setattr(placement, "cuda_available", lambda: True)
    assert placement.process_group_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(placement, "cuda_available", lambda: False)
    assert placement.process_group_backend() == "gloo"
    assert placement.compute_device() == torch.device("cpu")


def test_place_batch_moves_tensors_and_keeps_everything_else():
    tokens = torch.arange(6).view(2, 3)
    adv = torch.randn(2, 3)
    batch = {"tokens": tokens, "advantages": adv, "note": "x", "n": 2}
    placed = placement.place_batch(batch, torch.device("cpu"))
    assert placed is not batch and set(placed) == set(batch)
    assert placed["tokens"] is tokens and placed["advantages"] is adv  # already there: no copy
    assert placed["note"] == "x" and placed["n"] == 2
    assert placement.place_batch(None) is None
    half = placement.place_batch({"x": torch.ones(2, dtype=torch.bfloat16)})["x"]
    assert half.dtype == torch.bfloat16  # dtypes are kept


def test_like_takes_the_reference_device_and_dtype():
    s = torch.tensor([1.0, -1.0])
    ref = torch.zeros(2, dtype=torch.bfloat16)
    got = placement.like(s, ref)
    assert got.dtype == torch.bfloat16 and got.tolist() == [1.0, -1.0]  # the values, converted
    wide = placement.like(torch.tensor([1, -1, 1], dtype=torch.int8), torch.zeros(3))  # an int8 sign tensor
    assert wide.dtype == torch.float32 and wide.tolist() == [1.0, -1.0, 1.0]
    assert placement.like(s, ref, dtype=torch.float32) is s  # nothing to change: the tensor itself


def test_signs_are_stored_on_their_parameters_device_and_keep_their_dtype():
    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    hook = SignCorrectionHook(ps)
    signs = [torch.tensor([1, -1, 1], dtype=torch.int8), None]
    hook.set_signs(signs)
    assert hook.signs[1] is None
    assert hook.signs[0].dtype == torch.int8 and hook.signs[0].device == ps[0].device
    assert torch.equal(hook.signs[0], signs[0])
