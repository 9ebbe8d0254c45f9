"""tools/codec_frontier.py: the table and figure of docs/codecs.md from codec_fidelity rows."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "codec_frontier", Path(__file__).resolve().parents[2] / "tools" / "codec_frontier.py")
codec_frontier = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(codec_frontier)

ROWS = [
    {"codec": "mask", "n_batches": 2, "bytes_ratio": 0.0503, "bytes_ratio_se": 0.0, "mismatch": 15.23,
     "mismatch_se": 0.12, "cos": 0.0083, "cos_se": 0.0096, "cos_stage0": None, "sign_agreement": 0.5035,
     "sign_agreement_se": 0.0025},
    {"codec": "pcaq:lrq", "n_batches": 2, "bytes_ratio": 0.0459, "mismatch": 0.5, "cos": 0.61, "cos_se": 0.02},
]


def test_table_cells_are_mean_pm_se_and_dash_for_undefined(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([dict(ROWS[0], mismatch=99.0), ROWS[1]]))
    b.write_text(json.dumps([ROWS[0]]))  # a later file's row of the same codec wins
    rows = codec_frontier.load_rows([str(a), str(b)])
    assert [r["codec"] for r in rows] == ["mask", "pcaq:lrq"]
    lines = codec_frontier.table(rows).splitlines()
    assert lines[2].startswith("| `mask` | 2 | 0.0503 | 15.23 ± 0.12 | 0.008 ± 0.010 | - | 0.503 ± 0.003 | - | - |")
    assert lines[3] == "| `pcaq:lrq` | 2 | 0.0459 | 0.50 | 0.610 ± 0.020 | - | - | - | - |"
    png = tmp_path / "f.png"
    assert codec_frontier.main([str(a), "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_file_that_is_not_rows_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"codec": "mask"}))
    with pytest.raises(SystemExit, match="not a list of tools/codec_fidelity.py rows"):
        codec_frontier.load_rows([str(bad)])
