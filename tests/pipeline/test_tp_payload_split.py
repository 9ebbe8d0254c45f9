"""The TP boundary split's padding path (``pipeline/communicator.py``: ``tp_payload_piece`` /
``tp_payload_whole``): a payload whose element count the TP size does not divide is zero-padded
to a multiple of T, each TP rank sends one equal piece, and the receivers' all-gather of the
pieces, cut to the payload's size, is the payload bit for bit. No process group: the all-gather
of megatron-core's ``gather_split_1d_tensor`` is the concatenation in TP rank order."""

import pytest
import torch

from megatron_cegrpo.pipeline.communicator import tp_payload_piece, tp_payload_whole


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("shape", [(7, 3, 5), (9, 1, 29), (5,), (1, 1, 1), (16, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pieces_pad_split_and_rejoin_bit_for_bit(tp, shape, dtype):
    g = torch.Generator().manual_seed(hash((tp, shape)) % 2**31)
    payload = (torch.randn(shape, generator=g) * 50).to(dtype)
    n = payload.numel()
    pieces = [tp_payload_piece(payload, tp, r) for r in range(tp)]
    size = -(-n // tp)  # ceil(n / T): every piece the same size
    assert all(p.shape == (size,) and p.dtype == dtype for p in pieces)
    joined = torch.cat(pieces)  # what gather_split_1d_tensor returns on every receiving TP rank
    pad = size * tp - n
    assert pad == -n % tp and pad < tp
    assert torch.equal(joined[n:], torch.zeros(pad, dtype=dtype))  # the padding is zeros, at the end
    whole = tp_payload_whole(joined, shape)
    assert whole.shape == payload.shape and torch.equal(whole, payload)


def test_a_divisible_payload_has_no_padding_and_pieces_are_copies():
    payload = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    pieces = [tp_payload_piece(payload, 2, r) for r in range(2)]
    assert [p.tolist() for p in pieces] == [list(map(float, range(6))), list(map(float, range(6, 12)))]
    pieces[0].zero_()  # a piece is sent asynchronously: it must not alias the payload
    assert torch.equal(payload, torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_bytes_split_the_tp1_payload_plus_at_most_t_minus_1_elements():
    payload = torch.ones(7, 3, 5)  # 105 elements, T = 4: pieces of 27, 3 padding zeros
    pieces = [tp_payload_piece(payload, 4, r) for r in range(4)]
    assert sum(p.numel() for p in pieces) == 108 and sum(float(p.sum()) for p in pieces) == 105.0


def test_errors():
    with pytest.raises(ValueError, match="out of range"):
        tp_payload_piece(torch.ones(3), 2, 2)
    with pytest.raises(ValueError, match="fewer than"):
        tp_payload_whole(torch.ones(3), (2, 2))
