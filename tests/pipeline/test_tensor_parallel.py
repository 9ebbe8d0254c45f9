"""Tensor parallelism inside a stage (issue 14): TP = 2 x PP = 2 against TP = 1 x PP = 2.

Both layouts run as real gloo processes (``tp_worker.py``: megatron-core's parallel_state
groups, its tensor-parallel layers and 1F1B schedule, CompressedP2PCommunicator), on the tiny
llama (tied embeddings, 4 heads, 2 KV heads), for the dense codec and the mask codec (keep
ratio 0.25), forward-only log-prob pass and forward+backward pass.

Measured here (2026-12-01, CPU fp32): max |log-prob TP2 - TP1| = 9.5e-7 (|log-prob| up to
~11, i.e. 1 ulp at that magnitude), losses within 6e-8, merged TP gradients within 4.1e-8 of
TP = 1 (largest gradient 0.095), for both codecs; every parameter bit-identical once merged.
Asserted: log-probs and losses atol 5e-6, gradients atol 1e-6 (fp32 reduction order: the
row-parallel layers sum two partial products with an all-reduce).

The conversion test writes the ranks' real parameters as checkpoints (TP = 2: one
``model_tpRR`` shard per TP rank) and converts both to HF with tools/checkpoint/convert.py.
"""

import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file

