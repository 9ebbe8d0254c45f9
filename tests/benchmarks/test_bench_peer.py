"""Smoke test of benchmarks/bench_peer (issue 29 item 5): the commands it would run (--dry-run),
the median / ratio arithmetic and TRL's configuration; no training run."""

import importlib.util
import json
import shlex

import pytest

from benchmarks import bench_peer as bp
from benchmarks._peer_trl_worker import grpo_config_kwargs, verifier_reward
from distributed_util import run_single


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_dry_run_prints_every_command(tmp_path):
    out = run_single(["-m", "benchmarks.bench_peer", "--dry-run", "--steps", "6", "--work-dir", str(tmp_path)],
                     timeout=120)
    cmds = [shlex.split(ln) for ln in out.splitlines() if ln and not ln.startswith(("#", "[bench_peer]"))]
    convert, runs = cmds[0], cmds[1:]
    assert convert[1:4] == ["tools/checkpoint/convert.py", "--loader", "gguf"] and "hf" in convert
    assert len(runs) == 8  # 4 rows x 2 dtypes, fp32 first
    assert "trl/fp32, dense-pp1/fp32, dense-pp2/fp32, mask-anchor/fp32, trl/bf16" in out
    assert not (tmp_path / "runs").exists()  # nothing ran
    trl = [c for c in runs if "benchmarks._peer_trl_worker" in c]
    trainer = [c for c in runs if "megatron_cegrpo/train.py" in c]
    assert len(trl) == 2 and len(trainer) == 6
    assert [_flag(c, "--dtype") for c in trl] == ["fp32", "bf16"]
    assert _flag(trl[0], "--model-dir") == str(tmp_path / "smollm2-135m-instruct-hf") == convert[-1]
    for c in trl:  # the job of examples/learnable_config.sh
        assert (_flag(c, "--rollout-batch"), _flag(c, "--group"), _flag(c, "--max-new-tokens")) == ("4", "8", "64")
        assert (_flag(c, "--temperature"), _flag(c, "--lr"), _flag(c, "--kl-coef")) == ("0.7", "1e-5", "0")
        assert (_flag(c, "--template"), _flag(c, "--train-data"), _flag(c, "--steps")) == \
            ("answer_is", "mawps/singleop", "6")
    # the trainer: deepspeed --num_gpus = stages + anchor ranks, the same job, 6 iterations
    shape = [(_flag(c, "--num_gpus"), _flag(c, "--pipeline-model-parallel-size"), _flag(c, "--boundary-codec"),
              _flag(c, "--anchor-ranks"), "--bf16" in c) for c in trainer]
    assert shape == [("1", "1", "dense", "0", False), ("2", "2", "dense", "0", False), ("3", "2", "mask", "1", False),
                     ("1", "1", "dense", "0", True), ("2", "2", "dense", "0", True), ("3", "2", "mask", "1", True)]
    for c in trainer:
        assert c[0].endswith("deepspeed") and _flag(c, "--train-iters") == "6" and _flag(c, "--kl-coef") == "0"
        assert (_flag(c, "--rollout-batch-size"), _flag(c, "--num-generations"), _flag(c, "--max-new-tokens")) == \
            ("4", "8", "64")
        assert (_flag(c, "--temperature"), _flag(c, "--lr"), _flag(c, "--prompt-template")) == \
            ("0.7", "1e-5", "answer_is")
        assert _flag(c, "--model") == "smollm2-135m-instruct" and _flag(c, "--num-holdout") == "0"
        assert ("--anchor-interval" in c) == (_flag(c, "--anchor-ranks") == "1")
        # fp32 rows sample in fp32 too (the default sampler is bf16 where bf16 is native)
        assert ("--rollout-dtype" in c and _flag(c, "--rollout-dtype") == "fp32") == ("--bf16" not in c)
        assert _flag(c, "--log-dir").startswith(str(tmp_path / "runs"))
        assert _flag(c, "--rollout-engine") == "hf"  # the vLLM rows only when named
    assert len({_flag(c, "--master_port") for c in trainer}) == 6


