"""Smoke test of benchmarks/bench_codec on a tiny shape: byte counts only, no timing assertions."""

import json
import os
from fractions import Fraction

import torch

from benchmarks.bench_codec import boundary_tensors
from benchmarks.reference_codecs import Int8Reference, TopKReference, wire_bytes
from distributed_util import REPO, run_single
from megatron_cegrpo.compression import available_codecs, build_codec, keep_count

S, B, DIMS = 8, 2, (64, 100)


def test_bench_codec_bytes_match_encodings(tmp_path):
    out = tmp_path / "codec.json"
    run_single(["-m", "benchmarks.bench_codec", "--dims", ",".join(map(str, DIMS)), "--time-dims", "64",
                "--seq-len", str(S), "--micro-batch", str(B), "--min-time", "0.01", "--out", str(out)],
               timeout=120)
    res = json.loads(out.read_text())
    assert {r["d"] for r in res["time"]} == {64}  # the timing path ran (values not checked)
    # every registered codec has a row in both tables (measured, or n/a with the reason)
    for table in ("bytes", "time"):
        assert set(available_codecs()) <= {r["codec"] for r in res[table]}
    timed = {r["codec"]: r for r in res["time"]}
    # the mask's PRF is precomputed (off the critical path); dense and the references have none
    assert timed["mask"]["has_precompute"] and timed["mask"]["precompute_ms"] > 0
    assert not timed["dense"]["has_precompute"] and timed["dense"]["precompute_ms"] == 0.0
    for r in timed.values():
        if "note" not in r:
            _check_time_row(r)
    # the default codec list also has the pair specs (too small a shape here for the subspace ones: n/a rows)
    assert {"dense:mask", "pcaq:lrq", "rpq:lrq", "rpq/passes=2:lrq"} <= {r["codec"] for r in res["time"]}
    assert timed["dense:mask"]["has_precompute"] and "note" in timed["rpq:lrq"]
    for d in DIMS:
        rows = {r["codec"]: r for r in res["bytes"] if r["d"] == d}
        k = keep_count(d, 0.05)
        dense, mask = rows["dense"], rows["mask"]
        assert mask["k"] == k
        # mask / dense is exactly k / d, measured from the payloads
        assert Fraction(mask["fwd_bytes"], dense["fwd_bytes"]) == Fraction(k, d)
        assert Fraction(mask["bwd_bytes"], dense["bwd_bytes"]) == Fraction(k, d)
        assert mask["ratio_vs_dense"] == k / d
        # lowrank: r coefficients a token each way (the per-iteration basis is not in a micro-batch's bytes)
        r = build_codec("lowrank", 0.05).fwd.rank(d)
        assert rows["lowrank"]["fwd_bytes"] == rows["lowrank"]["bwd_bytes"] == S * B * r * 2

        # reference encodings: the reported bytes are what the encoders produce
        x, g = boundary_tensors(S, B, d, torch.bfloat16)
        for name, idx_dtype, idx_size in (("topk-i32", torch.int32, 4), ("topk-i16", torch.int16, 2)):
            ref = TopKReference(k, idx_dtype)
            fp = ref.encode_forward(x)
            bp = ref.encode_backward(g, fp)
            assert rows[name]["fwd_bytes"] == wire_bytes(fp) == S * B * k * (2 + idx_size)
            assert rows[name]["bwd_bytes"] == wire_bytes(bp) == S * B * k * 2
            assert fp[1].dtype == idx_dtype
        q = Int8Reference()
        fp, bp = q.encode_forward(x), q.encode_backward(g)
        assert fp[0].dtype == torch.int8
        assert rows["int8"]["fwd_bytes"] == wire_bytes(fp) == S * B * (d + 2)
        assert rows["int8"]["bwd_bytes"] == wire_bytes(bp) == S * B * (d + 2)
        assert dense["fwd_bytes"] == S * B * d * 2


def _check_time_row(r):
    layer = r["layer_fwd_bwd_ms"]
    fwd, bwd = r["encode_fwd_ms"] + r["decode_fwd_ms"], r["encode_bwd_ms"] + r["decode_bwd_ms"]
    rep = r["repeat_encode_fwd_ms"] + r["repeat_decode_fwd_ms"]
    assert r["critical_ms"] == fwd + bwd and r["share_of_layer_fwd_bwd"] == r["critical_ms"] / layer
    assert r["repeat_critical_ms"] == rep + bwd and r["repeat_share"] == r["repeat_critical_ms"] / layer
    assert r["iteration_critical_ms"] == fwd + (r["passes"] - 1) * rep + bwd
    assert r["iteration_share"] == r["iteration_critical_ms"] / layer
    assert r["share_without_prefetch"] == (r["critical_ms"] + 2 * r["precompute_ms"]) / layer


