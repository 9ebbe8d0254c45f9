"""A stage whose base weights differ from the anchor's gets an fp32 keyframe (issue 30), in a launch.

The stages start from a converted checkpoint of tiny-llama with every weight scaled by 1.5
(``--load``, weights only); the anchor rank builds its dense replica from tiny-llama's own
file. The start-up digests disagree, so each stage's first shipment (theta(0), which a run whose
digests agree never sends: ``test_anchor_e2e.py``) is an fp32 keyframe, billed as one, and the
anchor's first fire replays exactly the converted weights, not its own base model's.
"""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from distributed_util import PARITY_REWARD, REPO, free_port, tiny_args
from distributed_util import launcher as _launcher

from megatron_cegrpo.anchor.shipment import shipment_nbytes
from megatron_cegrpo.anchor.worker import global_param_name

MAKE_SCALED = """
from megatron_cegrpo.models import resolve_model, load_hf_state_dict, build_hf_model, load_tokenizer
src = resolve_model('tiny-llama'); cfg, sd = load_hf_state_dict(src)
m = build_hf_model(cfg, {{k: v * 1.5 for k, v in sd.items()}})
m.save_pretrained({out!r}); load_tokenizer(src).save_pretrained({out!r})
"""


def test_different_base_weights_get_a_keyframe(tmp_path):
    hf_dir, ckpt, dump = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "dump"
    dump.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", MAKE_SCALED.format(out=str(hf_dir))], cwd=REPO, env=env, check=True)
    subprocess.run([sys.executable, "tools/checkpoint/convert.py", "--loader", "hf", "--saver", "megatron",
                    "--load-dir", str(hf_dir), "--save-dir", str(ckpt), "--target-pp-size", "2"],
                   cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    cmd = [_launcher("deepspeed"), "--num_gpus", "3", "--master_port", str(free_port()),
           "megatron_cegrpo/train.py",
           *tiny_args(rollout_batch_size=1, max_new_tokens=8, lr=None, temperature=None, kl_coef=0, train_iters=2,
                      boundary_codec="mask", anchor_ranks=1, anchor_interval=2, anchor_delay=2),
           "--load", str(ckpt), "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward",
           "--log-dir", str(tmp_path / "run"), "--anchor-debug-dir", str(dump)]
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-8000:]
    # each stage says why it sends a keyframe
    assert p.stdout.count("differs from this stage's") == 2, p.stdout[-4000:]

    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    metas = [torch.load(f, weights_only=True) for f in sorted(dump.glob("stage_meta_*.pt"))]
    assert len(metas) == 2
    numels = [sum(int(torch.Size(s).numel()) for _, s in meta["params"]) for meta in metas]
    # theta(0) at step 1 goes as an fp32 keyframe per stage; nothing is refused
    assert metrics[0]["anchor/bytes_ship"] == sum(shipment_nbytes(n, "int4-delta", keyframe=True) for n in numels)
    assert metrics[0]["anchor/bytes_ship"] == metrics[0]["anchor/bytes_ship_fp32"] == 4 * sum(numels)
    assert metrics[1]["anchor/fire"] == 1 and metrics[1]["anchor/branch"] == "fallback"
    assert metrics[1].get("anchor/ship_rejected", 0) == 0

    # the fire at step 2 replays theta(0): the converted (scaled) weights, bit for bit
    fired = torch.load(dump / "anchor_fire_00002.pt", weights_only=True)["weights"]
    checked = set()
    for r, meta in enumerate(metas):
        converted = load_file(str(ckpt / "iter_0000000" / f"stage_{r:02d}" / "model.safetensors"))
        for name, _ in meta["params"]:
            gname = global_param_name(name, meta["layer_offset"], meta["tied_output"])
            assert torch.equal(fired[gname], converted[name].float()), name  # (x 1.5: not the anchor's own base)
            checked.add(gname)
    # every weight the anchor replayed is one of the stages' (and each of theirs was replayed)
    assert checked == set(fired), sorted(set(fired) ^ checked)[:5]
