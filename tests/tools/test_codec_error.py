"""tools/codec_error.py: per-token reconstruction error of a codec's forward half (exact values on
synthetic states)."""

import pytest
import torch

from distributed_util import load_tool


def _states():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(64, 64, generator=g)).Q[:6]
    x = (torch.randn(20, 8, 6, generator=g) * torch.tensor([8.0, 4, 2, 1, 0.5, 0.25])) @ basis
    x[0] = 100.0 * basis[0]  # a sink-like position 0
    return x


def test_dense_is_exact_and_bytes_are_the_payload():
    mod = load_tool("codec_error")
    x = _states()
    r = mod.token_errors(x, ["dense"], micro_batch=4)
    assert r["dense"]["err"] == 0.0 and r["dense"]["bytes"] == 20 * 4 * 64 * 4


def test_the_error_is_the_mean_per_token_ratio_without_position_0():
    """The mask keeps k = ceil(0.25 * 64) = 16 of 64 coordinates scaled by d/k: its error is computed
    by hand from the decoded tensor; a rank-6 pcaq on rank-6 data is far closer; bf16 halves the bytes."""
    from megatron_cegrpo.compression import BoundaryContext, build_codec

    mod = load_tool("codec_error")
    x = _states()
    r = mod.token_errors(x, ["mask", "pcaq/rank=6/outliers=0:lrq/rank=4"], keep_ratio=0.25, micro_batch=4)
    want = []
    for lo in (0, 4):
        codec = build_codec("mask", 0.25)
        t = x[:, lo:lo + 4].contiguous()
        ctx = BoundaryContext(seed=1, boundary=0, step=0, sample_ids=torch.arange(lo, lo + 4))
        y = codec.decode_forward(codec.encode_forward(t, ctx), ctx, tuple(t.shape))
        want.append(((y[1:] - t[1:]).norm(dim=-1) / t[1:].norm(dim=-1)).reshape(-1))
    assert r["mask"]["err"] == pytest.approx(torch.cat(want).mean().item(), rel=1e-6)
    assert r["pcaq/rank=6/outliers=0:lrq/rank=4"]["err"] < 0.1 * r["mask"]["err"]
    half = mod.token_errors(x.to(torch.bfloat16), ["mask"], keep_ratio=0.25, micro_batch=4)
    assert half["mask"]["bytes"] == r["mask"]["bytes"] / 2
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        mod.token_errors(x, ["mask"], micro_batch=0)
    # padding left out: the mean over the tokens marked valid only
    valid = torch.zeros(20, 8, dtype=torch.bool)
    valid[:11, :4] = True
    v = mod.token_errors(x, ["mask"], keep_ratio=0.25, micro_batch=4, valid=valid)
    assert v["mask"]["err"] == pytest.approx(want[0].reshape(19, 4)[:10].mean().item(), rel=1e-6)
    with pytest.raises(ValueError, match="valid has shape"):
        mod.token_errors(x, ["mask"], valid=valid[:, :3])


def test_a_bad_row_in_data_is_one_line_naming_the_line_and_field(tmp_path, capsys):
    """--data is read through the project's loader before the model loads: a row without its
    answer exits 2 with the loader's one line (file, line, field, fix) and nothing is measured."""
    import json

    mod = load_tool("codec_error")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": "How many?", "target": 3}) + "\n" + json.dumps({"input": "x"}) + "\n")
    assert mod.main(["--data", str(bad), "--prompts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --data {bad}, line 2: field 'target' is missing; fix: add the numeric answer as 'target'"
    assert mod.main(["--data", str(tmp_path / "none.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