def test_bench_codec_pair_specs(tmp_path):
    """--codecs with pair specs (built by build_codec, small ranks so that d = 64 leaves coefficient bits)."""
    out = tmp_path / "pairs.json"
    specs = ["mask", "dense:mask", "pcaq/rank=8:lrq", "rpq/rank=8:lrq", "rpq/rank=8/passes=2:lrq"]
    run_single(["-m", "benchmarks.bench_codec", "--dims", "64", "--seq-len", "32", "--micro-batch", str(B),
                "--min-time", "0.01", "--wire-dtype", "fp32", "--codecs", ",".join(specs), "--no-references",
                "--out", str(out)], timeout=120)
    res = json.loads(out.read_text())
    timed = {r["codec"]: r for r in res["time"]}
    assert list(timed) == specs  # exactly the specs asked for, no references
    for r in timed.values():
        assert "note" not in r, r
        _check_time_row(r)
    assert timed["rpq/rank=8:lrq"]["passes"] == 3 and timed["rpq/rank=8/passes=2:lrq"]["passes"] == 2
    assert timed["pcaq/rank=8:lrq"]["passes"] == 3  # --passes default
    assert timed["dense:mask"]["has_precompute"] and not timed["rpq/rank=8:lrq"]["has_precompute"]
    rows = {r["codec"]: r for r in res["bytes"]}
    assert set(specs) <= set(rows) and {"topk-i32", "int8"} <= set(rows)  # bytes keep the references
    tok_dense = 64 * 4  # fp32
    # dense:mask: the dense forward and the mask backward, measured from the payloads
    assert rows["dense:mask"]["fwd_bytes_per_token"] == tok_dense
    assert rows["dense:mask"]["bwd_bytes_per_token"] == rows["mask"]["bwd_bytes_per_token"]
    # rpq: the first crossing carries the budget of all passes, a later one (the coded delta) far less
    for spec in ("rpq/rank=8:lrq", "rpq/rank=8/passes=2:lrq"):
        assert rows[spec]["fwd_bytes_repeat"] < rows[spec]["fwd_bytes"] / 10
        assert rows[spec]["iter_ratio_vs_dense"] <= 0.05


def test_reference_codecs_roundtrip():
    x, _ = boundary_tensors(4, 2, 64, torch.float32)
    ref = TopKReference(8, torch.int16)
    y = ref.decode_forward(ref.encode_forward(x), x.shape)
    kept = y != 0
    assert int(kept.sum(-1).max()) == 8 and torch.equal(y[kept], x[kept])
    q = Int8Reference()
    err = (q.decode_forward(q.encode_forward(x), x.shape) - x).abs()
    assert bool((err <= x.abs().amax(-1, keepdim=True) / 127).all())
    assert os.path.isdir(os.path.join(REPO, "benchmarks"))


def test_bench_gen_rounds_times_each_round_size(tmp_path):
    """benchmarks/bench_gen_rounds on SmolLM2 at 2 new tokens: one row a round size, its sequences
    (8 samples a prompt), its ratio to the first size's fastest call, the tokens each call made."""
    out = tmp_path / "rounds.json"
    run_single(["-m", "benchmarks.bench_gen_rounds", "--rounds", "1,2", "--repeats", "1", "--max-new-tokens", "2",
                "--threads", "1", "--out", str(out)], timeout=300)
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [(r["prompts"], r["sequences"], r["size_ratio"]) for r in rows] == [(1, 8, 1.0), (2, 16, 2.0)]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] == rows[1]["fastest_s"] / rows[0]["fastest_s"]
    for r in rows:
        assert len(r["times_s"]) == 1 and r["fastest_s"] == min(r["times_s"]) > 0
        assert r["sequences"] <= r["tokens"][0] <= 2 * r["sequences"]  # 1 or 2 tokens an answer
    assert res["max_new_tokens"] == 2 and res["threads"] == 1
