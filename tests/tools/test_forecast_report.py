"""tools/forecast_report.py and training/weight_trace.py: the sampled trajectory round-trips, and the
report scores the anchor's own secant forecast on it at the fires and checkpoints the anchor uses
(closed form on a synthetic quadratic trajectory)."""

import json

import numpy as np
import pytest
import torch

from megatron_cegrpo.training.weight_trace import WeightTrace, read_trace
from distributed_util import load_tool


def _tool():
    return load_tool("forecast_report")


def test_weight_trace_records_the_sampled_coordinates_and_the_last_record_wins(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    named = list(model.named_parameters())
    trace = WeightTrace(named, 20, str(tmp_path / "wt"), "stage0_tp0", seed=3)
    meta = json.loads((tmp_path / "wt" / "stage0_tp0.json").read_text())
    assert meta["coordinates"] == 20 and meta["parameters"] == 7 * 5 + 5 + 5 * 3 + 3
    assert sum(p["count"] for p in meta["sampled"]) == 20
    # the same seed picks the same coordinates (a resumed run appends the same columns)
    again = WeightTrace(named, 20, str(tmp_path / "wt2"), "stage0_tp0", seed=3)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(trace.index, again.index))
    flat = torch.cat([p.detach().reshape(-1) for _, p in named])
    bounds = np.cumsum([0] + [p.numel() for _, p in named])
    expect = torch.cat([flat[int(bounds[i]) + idx] for i, idx in trace.index]).numpy()
    trace.record(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    trace.record(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    trace.record(1)  # a resumed run's record of iteration 1
    with open(trace.path, "ab") as f:
        f.write(b"\x00" * 11)  # a torn record (killed mid-write)
    got = read_trace(trace.path, 20)
    assert sorted(got) == [0, 1]
    np.testing.assert_array_equal(got[0], expect)
    np.testing.assert_array_equal(got[1], ((torch.from_numpy(expect) + 1.0) + 1.0).numpy())
    with pytest.raises(ValueError, match="n >= 1"):
        WeightTrace(named, 0, str(tmp_path / "wt3"), "x", seed=0)


def _write_trajectory(tmp_path, traj):
    """Two stage files (the report concatenates them) holding ``traj`` split in halves."""
    out = tmp_path / "run" / "weight_trace"
    out.mkdir(parents=True)
    n = next(iter(traj.values())).shape[0]
    for i, sl in enumerate((slice(0, n // 2), slice(n // 2, n))):
        m = sl.stop - sl.start
        (out / f"stage{i}_tp0.json").write_text(json.dumps({"coordinates": m}))
        with open(out / f"stage{i}_tp0.bin", "wb") as f:
            for t, v in traj.items():
                f.write(np.asarray([t], dtype="<i8").tobytes() + v[sl].astype("<f4").tobytes())
    return tmp_path / "run"


def test_secant_errors_match_the_closed_form_at_the_anchors_fires(tmp_path):
    """theta(t) = a + b t + q t^2 (float32-exact values). The anchor ships theta(0), theta(c), ...
    and at fire t reads s1 = t - K, s0 = s1 - c: theta_hat = theta(s1) + D (K/c)(theta(s1) - theta(s0)),
    so theta_hat - theta(t) = q (D (K/c)(s1^2 - s0^2) + s1^2 - t^2) + b (D K - K) per coordinate."""
    rng = np.random.default_rng(0)
    n = 64
    a, b, q = (rng.integers(-8, 8, n).astype(np.float64) for _ in range(3))
    traj = {t: (a + b * t + q * t * t).astype(np.float32) for t in range(0, 25)}
    run = _write_trajectory(tmp_path, traj)
    tool = _tool()
    loaded = tool.load_trajectory(str(run))
    assert sorted(loaded) == list(range(25))
    for c, K, d in ((4, 4, 1.0), (4, 8, 0.53), (8, 8, 1.0), (8, 8, 0.0)):
        got = tool.score(loaded, c, K, d)
        fires = [t for t in range(c, 25, c) if t >= K + c]
        assert [t for t, _ in got] == fires
        for t, err in got:
            s1, s0 = t - K, t - K - c
            th = lambda s: a + b * s + q * s * s  # noqa: E731
            hat = th(s1) + d * (K / c) * (th(s1) - th(s0))
            want = np.linalg.norm(hat - th(t)) / np.linalg.norm(th(s1) - th(t))
            assert err == pytest.approx(want, rel=1e-6), (c, K, d, t)  # the forecast is fp32
    # a linear trajectory is the secant's own model: no error undamped, the whole distance at D = 0
    lin = {t: (a + b * t).astype(np.float32) for t in range(0, 17)}
    tool2 = _tool()
    lin_t = {t: torch.from_numpy(v.astype(np.float64)) for t, v in lin.items()}
    assert [e for _, e in tool2.score(lin_t, 4, 4, 1.0)] == [0.0, 0.0, 0.0]
    assert [e for _, e in tool2.score(lin_t, 4, 4, 0.0)] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="positive multiple of c"):
        tool.score(loaded, 4, 6, 1.0)


def test_report_main_prints_the_table_and_says_when_a_run_has_no_trace(tmp_path, capsys):
    traj = {t: np.full(8, float(t * t), dtype=np.float32) for t in range(0, 17)}
    run = _write_trajectory(tmp_path, traj)
    tool = _tool()
    assert tool.main([str(run), "--cadence", "4:4", "--damping", "1", "0.5", "--json", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    # t^2 at s0 = t - 8, s1 = t - 4: undamped hat - theta(t) = 2 s1^2 - s0^2 - t^2 = -32, stale s1^2 - t^2
    assert "| 4 | 4 | 1 | 3 | 0.451 | 0.400 | 0.286 | 0.667 |" in out and "| 4 | 4 | 0.5 | 3 |" in out
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert rows[0]["fires"] == [8, 12, 16]
    assert rows[0]["errors"] == pytest.approx([32 / 48, 32 / 80, 32 / 112])
    assert tool.main([str(tmp_path / "nothing")]) == 2
    assert "no trace; fix: run with --log-weight-sample N" in capsys.readouterr().err
