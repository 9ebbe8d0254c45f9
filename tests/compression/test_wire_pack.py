"""The word packers (wire.pack_values / unpack_values) write the bit-table packers' bytes exactly.

Reference: pack_stream(cat(bit_stream(q_i, w_i))), the format documented in quant.py (widths
ascending, each value little-endian); every width 1..24 (the word path and the bit-table path),
counts that leave the groups unaligned to bytes, and a decode of each.
"""

import pytest
import torch

from megatron_cegrpo.compression.quant import dequantize_columns, quantize_columns
from megatron_cegrpo.compression.wire import (ByteReader, bit_stream, pack_stream, pack_values, stream_values,
                                              unpack_stream, unpack_values)


def _reference(groups):
    streams = [bit_stream(q, w) for q, w in groups]
    return pack_stream(torch.cat(streams)) if streams else torch.zeros(0, dtype=torch.uint8)


@pytest.mark.parametrize("width", list(range(1, 25)))
def test_one_width_matches_bit_table(width):
    g = torch.Generator().manual_seed(width)
    for n in (0, 1, 7, 8, 9, 61, 1024):
        q = torch.randint(0, 1 << width, (n,), generator=g)
        got = pack_values([(q, width)])
        assert torch.equal(got, _reference([(q, width)])), (width, n)
        assert torch.equal(unpack_values(got, [(n, width)])[0], q)


def test_mixed_widths_unaligned_match_bit_table():
    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        groups = []
        for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
            w = int(torch.randint(1, 17, (1,), generator=g))
            n = int(torch.randint(0, 50, (1,), generator=g))
            groups.append((torch.randint(0, 1 << w, (n,), generator=g), w))
        got = pack_values(groups)
        assert torch.equal(got, _reference(groups)), trial
        back = unpack_values(got, [(q.numel(), w) for q, w in groups])
        for (q, _), v in zip(groups, back):
            assert torch.equal(v, q)
        # and the bit-table reader reads the same values
        stream = unpack_stream(got, sum(q.numel() * w for q, w in groups))
        pos = 0
        for q, w in groups:
            assert torch.equal(stream_values(stream[pos:pos + q.numel() * w], w), q)
            pos += q.numel() * w


def test_2d_values_row_major():
    q = torch.arange(12).view(3, 4) % 8
    assert torch.equal(pack_values([(q.t(), 3)]), _reference([(q.t().contiguous(), 3)]))


def test_unpack_short_data_names_bits():
    with pytest.raises(ValueError, match="need 24 bits, got 16"):
        unpack_values(torch.zeros(2, dtype=torch.uint8), [(3, 8)])


def test_quantize_columns_hat_equals_decode_for_any_column_order():
    g = torch.Generator().manual_seed(3)
    c = torch.randn(37, 9, generator=g)
    for bits in ([8, 8, 7, 7, 7, 3, 0, 0, 0], [3, 0, 8, 7, 0, 7, 8, 1, 2]):  # contiguous runs, scattered
        payload, hat = quantize_columns(c, bits)
        out = dequantize_columns(ByteReader(payload), 37, bits)
        assert torch.equal(out, hat)
        assert quantize_columns(c, bits, return_hat=False)[1] is None
        assert torch.equal(quantize_columns(c, bits, return_hat=False)[0], payload)
        err = (out - c).abs().max(dim=0).values
        for j, b in enumerate(bits):  # error <= step / 2 = a / 2**b; unsent columns decode to 0
            a = c[:, j].abs().max()
            assert float(err[j]) <= (float(a) / 2 ** b + 1e-6 if b else float(a) + 1e-6)


def test_allocate_bits_equals_the_greedy():
    from megatron_cegrpo.compression.quant import _allocate_bits_greedy, allocate_bits
    g = torch.Generator().manual_seed(11)
    cases = [([1.0, 1.0, 1.0], 5, 8), ([0.0, 0.0, 2.0], 20, 8), ([4.0, 1.0], 3, 8), ([], 10, 8), ([3.0], 0, 8)]
    for _ in range(60):
        r = int(torch.randint(1, 150, (1,), generator=g))
        lam = (torch.rand(r, generator=g) ** 4 * 100).tolist()
        if _ % 3 == 0:  # ties and zero variances, as a rank-deficient basis gives
            lam = [round(v) / 4 for v in lam] + [0.0] * 3
        cases.append((lam, int(torch.randint(0, 9 * len(lam), (1,), generator=g)), int(torch.randint(1, 17, (1,), generator=g))))
    for lam, total, mb in cases:
        assert allocate_bits(lam, total, mb) == _allocate_bits_greedy(lam, total, mb), (lam, total, mb)