def test_subset_and_bf16_stand_in(tmp_path, capsys):
    args = bp.parse_args(["--rows", "dense-pp1", "--dtypes", "bf16", "--steps", "3", "--work-dir", str(tmp_path),
                          "--trainer-bf16-args", "--params-dtype bf16"])
    job = bp.job_settings({"PATH": "/usr/bin:/bin", "LR": "2e-6"})  # the environment overrides the config
    assert job["LR"] == "2e-6" and job["GROUP"] == "8" and job["ANCHOR_INTERVAL"] == "4"
    (run,) = bp.plan(args, job, "/venv/bin/python")
    assert run["row"] == "dense-pp1" and run["command"][-2:] == ["--params-dtype", "bf16"]
    assert _flag(run["command"], "--train-iters") == "3" and _flag(run["command"], "--lr") == "2e-6"
    vllm = bp.plan(bp.parse_args(["--rows", "dense-pp1-vllm,mask-anchor-vllm", "--dtypes", "bf16"]), job, "/v/bin/python")
    assert [(_flag(r["command"], "--rollout-engine"), _flag(r["command"], "--num_gpus")) for r in vllm] == \
        [("vllm", "1"), ("vllm", "3")]
    for bad, why in ((["--rows", "tlr"], "unknown or empty --rows/--dtypes ['tlr']"),
                     (["--dtypes", "fp16"], "unknown or empty --rows/--dtypes ['fp16']"),
                     (["--steps", "1"], "--steps must be >= 2 (step 1 warms up")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            bp.parse_args(bad)
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_median_and_ratios(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "val/holdout/acc": 0.1}]  # an evaluation record: not a step
    records += [{"step": s, "timing_s/step": t, "timing_s/gen": t / 4, "response_length/mean": 40.0}
                for s, t in zip(range(1, 7), (90.0, 30.0, 10.0, 20.0, 50.0, 40.0))]
    path.write_text("\n".join(json.dumps(r) for r in records) + '\n{"step": 7, "timing_s/st')  # a torn last line
    steps = bp.read_steps(str(path))
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    s = bp.summarize(steps, 2, 6)
    assert s["median_s"] == 30.0 and s["median_gen_s"] == 7.5 and s["complete"]  # step 1 (90 s) left out
    assert bp.summarize(steps, 2, 8)["timed_steps"] == [2, 3, 4, 5, 6] and not bp.summarize(steps, 2, 8)["complete"]
    assert bp.median_over({}, "timing_s/step", 2, 6) is None
    results = [{"row": "trl", "label": "TRL", "dtype": "fp32", "median_s": 45.0},
               {"row": "dense-pp1", "label": "PP=1", "dtype": "fp32", "median_s": 30.0},
               {"row": "dense-pp2", "label": "PP=2", "dtype": "fp32", "median_s": None},
               {"row": "dense-pp1", "label": "PP=1", "dtype": "bf16", "median_s": 20.0},
               {"row": "dense-pp1-vllm", "label": "PP=1, vLLM", "dtype": "fp32", "median_s": 36.0}]
    ratios = bp.speedups(results)
    assert ratios == {"fp32": {"dense-pp1": 1.5, "dense-pp2": None, "dense-pp1-vllm": 1.25}, "bf16": {"dense-pp1": None}}
    table = bp.format_table(results, 2, 6)
    assert "1.50x" in table and "(met)" in table and "bf16: n/a" in table
    assert "goal (this trainer, dense, PP=1, vLLM >= 1.5x TRL), fp32: 1.25x (not met)" in table


def test_trl_reward_is_the_projects_verifier():
    got = verifier_reward(completions=["3 + 4 = 7. The answer is 7.", "The answer is 8.", "no idea"],
                          ground_truth=["7", "7", "7"], verifier=["numeric"] * 3)
    assert got == [1.0, 0.0, 0.0]


def test_trl_config(tmp_path):
    kw = grpo_config_kwargs(**_job_kw(tmp_path))
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 32
    assert (kw["bf16"], kw["beta"], kw["num_iterations"], kw["use_cpu"]) == (False, 0.0, 1, True)
    assert grpo_config_kwargs(**{**_job_kw(tmp_path), "dtype": "bf16"})["bf16"] is True
    with pytest.raises(ValueError, match="--micro-batch 5 must divide the batch's 32 sequences"):
        grpo_config_kwargs(**{**_job_kw(tmp_path), "micro_batch": 5})
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (pip install -e .[bench]): GRPOConfig not checked")
    from trl import GRPOConfig

    cfg = GRPOConfig(**kw)  # one generation batch of 32 completions = one optimizer step
    assert (cfg.generation_batch_size, cfg.steps_per_generation, cfg.num_generations) == (32, 8, 8)
    assert cfg.max_completion_length == 64 and not cfg.use_vllm and not cfg.gradient_checkpointing
    assert not cfg.bf16 and GRPOConfig(**grpo_config_kwargs(**{**_job_kw(tmp_path), "dtype": "bf16"})).bf16  # on CPU


def _job_kw(tmp_path):
    return dict(dtype="fp32", steps=6, rollout_batch=4, group=8, micro_batch=4, max_new_tokens=64, temperature=0.7,
                lr=1e-5, kl_coef=0.0, seed=1234, output_dir=str(tmp_path / "trl"))
