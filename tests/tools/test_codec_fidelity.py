"""tools/codec_fidelity.py on the tiny model, PP=2, dense and mask, 2 batches: the documented
JSON fields, exact byte ratios, and the fidelity numbers against a hand computation from the
saved gradients (the mask row's cosine equals the cosine between the mask row's gradient and
the dense row's gradient: two separate codec runs on the same batch and weights)."""

import json
import math
import subprocess
import sys

import torch

from distributed_util import PARITY_REWARD, REPO

FIELDS = ("bytes_ratio", "bytes_per_response_token", "mismatch", "cos", "cos_stage0", "sign_agreement", "norm_ratio", "error_persistence",
          "cos_stage1")


def _flat(d):
    return torch.cat([d[k].double().flatten() for k in sorted(d)])


def test_tool_rows_match_hand_computation(tmp_path):
    (tmp_path / "reward.py").write_text(PARITY_REWARD)
    out, grads = tmp_path / "fid.json", tmp_path / "grads"
    cmd = [sys.executable, "tools/codec_fidelity.py", "--model", "tiny-llama", "--pp", "2", "--batches", "2",
           "--codecs", "dense", "mask", "--keep-ratio", "0.25", "--out", str(out), "--save-grads", str(grads),
           "--", "--rollout-batch-size", "2", "--num-generations", "4", "--max-new-tokens", "12",
           "--temperature", "1.0", "--num-threads", "1", "--num-holdout", "0",
           "--custom-reward-function", f"{tmp_path / 'reward.py'}:parity_reward"]
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-6000:]
    assert "[fidelity] batch 2/2 mask:" in p.stdout and "wrote" in p.stdout
    rows = {r["codec"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"dense", "mask"}
    for r in rows.values():
        for f in FIELDS:
            assert f in r and f + "_se" in r and len(r["per_batch"][f]) == 2, f
        assert r["n_batches"] == 2 and r["pp"] == 2 and r["model"] == "tiny-llama"
    dense, mask = rows["dense"], rows["mask"]
    # dense: the codec gradient is the dense gradient
    assert dense["bytes_ratio"] == 1.0 and dense["mismatch"] < 1e-4
    for f in ("cos", "cos_stage0", "cos_stage1", "norm_ratio", "sign_agreement"):
        assert abs(dense[f] - 1.0) < 1e-12, (f, dense[f])
    assert dense["error_persistence"] is None  # no error, no direction
    # mask: k = ceil(0.25 * 64) = 16 of d = 64 both directions, every pass
    assert mask["bytes_ratio"] == 16 / 64 and mask["bytes_ratio_se"] == 0.0
    for t in (0, 1):  # the same batch and passes: per response token, the ratio of the bytes
        pm, pd = mask["per_batch"]["bytes_per_response_token"][t], dense["per_batch"]["bytes_per_response_token"][t]
        assert pd > 0 and math.isclose(pm / pd, 16 / 64, rel_tol=1e-12)
    assert mask["mismatch"] > 1e-3
    assert mask["per_batch"]["error_persistence"][0] is None and -1 <= mask["error_persistence"] <= 1
    for t in (1, 2):
        g = {c: [torch.load(grads / f"grad_{c}_b{t}_rank{r}.pt") for r in (0, 1)] for c in ("dense", "mask")}
        gm, gd = _flat({f"{r}/{k}": v for r in (0, 1) for k, v in g["mask"][r].items()}), \
            _flat({f"{r}/{k}": v for r in (0, 1) for k, v in g["dense"][r].items()})
        cos = float(gm @ gd / (gm.norm() * gd.norm()))
        assert math.isclose(mask["per_batch"]["cos"][t - 1], cos, rel_tol=1e-6, abs_tol=1e-9)
        s0m, s0d = _flat(g["mask"][0]), _flat(g["dense"][0])
        assert math.isclose(mask["per_batch"]["cos_stage0"][t - 1], float(s0m @ s0d / (s0m.norm() * s0d.norm())),
                            rel_tol=1e-6, abs_tol=1e-9)
        assert math.isclose(mask["per_batch"]["norm_ratio"][t - 1], float(gm.norm() / gd.norm()), rel_tol=1e-6)
        nz = gd != 0
        assert math.isclose(mask["per_batch"]["sign_agreement"][t - 1],
                            float(((gm.sign() == gd.sign()) & nz).sum()) / float(nz.sum()), rel_tol=1e-9)
    m, se = mask["cos"], mask["cos_se"]
    vals = mask["per_batch"]["cos"]
    assert math.isclose(m, sum(vals) / 2) and math.isclose(se, abs(vals[0] - vals[1]) / 2, rel_tol=1e-9)
