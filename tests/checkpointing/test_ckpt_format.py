"""checkpointing/ (package): layout, atomic commit, verification, error messages, compatibility.

Also runnable as a script: ``python test_ckpt_format.py --save-worker SAVE_DIR`` is one rank
of the 2-process (gloo) save below.
"""

import json
import os
import random
import re
import sys

import pytest
import torch

from megatron_cegrpo import checkpointing as ck
from megatron_cegrpo.checkpointing import CheckpointError

torch.set_num_threads(1)

CFG = {  # tiny-llama's shape, as a plain dict (make_meta / check_compatible accept both)
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
}


def _meta(pp=2, first=None, last=None, codec="mask", **kw):
    return ck.make_meta(hf_config=CFG, pp_size=pp, num_layers_in_first=first, num_layers_in_last=last,
                        codec=codec and {"name": codec, "keep_ratio": 0.05}, model_name="tiny-llama", **kw)


def _stage_tensors(r, it, n=1000):
    g = torch.Generator().manual_seed(100 * it + r)
    return {f"decoder.layers.0.w{r}": torch.randn(n, generator=g), "bf": torch.randn(4, generator=g).bfloat16()}


def _save(save_dir, it, pp=2, keep_last=None, meta=None, blobs=True):
    tmp = ck.begin_save(str(save_dir), it)
    for r in range(pp):
        ck.write_stage_file(tmp, r, "model", _stage_tensors(r, it))
        if blobs:
            ck.write_stage_blob(tmp, r, "rng", {"torch": torch.get_rng_state(), "py": random.getstate(), "it": it})
    return ck.commit_save(str(save_dir), tmp, it, meta or _meta(pp=pp), keep_last)


def test_layout_and_round_trip(tmp_path):
    save = tmp_path / "run"
    tmp = ck.begin_save(str(save), 12)
    assert os.path.basename(tmp).startswith("iter_0000012.tmp-") and os.path.isdir(tmp)
    sds = [_stage_tensors(r, 12) for r in range(2)]
    ref = {"ref.w": torch.arange(6.0).reshape(2, 3)}
    blob = {"step": 12, "lr": 1e-5, "rng": torch.get_rng_state(), "py": random.getstate(),
            "opt": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "dtype": torch.bfloat16, "shape": torch.Size([2, 3])}
    for r in range(2):
        ck.write_stage_file(tmp, r, "model", sds[r])
    ck.write_stage_file(tmp, 0, "reference.safetensors", ref)
    shared = torch.arange(4.0)  # tied weights passed twice: stored as two tensors (safetensors needs that)
    ck.write_stage_file(tmp, 1, "tied", {"a": shared, "b": shared, "half": shared[:2]})
    ck.write_stage_blob(tmp, 1, "optimizer", blob)
    assert not (save / "latest").exists()  # nothing published before the commit
    final = ck.commit_save(str(save), tmp, 12, _meta(extra={"consumed_samples": 96}))
    assert final == str(save / "iter_0000012") and not os.path.exists(tmp)
    assert (save / "latest").read_text() == "iter_0000012"
    assert sorted(os.listdir(final)) == ["meta.json", "stage_00", "stage_01"]
    assert sorted(os.listdir(save)) == ["iter_0000012", "latest"]

    meta = json.loads((save / "iter_0000012" / "meta.json").read_text())
    assert meta["format_version"] == ck.FORMAT_VERSION and meta["iteration"] == 12 and meta["pp_size"] == 2
    assert meta["codec"] == {"name": "mask", "keep_ratio": 0.05} and meta["model_name"] == "tiny-llama"
    assert meta["hf_config"]["hidden_size"] == 64 and meta["extra"] == {"consumed_samples": 96}
    assert sorted(meta["files"]) == ["stage_00/model.safetensors", "stage_00/reference.safetensors",
                                     "stage_01/model.safetensors", "stage_01/optimizer.pt", "stage_01/tied.safetensors"]
    for rel, rec in meta["files"].items():
        assert rec["sha256"] == ck.sha256_file(os.path.join(final, rel))

    for arg in (save, final):
        assert ck.resolve_load_dir(str(arg)) == (final, 12)
    m = ck.verify_checkpoint(final)
    assert m["checkpoint_dir"] == final
    for r in range(2):
        got = ck.read_stage_file(final, r)
        assert got.keys() == sds[r].keys() and all(torch.equal(got[k], sds[r][k]) for k in got)
        assert got["bf"].dtype == torch.bfloat16
    assert torch.equal(ck.read_stage_file(final, 0, "reference")["ref.w"], ref["ref.w"])
    back = ck.read_stage_blob(final, 1, "optimizer")
    assert back["step"] == 12 and back["py"] == blob["py"] and torch.equal(back["rng"], blob["rng"])
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], torch.ones(3)) and back["dtype"] is torch.bfloat16
    tied = ck.read_stage_file(final, 1, "tied")
    assert torch.equal(tied["a"], shared) and torch.equal(tied["b"], shared) and torch.equal(tied["half"], shared[:2])
    assert ck.stage_file_names(m, 1) == ["model.safetensors", "optimizer.pt", "tied.safetensors"]
    with pytest.raises(CheckpointError, match=r"stage_00/optimizer.pt: not part of this checkpoint"):
        ck.read_stage_blob(final, 0, "optimizer")
    assert ck.hf_config_from_meta(m).hidden_size == 64


