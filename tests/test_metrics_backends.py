"""Metrics backends: JSONL always, TensorBoard scalars read back, wandb offline run read back,
clear errors when an optional package is missing."""

import glob
import json
import math
import os
import struct
import sys

import pytest

from megatron_cegrpo.metrics import MetricsWriter, MultiWriter, TensorBoardBackend, WandbBackend, build_writers

RECORDS = [
    {"step": 1, "critic/score/mean": 0.25, "actor/entropy": 3.5, "actor/kl_loss": float("nan"),
     "comm/bytes_ratio": 0.05, "note": "first", "actor/num_optimizer_steps": 1},
    {"step": 2, "critic/score/mean": 0.5, "actor/entropy": 3.25, "actor/kl_loss": 0.001,
     "comm/bytes_ratio": 0.05, "actor/num_optimizer_steps": 1, "flag": True},
]


def test_jsonl_only_by_default(tmp_path):
    w = build_writers(str(tmp_path / "run"))
    assert isinstance(w, MultiWriter) and len(w.writers) == 1 and isinstance(w.writers[0], MetricsWriter)
    for r in RECORDS:
        w.write(r)
    w.close()
    assert w.path == str(tmp_path / "run" / "metrics.jsonl")
    lines = [json.loads(x) for x in open(w.path)]
    assert [x["critic/score/mean"] for x in lines] == [0.25, 0.5]
    assert lines[0]["actor/kl_loss"] == "nan" and lines[0]["note"] == "first"
    # a new writer on the same dir starts over unless resuming
    build_writers(str(tmp_path / "run"), resume=True).write({"step": 3, "x": 1.0})
    assert len(open(w.path).read().splitlines()) == 3
    build_writers(str(tmp_path / "run"))
    assert not os.path.exists(w.path)


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing import event_accumulator

    tb = tmp_path / "tb"
    w = build_writers(str(tmp_path / "run"), tensorboard_dir=str(tb), config={"codec": {"boundary_codec": "mask"}})
    assert [type(x).__name__ for x in w.writers] == ["MetricsWriter", "TensorBoardBackend"]
    for r in RECORDS:
        w.write(r)
    w.close()
    assert glob.glob(str(tb / "events.out.tfevents.*"))
    acc = event_accumulator.EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"critic/score/mean", "actor/entropy", "actor/kl_loss", "comm/bytes_ratio", "flag"} <= tags
    assert "note" not in tags and "step" not in tags  # strings skipped; step is the x axis
    ev = acc.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in ev] == [(1, 0.25), (2, 0.5)]
    kl = acc.Scalars("actor/kl_loss")
    assert math.isnan(kl[0].value) and kl[1].value == pytest.approx(0.001)
    assert "config/text_summary" in acc.Tags()["tensors"]  # the config, once, as text
    # the JSONL got the same names
    first = json.loads(open(w.path).readline())
    assert {k for k in first if k not in ("step", "note")} <= tags


def test_tensorboard_string_nan_from_jsonl_is_a_scalar(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing import event_accumulator

    b = TensorBoardBackend(str(tmp_path))
    b.write({"step": 5, "mismatch/abs_logprob_diff_mean": "nan", "label": "x"})
    b.write({"a": 1.0})  # no step: the next one
    b.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert math.isnan(acc.Scalars("mismatch/abs_logprob_diff_mean")[0].value)
    assert acc.Scalars("a")[0].step == 6


def _wandb_history(run_dir):
    """History rows of an offline run, read from its .wandb file (LevelDB log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf, rows = 7, 32768, b"", []
    payloads = []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk = data[pos:pos + n]
        pos += n
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            payloads.append(buf + chunk)
        else:
            break
    for p in payloads:
        rec = pb.Record()
        rec.ParseFromString(p)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install wandb); the backend cannot be exercised")
    for var, sub in [("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")]:
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log_dir = tmp_path / "run_mask"
    w = build_writers(str(log_dir), wandb_project="cegrpo-test", config={"codec": {"boundary_codec": "mask"}})
    wb = w.writers[-1]
    assert isinstance(wb, WandbBackend)
    for r in RECORDS:
        w.write(r)
    run_dir = wb.run_dir
    w.close()
    import wandb

    wandb.teardown()  # wandb's service writes the run file asynchronously; this waits for it
    assert run_dir.startswith(str(log_dir / "wandb" / "offline-run-"))
    assert os.path.isdir(run_dir)
    rows = _wandb_history(run_dir)
    assert [r["_step"] for r in rows] == [1, 2]
    assert [r["critic/score/mean"] for r in rows] == [0.25, 0.5]
    assert rows[0]["note"] == "first" and rows[1]["actor/kl_loss"] == pytest.approx(0.001)
    assert str(rows[0]["actor/kl_loss"]).lower() == "nan"


def test_missing_packages_give_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"WandbBackend needs the 'wandb' package.*pip install"):
        build_writers(str(tmp_path / "a"), wandb_project="p")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"TensorBoardBackend needs the 'tensorboard' package.*pip install"):
        TensorBoardBackend(str(tmp_path / "tb"))
