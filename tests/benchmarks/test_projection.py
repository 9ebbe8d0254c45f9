"""The whole-step projection (issue 12 item 5): bytes by hand formula, totals = sums, the 5x goal."""

import math

from benchmarks.projection import main, model_params

D, V, L, FFN, S = 1536, 151936, 28, 8960, 8


def test_whole_step_bytes_and_goal(capsys):
    out = main([])
    ws = out["whole_step"]
    layer = 2 * D * 12 * 128 + 2 * D * 2 * 128 + 3 * D * FFN
    n = model_params(type("A", (), dict(layers=L, d=D, ffn=FFN, heads=12, kv_heads=2, vocab=V, tied=True,
                                        stages=S))())
    assert n["layers"] == L * layer and n["embd"] == V * D and n["shipped"] == L * layer + 2 * V * D
    k = math.ceil(0.05 * D)
    tokens = 4 * 256 * 32
    for state, width in (("dense", D), ("today", k), ("after", k)):
        b = ws[state]["bytes"]
        assert b["boundaries"] == 3 * (S - 1) * tokens * width * 2  # fwd-only + fwd + bwd, bf16
        assert b["batch"] == 40 * tokens * (S - 1)
        assert b["total"] == sum(v for p, v in b.items() if p != "total")
    dense, today, after = ws["dense"]["bytes"], ws["today"]["bytes"], ws["after"]["bytes"]
    assert dense["embd_sync"] == today["embd_sync"] == 2 * V * D * 4
    assert after["embd_sync"] == 0.05 * 2 * V * D * 4
    assert dense["sampler_sync"] == 4 * (L * layer * (S - 1) // S + V * D)
    assert after["sampler_sync"] == 0.022 * 2 * (L * layer * (S - 1) // S + V * D)
    signs = (n["shipped"] + 7) // 8
    assert dense["anchor"] == (4 * n["shipped"] + signs) / 20
    # int4 deltas (anchor/shipment.py): per stage an fp32 scale a block of 256 and half a byte a value
    per, rest = divmod(L * layer + V * D, S)
    int4 = sum(-(-(per + (i < rest)) // 256) * (4 + 128) for i in range(S))
    assert after["anchor"] == (int4 + signs) / 20
    assert out["whole_step_by_c"][4]["after"]["bytes"]["anchor"] == (int4 + signs) / 4  # the demo's c
    # the goal: the compressed whole step >= 5x faster than dense-everything over the same links
    for sched in ("synchronous", "overlapped"):
        assert ws["dense"]["time"][sched]["step_s"] >= 5 * ws["after"]["time"][sched]["step_s"]
    assert "whole step at 200 Mbit/s + 50 ms" in capsys.readouterr().out
