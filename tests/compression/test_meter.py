"""Tests for megatron_cegrpo.compression.meter.ByteMeter."""

from pathlib import Path

import pytest
import torch

_REPO = Path(__file__).resolve().parents[2]

from megatron_cegrpo.compression import BoundaryContext, ByteMeter, build_codec


def _run_codec(meter, codec, shape, boundary, dtype=torch.bfloat16, step=0):
    s, b, d = shape
    ctx = BoundaryContext(seed=5, boundary=boundary, step=step, sample_ids=torch.arange(b))
    x = torch.randn(shape, dtype=dtype)
    with torch.no_grad():
        p = codec.encode_forward(x, ctx)
    meter.add("fwd", boundary, p, s * b * d)
    g = torch.randn(shape, dtype=dtype)
    pg = codec.encode_backward(g, ctx)
    meter.add("bwd", boundary, pg, s * b * d)
    return p, pg


def test_mask_ratio_exact_at_576():
    m = ByteMeter()
    codec = build_codec("mask", 0.05)
    for boundary in (0, 1, 2):
        for step in range(2):
            _run_codec(m, codec, (8, 2, 576), boundary, step=step)
    snap = m.snapshot_and_reset()
    assert snap["comm/bytes_ratio"] == 29 / 576
    per_dir = 3 * 2 * 8 * 2 * 29 * 2  # boundaries * steps * s * b * k * bf16 bytes
    assert snap["comm/fwd_bytes"] == per_dir
    assert snap["comm/bwd_bytes"] == per_dir
    assert snap["comm/dense_equiv_bytes"] == 2 * 3 * 2 * 8 * 2 * 576 * 2
    for i in (0, 1, 2):
        assert snap[f"comm/boundary_{i}/fwd_bytes"] == per_dir // 3
        assert snap[f"comm/boundary_{i}/bwd_bytes"] == per_dir // 3
    assert snap["comm/total_wire_bytes"] == 2 * per_dir


def test_dense_ratio_one_and_fp32_bytes():
    m = ByteMeter()
    _run_codec(m, build_codec("dense"), (4, 3, 10), 1, dtype=torch.float32)
    snap = m.snapshot_and_reset()
    assert snap["comm/bytes_ratio"] == 1.0
    assert snap["comm/fwd_bytes"] == 4 * 3 * 10 * 4
    assert snap["comm/dense_equiv_bytes"] == 2 * 4 * 3 * 10 * 4
    assert "comm/boundary_0/fwd_bytes" not in snap
    assert snap["comm/boundary_1/bwd_bytes"] == 4 * 3 * 10 * 4


def test_reset_and_no_traffic():
    m = ByteMeter()
    empty = m.snapshot_and_reset()
    assert empty["comm/bytes_ratio"] == 0.0
    assert empty["comm/fwd_bytes"] == 0 and empty["comm/bwd_bytes"] == 0 and empty["comm/dense_equiv_bytes"] == 0
    assert m.add("fwd", 0, torch.zeros(10, dtype=torch.float16), 40) == 20
    first = m.snapshot_and_reset()
    assert first["comm/fwd_bytes"] == 20 and first["comm/bytes_ratio"] == 0.25
    second = m.snapshot_and_reset()
    assert second["comm/fwd_bytes"] == 0 and "comm/boundary_0/fwd_bytes" not in second
    assert second["comm/total_wire_bytes"] == 20  # cumulative survives the interval reset


def test_state_dict_roundtrip():
    m = ByteMeter()
    m.add("bwd", 3, torch.zeros(7, dtype=torch.float32), 70)
    state = m.state_dict()
    assert state["comm/total_wire_bytes"] == 28
    assert state["comm/total_dense_equiv_bytes"] == 280  # 70 fp32 elements
    m2 = ByteMeter()
    m2.load_state_dict(state)
    m2.add("fwd", 0, torch.zeros(2, dtype=torch.float32), 20)
    assert m2.state_dict()["comm/total_wire_bytes"] == 36
    snap = m2.snapshot_and_reset()
    assert snap["comm/total_wire_bytes"] == 36 and snap["comm/total_dense_equiv_bytes"] == 360
    with pytest.raises(ValueError, match="total_wire_bytes"):
        m2.load_state_dict({})


def test_add_validation():
    m = ByteMeter()
    with pytest.raises(ValueError, match="direction"):
        m.add("up", 0, torch.zeros(1), 1)
    with pytest.raises(ValueError, match="boundary"):
        m.add("fwd", -1, torch.zeros(1), 1)
    with pytest.raises(ValueError, match="dense_numel"):
        m.add("fwd", 0, torch.zeros(1), -1)