def test_blob_only_plain_objects_and_load_runs_no_pickle_code(tmp_path):
    import numpy as np

    tmp = ck.begin_save(str(tmp_path), 1)
    with pytest.raises(TypeError, match=r"\['rng'\]\['np'\]: numpy.ndarray .*torch.from_numpy"):
        ck.write_stage_blob(tmp, 0, "rng", {"rng": {"np": np.zeros(3)}})

    class Custom:
        pass

    with pytest.raises(TypeError, match=r"\[1\]: .*Custom cannot be stored"):
        ck.write_stage_blob(tmp, 0, "x", [1, Custom()])
    assert not os.path.exists(os.path.join(tmp, "stage_00"))  # nothing written
    with pytest.raises(ValueError, match="no path separators"):
        ck.write_stage_file(tmp, 0, "../evil", {})

    # A .pt smuggled into a checkpoint (with a matching sha256) is still never executed.
    ck.write_stage_file(tmp, 0, "model", {"w": torch.ones(1)})
    marker = tmp_path / "pwned"
    torch.save(_Evil(str(marker)), os.path.join(tmp, "stage_00", "evil.pt"))
    final = ck.commit_save(str(tmp_path), tmp, 1, _meta(pp=1))
    with pytest.raises(CheckpointError, match=r"stage_00/evil.pt cannot be loaded with torch.load\(weights_only=True\)"):
        ck.read_stage_blob(final, 0, "evil")
    assert not marker.exists()


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_byte_flip_and_truncation_are_caught(tmp_path):
    final = _save(tmp_path, 3)
    path = os.path.join(final, "stage_01", "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01  # inside the tensor data: safetensors itself would not notice
    open(path, "wb").write(bytes(data))
    for call in (lambda: ck.verify_checkpoint(final), lambda: ck.read_stage_file(final, 1),
                 lambda: ck.verify_checkpoint(final, pp_rank=1)):
        with pytest.raises(CheckpointError, match="is corrupt: sha256") as e:
            call()
        msg = str(e.value)
        assert path in msg and "is corrupt: sha256" in msg and "fix: restore stage_01/model.safetensors" in msg
    ck.verify_checkpoint(final, pp_rank=0)  # the other stage is fine
    ck.read_stage_file(final, 0)

    open(path, "wb").write(bytes(data[: len(data) - 100]))
    with pytest.raises(CheckpointError, match=rf"{path} is truncated or corrupt: {len(data) - 100} bytes, "
                                              rf"meta.json records {len(data)}"):
        ck.verify_checkpoint(final)
    with pytest.raises(CheckpointError, match=r"cannot be read as safetensors"):
        ck.read_stage_file(final, 1, verify=False)
    os.unlink(os.path.join(final, "stage_00", "rng.pt"))
    with pytest.raises(CheckpointError, match=r"stage_00/rng.pt is missing \(listed in meta.json\)"):
        ck.verify_checkpoint(final)
    (tmp_path / "iter_0000003" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta.json is corrupt \(not valid JSON"):
        ck.read_meta(final)


def test_check_compatible_messages(tmp_path):
    final = _save(tmp_path, 5)
    meta = ck.read_meta(final)
    ok = dict(hf_config=CFG, pp_size=2, num_layers_in_first=None, num_layers_in_last=None)
    ck.check_compatible(meta, **ok, codec={"name": "mask", "keep_ratio": 0.05})
    ck.check_compatible(meta, **ok)  # codec not checked when not given

    with pytest.raises(CheckpointError, match=r"saved with pipeline-model-parallel size 2 .*this run uses 3") as e:
        ck.check_compatible(meta, **dict(ok, pp_size=3, num_layers_in_first=2))
    msg = str(e.value)
    assert os.path.join(final, "meta.json") in msg
    assert "saved with pipeline-model-parallel size 2" in msg and "this run uses 3" in msg
    assert "convert it with tools/checkpoint/convert.py --target-pp-size 3" in msg
    assert (f"--loader megatron --saver megatron --load-dir {final} --save-dir <new dir> --target-pp-size 3 "
            "--target-decoder-first-pipeline-num-layers 2") in msg
    with pytest.raises(CheckpointError, match=r"first/last stage layers None/None\), this run uses 2 \(first/last 3/1\)"):
        ck.check_compatible(meta, **dict(ok, num_layers_in_first=3, num_layers_in_last=1))

    with pytest.raises(CheckpointError, match=r"the checkpoint holds another model \('tiny-llama'\)") as e:
        ck.check_compatible(meta, **dict(ok, hf_config=dict(CFG, hidden_size=128, intermediate_size=256)))
    msg = str(e.value)
    assert "another model ('tiny-llama')" in msg and "hidden_size: checkpoint 64, this run 128" in msg
    assert "intermediate_size: checkpoint 128, this run 256" in msg and "--model" in msg

    from transformers import LlamaConfig
    real = LlamaConfig(**{k: v for k, v in CFG.items() if k != "model_type"})
    ck.check_compatible(meta, **dict(ok, hf_config=real))  # a config object works too

    for run_codec, shown in (("dense", "dense"), ({"name": "mask", "keep_ratio": 0.1}, "mask (keep ratio 0.1)")):
        with pytest.raises(CheckpointError, match=re.escape(f"mask (keep ratio 0.05), this run uses {shown};")) as e:
            ck.check_compatible(meta, **ok, codec=run_codec)
        msg = str(e.value)
        assert f"trained with boundary codec mask (keep ratio 0.05), this run uses {shown}" in msg
        assert "resume with --boundary-codec mask --boundary-keep-ratio 0.05" in msg

    from megatron_cegrpo.arguments import CodecConfig  # the trainer's config object form

    ck.check_compatible(meta, **ok, codec=CodecConfig(boundary_codec="mask", boundary_keep_ratio=0.05))
    with pytest.raises(TypeError, match="cannot read a codec name"):
        ck.check_compatible(meta, **ok, codec=object())
    neutral = ck.read_meta(_save(tmp_path / "conv", 0, meta=_meta(codec=None)))
    ck.check_compatible(neutral, **ok, codec="dense")  # codec-free (converted) checkpoints fit any codec


def test_latest_pointing_nowhere_and_empty_dirs(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        ck.resolve_load_dir(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert not ck.has_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match=r"holds no checkpoint \(no 'latest' file"):
        ck.resolve_load_dir(str(tmp_path / "empty"))

    save = tmp_path / "run"
    _save(save, 7)
    (save / "latest").write_text("iter_0000099")
    assert ck.has_checkpoint(str(save))
    with pytest.raises(CheckpointError, match="points to iter_0000099, which does not exist") as e:
        ck.resolve_load_dir(str(save))
    msg = str(e.value)
    assert f"{save}/latest points to iter_0000099, which does not exist" in msg
    assert "complete checkpoints there: iter_0000007" in msg

    (save / "iter_0000099").mkdir()  # a directory without meta.json (never produced by a commit)
    with pytest.raises(CheckpointError, match=r"points to iter_0000099, which is incomplete \(no meta.json\)"):
        ck.resolve_load_dir(str(save))
    with pytest.raises(CheckpointError, match=r"iter_0000099 is incomplete: it has no meta.json"):
        ck.resolve_load_dir(str(save / "iter_0000099"))
    (save / "latest").write_text("garbage")
    with pytest.raises(CheckpointError, match=r"latest holds 'garbage', expected a name like 'iter_0000012'"):
        ck.resolve_load_dir(str(save))
    os.unlink(save / "latest")  # crash between a first commit's rename and its latest write
    assert ck.resolve_load_dir(str(save)) == (str(save / "iter_0000007"), 7)


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path):
    prev = _save(tmp_path, 10)
    tmp = ck.begin_save(str(tmp_path), 20)  # "crash" after writing, before the commit
    ck.write_stage_file(tmp, 0, "model", _stage_tensors(0, 20))
    ck.write_stage_file(tmp, 1, "model", _stage_tensors(1, 20))
    assert ck.resolve_load_dir(str(tmp_path)) == (prev, 10)
    assert ck.list_checkpoints(str(tmp_path)) == [(10, prev)]
    ck.verify_checkpoint(prev)
    with pytest.raises(CheckpointError, match=r"temporary directory of an unfinished \(interrupted\) save"):
        ck.resolve_load_dir(tmp)
    final = _save(tmp_path, 30)  # the next commit removes the stale tmp dir
    assert not os.path.exists(tmp) and ck.resolve_load_dir(str(tmp_path)) == (final, 30)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "iter_0000030", "latest"]


def test_commit_refuses_incomplete_stage_set(tmp_path):
    prev = _save(tmp_path, 1)
    tmp = ck.begin_save(str(tmp_path), 2)
    ck.write_stage_file(tmp, 0, "model", _stage_tensors(0, 2))
    with pytest.raises(CheckpointError, match=r"has stage directories \['stage_00'\], expected \['stage_00', 'stage_01'\]"):
        ck.commit_save(str(tmp_path), tmp, 2, _meta(pp=2))
    ck.write_stage_blob(tmp, 1, "rng", {"a": 1})
    with pytest.raises(CheckpointError, match=r"stage_01/model.safetensors is missing: stage 1 did not write"):
        ck.commit_save(str(tmp_path), tmp, 2, _meta(pp=2))
    assert ck.resolve_load_dir(str(tmp_path)) == (prev, 1)


def test_keep_last_and_resave_same_iteration(tmp_path):
    for it in (1, 2, 3, 4):
        _save(tmp_path, it, keep_last=2)
    assert [it for it, _ in ck.list_checkpoints(str(tmp_path))] == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004", "latest"]
    # the same iteration again (e.g. after resuming from an explicit older dir): replaced atomically
    tmp = ck.begin_save(str(tmp_path), 4)
    for r in range(2):
        ck.write_stage_file(tmp, r, "model", {"new": torch.full((3,), float(r))})
    final = ck.commit_save(str(tmp_path), tmp, 4, _meta())
    assert torch.equal(ck.read_stage_file(final, 1)["new"], torch.ones(3))
    assert ck.stage_file_names(ck.verify_checkpoint(final), 0) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004", "latest"]
    # saving an older iteration keeps it (just written) even though keep_last counts newest first
    _save(tmp_path, 2, keep_last=1)
    assert [it for it, _ in ck.list_checkpoints(str(tmp_path))] == [2, 4]
    assert (tmp_path / "latest").read_text() == "iter_0000002"


def _save_worker(save_dir):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tmp = ck.begin_save(save_dir, 8)  # rank 0 creates, all get the same name
        ck.write_stage_file(tmp, rank, "model", _stage_tensors(rank, 8))
        ck.write_stage_blob(tmp, rank, "rng", {"rank": rank, "torch": torch.get_rng_state()})
        final = ck.commit_save(save_dir, tmp, 8, _meta(pp=world), keep_last=1)
        with open(os.path.join(save_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{tmp}\n{final}\n")
        # a failing commit raises the same error on every rank (stage 1 writes nothing here)
        tmp = ck.begin_save(save_dir, 9)
        if rank == 0:
            ck.write_stage_file(tmp, 0, "model", _stage_tensors(0, 9))
        try:
            ck.commit_save(save_dir, tmp, 9, _meta(pp=world))
            raise AssertionError("commit should have failed")
        except CheckpointError as e:
            with open(os.path.join(save_dir, f"rank{rank}.err"), "w") as f:
                f.write(str(e))
    finally:
        torch.distributed.destroy_process_group()


def test_two_rank_save_with_gloo(tmp_path):
    from distributed_util import run_ranks

    save = tmp_path / "run"
    save.mkdir()
    run_ranks([os.path.abspath(__file__), "--save-worker", str(save)], 2, timeout=120)
    lines = [(save / f"rank{r}.txt").read_text().split() for r in range(2)]
    assert lines[0] == lines[1] and lines[0][1] == str(save / "iter_0000008")
    final = lines[0][1]
    meta = ck.verify_checkpoint(final)
    assert ck.read_stage_blob(final, 1, "rng")["rank"] == 1
    assert sorted(meta["files"]) == ["stage_00/model.safetensors", "stage_00/rng.pt",
                                     "stage_01/model.safetensors", "stage_01/rng.pt"]
    errs = [(save / f"rank{r}.err").read_text() for r in range(2)]
    assert errs[0] == errs[1] and "expected ['stage_00', 'stage_01']" in errs[0]
    assert ck.resolve_load_dir(str(save)) == (final, 8)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--save-worker"]:
        _save_worker(sys.argv[2])


def test_decide_resume_is_the_one_resume_decision(tmp_path):
    """``decide_resume`` (issue 34; asked at start-up, by each stage and by the anchor) on a real
    TrainConfig: a fresh start in the run's own --save, a weights-only checkpoint (a new run from its
    weights), a continued run (with check_resume's warnings), and the refusals: a missing --load, a
    run written at another TP size, a changed trajectory option."""
    from megatron_cegrpo.arguments import build_config, parse_args

    def cfg(*extra):
        return build_config(parse_args(["--model", "tiny-llama", "--pipeline-model-parallel-size", "2",
                                        "--boundary-codec", "mask", *extra]))

    save = tmp_path / "run"
    assert ck.decide_resume(cfg("--save", str(save), "--load", str(save)), CFG) is None  # auto-resume, nothing yet
    with pytest.raises(CheckpointError, match="does not exist"):
        ck.decide_resume(cfg("--load", str(tmp_path / "typo")), CFG)

    weights = _save(tmp_path / "converted", 3)  # model files only: weights
    p = ck.decide_resume(cfg("--load", str(tmp_path / "converted")), CFG, verify_sizes=True)
    assert (p.ckpt_dir, p.iteration, p.continues, p.warnings) == (weights, 3, False, ())

    run = cfg("--load", str(tmp_path / "cont"))
    tmp = ck.begin_save(str(tmp_path / "cont"), 4)
    for r in range(2):
        ck.write_stage_file(tmp, r, "model", _stage_tensors(r, 4))
        ck.write_stage_blob(tmp, r, "trainer_state", {"iteration": 4})
    options = dict(run.resume_options(), **{"--a-flag-of-another-version": 1})
    final = ck.commit_save(str(tmp_path / "cont"), tmp, 4, _meta(options=options))
    p = ck.decide_resume(run, CFG)
    assert (p.ckpt_dir, p.iteration, p.continues) == (final, 4, True)
    assert len(p.warnings) == 1 and "--a-flag-of-another-version recorded on one side only" in p.warnings[0]
    with pytest.raises(CheckpointError, match=r"written at --tensor-model-parallel-size 1 .* cannot continue at "
                                              r"--tensor-model-parallel-size 2"):
        ck.decide_resume(cfg("--load", str(tmp_path / "cont"), "--tensor-model-parallel-size", "2"), CFG)
    with pytest.raises(CheckpointError, match=r"changes options .*--lr"):
        ck.decide_resume(cfg("--load", str(tmp_path / "cont"), "--lr", "3e-5"), CFG)
