"""A converted (weights-only) megatron checkpoint initialises a training run.

tiny-llama weights scaled by 1.5 -> HF directory -> tools/checkpoint/convert.py (PP=2) ->
`--model tiny-llama --load` it: the run starts at iteration 1 from the scaled weights (its
saved reference equals them, not tiny-llama's own), and the dense sampler receives them too
(zero mismatch with the dense codec).
"""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from distributed_util import REPO, free_port, tiny_args


def test_train_from_converted_checkpoint(tmp_path):
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    script = f"""
import torch
from megatron_cegrpo.models import resolve_model, load_hf_state_dict, build_hf_model, load_tokenizer
src = resolve_model('tiny-llama'); cfg, sd = load_hf_state_dict(src)
m = build_hf_model(cfg, {{k: v * 1.5 for k, v in sd.items()}})
m.save_pretrained({str(hf_dir)!r}); load_tokenizer(src).save_pretrained({str(hf_dir)!r})
"""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, check=True)
    subprocess.run([sys.executable, "tools/checkpoint/convert.py", "--loader", "hf", "--saver", "megatron",
                    "--load-dir", str(hf_dir), "--save-dir", str(ckpt), "--target-pp-size", "2"],
                   cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "megatron_cegrpo/train.py",
           *tiny_args(pipeline_model_parallel_size=None, rollout_batch_size=1, max_new_tokens=8, lr=None,
                      temperature=None, kl_coef=None, deepspeed_config=None, train_iters=1, boundary_codec="dense",
                      anchor_ranks=0, rollout_dtype="fp32"),  # fp32: the converted weights exactly
           "--load", str(ckpt), "--save", str(tmp_path / "out"),
           "--log-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-6000:]
    assert "weights only" in p.stdout
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["step"] == 1
    assert m["mismatch/abs_logprob_diff_mean"] < 1e-4
    assert m["actor/kl_loss"] == 0.0  # the reference was initialised from the checkpoint too
    for r in range(2):
        converted = load_file(str(ckpt / "iter_0000000" / f"stage_{r:02d}" / "model.safetensors"))
        ref = load_file(str(tmp_path / "out" / "iter_0000001" / f"stage_{r:02d}" / "reference.safetensors"))
        assert converted.keys() == ref.keys()
        for k in ref:
            assert torch.equal(ref[k], converted[k]), k
