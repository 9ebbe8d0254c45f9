"""1-bit sign packing: layout, round trips, 0 -> +1."""

import math

import pytest
import torch

from megatron_cegrpo.anchor import pack_sign_list, pack_signs, packed_nbytes, unpack_sign_list, unpack_signs


def _ref_signs(t):
    return torch.where(t >= 0, 1.0, -1.0)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000003])
def test_round_trip_sizes_not_multiple_of_8(n):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g)
    t[:: max(1, n // 5)] = 0.0  # exact zeros map to +1
    packed, numel = pack_signs(t)
    assert numel == n
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == math.ceil(n / 8) == packed_nbytes(n)
    out = unpack_signs(packed, numel, (n,))
    assert out.dtype == torch.float32
    assert torch.equal(out, _ref_signs(t))
    # the last byte's unused high bits are zero
    if n % 8:
        assert int(packed[-1]) >> (n % 8) == 0


def test_bit_layout_little_endian_and_zero_is_plus_one():
    # elements 0..7 -> bits 0..7 of byte 0; element 8 -> bit 0 of byte 1
    t = torch.tensor([1.0, -1.0, 0.0, -0.0, -2.0, -3.0, -4.0, 5.0, -1.0, 0.0])
    packed, numel = pack_signs(t)
    assert packed.tolist() == [0b10001101, 0b10]
    assert unpack_signs(packed, numel, (2, 5)).tolist() == [[1, -1, 1, 1, -1], [-1, -1, 1, -1, 1]]
    assert unpack_signs(*pack_signs(torch.zeros(3, 3)), (3, 3)).eq(1).all()
    assert unpack_signs(packed, numel, (10,), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_shapes_and_errors():
    t = torch.randn(3, 4, 5)
    packed, n = pack_signs(t)
    assert torch.equal(unpack_signs(packed, n, t.shape), _ref_signs(t))
    with pytest.raises(ValueError, match=r"shape \(61,\) does not hold 60 elements"):
        unpack_signs(packed, n, (61,))
    with pytest.raises(ValueError, match="60 signs need 8 bytes, got 7"):
        unpack_signs(packed[:-1], n, t.shape)
    with pytest.raises(ValueError, match="packed signs must be a 1-D uint8 tensor, got torch.int32"):
        unpack_signs(packed.to(torch.int32), n, t.shape)
    assert packed_nbytes(0) == 0 and packed_nbytes(8) == 1 and packed_nbytes(9) == 2
    with pytest.raises(ValueError, match="numel must be an int >= 0, got -1"):
        packed_nbytes(-1)
    empty, n0 = pack_signs(torch.zeros(0))
    assert empty.numel() == 0 and n0 == 0


def test_list_round_trip_several_shapes():
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (5, 7), (1,), (2, 3, 4), (13,)]
    tensors = [torch.randn(s, generator=g) for s in shapes]
    tensors[1][2, 3] = 0.0
    tensors.append(torch.randn(4, generator=g).to(torch.bfloat16))
    shapes.append((4,))
    packed, sizes = pack_sign_list(tensors)
    assert sizes == [3, 35, 1, 24, 13, 4]
    assert packed.numel() == math.ceil(sum(sizes) / 8) == 10  # one flat buffer, no per-tensor padding
    out = unpack_sign_list(packed, shapes)
    assert len(out) == len(tensors)
    for o, t, s in zip(out, tensors, shapes):
        assert o.shape == s and torch.equal(o, _ref_signs(t.float()))
    assert out[1][2, 3] == 1.0
    # same bits as packing the concatenation
    assert torch.equal(packed, pack_signs(torch.cat([t.float().reshape(-1) for t in tensors]))[0])
    with pytest.raises(ValueError, match="63 signs need 8 bytes, got 10"):
        unpack_sign_list(packed, shapes[:-2])
