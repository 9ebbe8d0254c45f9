"""tools/evaluate.py end to end: a real (random-init) model, real rows, a JSON summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cegrpo.evaluation import parse_dataset_specs

_REPO = Path(__file__).resolve().parents[2]
_TOOL = _REPO / "tools" / "evaluate.py"


def test_tiny_llama_smoke_run_writes_the_summary(tmp_path):
    out = tmp_path / "res.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(_TOOL), "--model", "tiny-llama", "--datasets", "mawps", "--limit", "4",
         "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    m = data["metrics"]
    assert 0.0 <= m["val/mawps/acc"] <= 1.0
    assert m["val/mawps/num_rows"] == 4
    assert data["datasets"]["mawps"]["mode"] == "greedy"
    assert [r["row"] for r in data["datasets"]["mawps"]["rows"]] == [1, 2, 3, 4]
    # every response hit the 8-token limit or ended earlier
    length = m["val/mawps/response_length/mean"]
    assert length >= 1 and length <= 8
    assert data["meta"]["model"] == "tiny-llama" and data["settings"]["max_new_tokens"] == 8
    assert "mawps" in proc.stdout and "greedy" in proc.stdout and str(out) in proc.stdout


def test_dataset_spec_parsing():
    specs = parse_dataset_specs("mawps,amc23,aime24:avg@4:1.0,gsm8k/test:avg@2")
    assert {n: m.describe() for n, m in specs.items()} == {
        "mawps": "greedy", "amc23": "avg@8 T=0.7", "aime24": "avg@4 T=1", "gsm8k/test": "avg@2 T=0.7"}
    assert list(parse_dataset_specs("default")) == [
        "gsm8k/test", "mawps", "minerva_math", "amc23", "aime24", "olympiadbench"]
    assert {m.name for m in parse_dataset_specs("mawps,amc23", default_mode="greedy").values()} == {"greedy"}
    with pytest.raises(ValueError, match="unknown data set 'nope'"):
        parse_dataset_specs("mawps,nope")
    with pytest.raises(ValueError, match="eval mode"):
        parse_dataset_specs("mawps:best@3")


def test_bad_dataset_argument_exits_with_a_message(tmp_path):
    proc = subprocess.run([sys.executable, str(_TOOL), "--model", "tiny-llama", "--datasets", "mawps,nope"],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode != 0 and "unknown data set 'nope'" in proc.stderr


def _import_tool(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_load_megatron_checkpoint_gives_the_same_answers_as_the_model(tmp_path, capsys):
    """tiny-llama -> megatron checkpoint (PP=2) with the checkpoint tools; --load must give
    the same weights and tokenizer as --model (the conversion is bit-exact) and the same
    evaluation."""
    import argparse

    import torch

    convert = _import_tool(_REPO / "tools" / "checkpoint" / "convert.py", "ckpt_convert_for_eval_test")
    ckpt = tmp_path / "ckpt"
    convert.main(["--loader", "hf", "--saver", "megatron", "--load-dir", "tiny-llama",
                  "--save-dir", str(ckpt), "--target-pp-size", "2"])
    tool = _import_tool(_TOOL, "evaluate_tool_for_test")
    cfg_a, sd_a, tok_a, _ = tool.load_model(argparse.Namespace(model="tiny-llama", load=None))
    cfg_b, sd_b, tok_b, meta_b = tool.load_model(argparse.Namespace(model=None, load=str(ckpt)))
    assert sorted(sd_a) == sorted(sd_b) and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert cfg_a.num_hidden_layers == cfg_b.num_hidden_layers == 4
    text = "Jose starts with 7 bottle caps."
    assert tok_a(text)["input_ids"] == tok_b(text)["input_ids"] and tok_a.eos_token_id == tok_b.eos_token_id
    assert meta_b["iteration"] == 0 and meta_b["model"] == "tiny-llama"
    threads = torch.get_num_threads()
    try:
        common = ["--datasets", "mawps", "--limit", "3", "--max-new-tokens", "6", "--threads", "1",
                  "--no-progress", "--num-examples", "-1"]
        assert tool.main(["--model", "tiny-llama", "--out", str(tmp_path / "a.json")] + common) == 0
        assert tool.main(["--load", str(ckpt), "--out", str(tmp_path / "b.json")] + common) == 0
    finally:
        torch.set_num_threads(threads)
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    ra = [e["responses"] for e in a["datasets"]["mawps"]["examples"]]
    rb = [e["responses"] for e in b["datasets"]["mawps"]["examples"]]
    assert len(ra) == 3 and ra == rb
    assert a["metrics"]["val/mawps/acc"] == b["metrics"]["val/mawps/acc"]
    assert b["meta"]["iteration"] == 0 and b["meta"]["load"] == str(ckpt)
    assert b["meta"]["label"] == "ckpt"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        tool.main(["--datasets", "mawps"])  # neither --model nor --load
    assert e.value.code == 2 and "error: give --model or --load" in capsys.readouterr().err


def _tool_main():
    import importlib.util as iu

    spec = iu.spec_from_file_location("cegrpo_evaluate_tool", str(_TOOL))
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_engine_vllm_without_vllm_is_one_line(monkeypatch, tmp_path):
    """--engine vllm where vLLM is not installed (CI's lean venv): one line naming the tool's flag."""
    import importlib.util as iu

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a, **k: None if name == "vllm" else real(name, *a, **k))
    with pytest.raises(SystemExit) as e:
        _tool_main()(["--model", "tiny-llama", "--datasets", "mawps", "--limit", "1", "--engine", "vllm",
                      "--threads", "1", "--no-progress"])
    msg = str(e.value.code)
    assert msg.startswith("error: --engine vllm: vLLM is not installed in this Python environment; fix: pip install")
    assert "\n" not in msg and "or pass --engine hf" in msg


def test_engine_vllm_smoke_run(tmp_path):
    """The same evaluation through vLLM (bf16, SmolLM2: vLLM's CPU attention does not take
    tiny-llama's head dim of 16); skipped without vLLM."""
    pytest.importorskip("vllm")
    out = tmp_path / "res.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(
        [sys.executable, str(_TOOL), "--model", "smollm2-135m-instruct", "--datasets", "mawps", "--limit", "4",
         "--max-new-tokens", "16", "--threads", "1", "--no-progress", "--engine", "vllm", "--dtype", "bf16",
         "--kv-cache-mb", "64", "--template", "answer_is", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["engine"] == "vllm" and data["meta"]["dtype"] == "bf16"
    assert data["metrics"]["val/mawps/num_rows"] == 4 and 1 <= data["metrics"]["val/mawps/response_length/mean"] <= 16