from distributed_util import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "tp_worker.py")
REPO = os.path.dirname(os.path.dirname(HERE))
LP_ATOL, GRAD_ATOL = 5e-6, 1e-6
CODECS = ("dense", "mask")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{tp: [rank outputs]} of one TP = 2 x PP = 2 run (4 ranks) and one TP = 1 x PP = 2 run."""
    out = tmp_path_factory.mktemp("tp")
    res = {}
    for tp in (2, 1):
        run_ranks([WORKER, "--tp", str(tp), "--out", str(out)], 2 * tp, timeout=900)
        res[tp] = [torch.load(out / f"tp{tp}_rank{r}.pt") for r in range(2 * tp)]
    return res


def _stage_shards(ranks, pp_rank, key):
    """The TP shards of one stage, ordered by TP rank (rank order: TP fastest)."""
    got = sorted((r for r in ranks if r["pp_rank"] == pp_rank), key=lambda r: r["tp_rank"])
    return [r[key] if not isinstance(key, tuple) else r[key[0]][key[1]] for r in got]


def test_rank_layout_is_megatrons_tp_fastest(runs):
    assert [(r["pp_rank"], r["tp_rank"]) for r in runs[2]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_shard_table_matches_megatron_partition_dims(runs):
    from megatron_cegrpo.models.tp_shard import partition_dim

    for r in runs[2]:
        split = r["megatron_partition_dim"]
        assert len(split) >= 9  # every linear of the stage and the (vocab-parallel) embedding / output layer
        for name in r["params"]:
            assert partition_dim(name) == split.get(name), name


def test_gathered_stage_equals_the_tp1_stage(runs):
    """What the driver's sampler and evaluation would take: every TP rank's all-gathered stage
    is bit-identical to the TP = 1 stage."""
    for r in runs[2]:
        ref = runs[1][r["pp_rank"]]["params"]
        got = r["gathered"]
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("codec", CODECS)
def test_tp2_pp2_equals_tp1_pp2(runs, codec):
    from megatron_cegrpo.models.tp_shard import merge_tp_shards

    ref_last = runs[1][1][codec]
    for last in (runs[2][2][codec], runs[2][3][codec]):  # both TP ranks of the last stage
        assert len(last["logprobs"]) == len(ref_last["logprobs"]) == 4
        for a, b in zip(last["logprobs"], ref_last["logprobs"]):
            torch.testing.assert_close(a, b, rtol=0, atol=LP_ATOL)
        for a, b in zip(last["losses"], ref_last["losses"]):
            torch.testing.assert_close(a, b, rtol=0, atol=LP_ATOL)
        for a, b in zip(last["fwd_logprobs"], last["logprobs"]):  # forward-only pass = update pass
            assert torch.equal(a, b)
    for a, b in zip(runs[2][2][codec]["logprobs"], runs[2][3][codec]["logprobs"]):
        assert torch.equal(a, b)  # the TP ranks see the same gathered logits
    for pp in (0, 1):
        merged = merge_tp_shards(_stage_shards(runs[2], pp, (codec, "grads")))
        ref = runs[1][pp][codec]["grads"]
        assert merged.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(merged[name], ref[name], rtol=0, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")
    # the clipping norm over megatron's model-parallel group (TP x PP), the same on every rank
    norms = {r[codec + "_grad_norm"] for r in runs[2]}
    assert len(norms) == 1 and len({r[codec + "_grad_norm"] for r in runs[1]}) == 1
    assert abs(norms.pop() - runs[1][0][codec + "_grad_norm"]) < 1e-6 * runs[1][0][codec + "_grad_norm"]


@pytest.mark.parametrize("codec", CODECS)
def test_tp_ranks_split_the_tp1_payload(runs, codec):
    """Each TP rank sends 1/T of the stage's boundary payload (the receivers all-gather it): per
    rank exactly half the TP = 1 bytes, so the boundary carries the TP = 1 bytes (k/d of dense
    for the mask; the pieces need no padding here)."""
    ratio = {"dense": 1.0, "mask": 16 / 64}[codec]  # k = ceil(0.25 * 64)
    fwd = 2 * 4 * 16 * 2 * 64 * 4 * ratio  # 2 passes x 4 micro-batches x [S=16, mbs=2, d=64] fp32
    for tp in (1, 2):
        for r in runs[tp]:
            m = r[codec]["meter"]
            if r["pp_rank"] == 0:
                assert (m["comm/fwd_bytes"], m["comm/bwd_bytes"]) == (fwd / tp, 0)
            else:
                assert (m["comm/fwd_bytes"], m["comm/bwd_bytes"]) == (0, fwd / 2 / tp)  # one backward pass
            assert m["comm/bytes_ratio"] == ratio


def _convert():
    spec = importlib.util.spec_from_file_location("cegrpo_convert_tool", os.path.join(REPO, "tools", "checkpoint",
                                                                                      "convert.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_checkpoint(save_dir, ranks, tp, hf_config):
    from megatron_cegrpo import checkpointing as ck

    tmp = ck.begin_save(str(save_dir), 0)
    for r in ranks:
        ck.write_stage_file(tmp, r["pp_rank"], ck.model_file_name(r["tp_rank"], tp), r["params"])
    meta = ck.make_meta(hf_config=hf_config, pp_size=2, model_name=None, params_dtype="float32", tp_size=tp)
    return ck.commit_save(str(save_dir), tmp, 0, meta)


def test_conversion_to_hf_from_tp2_checkpoint(runs, tmp_path):
    from megatron_cegrpo import checkpointing as ck
    from megatron_cegrpo.models import load_hf_state_dict, resolve_model

    hf_config, hf_sd = load_hf_state_dict(resolve_model("tiny-llama"))
    convert = _convert()
    out = {}
    for tp in (2, 1):
        ckpt = _write_checkpoint(tmp_path / f"tp{tp}", runs[tp], tp, hf_config)
        files = sorted(ck.verify_checkpoint(ckpt)["files"])
        assert files == [f"stage_0{p}/{ck.model_file_name(t, tp)}.safetensors" for p in (0, 1) for t in range(tp)]
        hf_dir = convert.main(["--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / f"tp{tp}"),
                               "--save-dir", str(tmp_path / f"hf{tp}")])
        out[tp] = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert out[2].keys() == out[1].keys() == hf_sd.keys()
    for k in hf_sd:
        assert torch.equal(out[2][k], out[1][k]) and torch.equal(out[2][k], hf_sd[k]), k
    # and back: HF -> megatron TP=2 writes exactly the shards megatron's TP layers held
    back = convert.main(["--loader", "hf", "--saver", "megatron", "--load-dir", str(tmp_path / "hf1"),
                         "--save-dir", str(tmp_path / "mg2"), "--target-pp-size", "2", "--target-tp-size", "2"])
    meta = ck.verify_checkpoint(back)
    assert meta["tp_size"] == 2
    for r in runs[2]:
        got = ck.read_stage_file(back, r["pp_rank"], ck.model_file_name(r["tp_rank"], 2), meta=meta)
        want = r["params"]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
