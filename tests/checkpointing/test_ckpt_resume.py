"""Resume rules: what --load must hold, and the trajectory options recorded in meta.json."""

import json
import os

import pytest
import torch

from megatron_cegrpo import checkpointing as ck
from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.checkpointing import CheckpointError
from megatron_cegrpo.errors import ConfigError

CFG = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "tie_word_embeddings": True}


def _options(*argv):
    return build_config(parse_args(list(argv))).resume_options()


def _save(save_dir, it=3, options=None):
    tmp = ck.begin_save(str(save_dir), it)
    for r in range(2):
        ck.write_stage_file(tmp, r, "model", {"w": torch.full((4,), float(r))})
        ck.write_stage_blob(tmp, r, "trainer_state", {"iteration": it})
    meta = ck.make_meta(hf_config=CFG, pp_size=2, extra={"seed": 1234, "train_data": "mawps/singleop"},
                        options=options)
    path = ck.commit_save(str(save_dir), tmp, it, meta)
    return ck.read_meta(path)


def test_load_without_a_checkpoint_is_an_error_unless_it_is_the_save_dir(tmp_path):
    run = tmp_path / "run"
    assert ck.find_resume_checkpoint(str(run), str(run)) is None  # --save X --load X: fresh start
    assert ck.find_resume_checkpoint(str(run) + "/", str(run)) is None
    typo = tmp_path / "rnu"
    with pytest.raises(CheckpointError, match="does not exist; fix: check the path") as e:
        ck.find_resume_checkpoint(str(typo), str(run))
    assert str(e.value).startswith(f"--load {typo} does not exist; fix: check the path")
    assert isinstance(e.value, ConfigError)
    run.mkdir()
    with pytest.raises(CheckpointError, match=r"--load .*/run holds no checkpoint \(no 'latest' file"):
        ck.find_resume_checkpoint(str(run), None)
    _save(run)
    ckpt_dir, it = ck.find_resume_checkpoint(str(run), str(run))
    assert (os.path.basename(ckpt_dir), it) == ("iter_0000003", 3)


def test_save_dir_of_another_run_needs_load(tmp_path):
    run = tmp_path / "run"
    ck.check_save_dir(str(run), None)  # nothing there yet
    _save(run)
    ck.check_save_dir(str(run), str(run))  # resuming it
    ck.check_save_dir(str(run), str(run / "iter_0000003"))
    with pytest.raises(CheckpointError, match="already holds checkpoints up to iter_0000003 of another run") as e:
        ck.check_save_dir(str(run), str(tmp_path / "converted"))
    assert str(e.value) == (f"--save {run} already holds checkpoints up to iter_0000003 of another run; fix: add "
                            f"--load {run} to resume that run, or pass an empty or new --save directory")


def test_options_are_recorded_and_a_change_is_refused_naming_both_values(tmp_path):
    opts = _options("--lr", "1e-4", "--seed", "7")
    meta = _save(tmp_path / "run", options=opts)
    assert meta["options"]["--lr"] == 1e-4 and meta["options"]["--seed"] == 7
    assert ck.check_resume(meta, opts, train_iters=10) == []
    with pytest.raises(CheckpointError, match="this run changes options the checkpoint was trained with") as e:
        ck.check_resume(meta, _options("--lr", "2e-4", "--seed", "7", "--no-norm-adv-by-std"), train_iters=10)
    msg = str(e.value)
    assert msg.startswith(f"{meta['checkpoint_dir']}/meta.json: this run changes options the checkpoint was "
                          "trained with (checkpoint -> this run): --lr 0.0001 -> 0.0002, --no-norm-adv-by-std "
                          "False -> True; fix: resume with the checkpoint's settings (--lr 0.0001; drop "
                          "--no-norm-adv-by-std), or start a new run from its weights")
    assert "\n" not in msg


def test_a_switched_shared_prefix_is_refused_with_the_switch_to_add_or_drop(tmp_path):
    """--shared-prefix changes a mask codec's keys (per group with it, per row without), so a resume
    may not switch it; the fix names the switch, not a value (the same for every store_true flag)."""
    on = _options("--shared-prefix", "--micro-batch-size", "8", "--num-generations", "8")
    assert on["--shared-prefix"] is True and _options()["--shared-prefix"] is False
    meta = _save(tmp_path / "run", options=on)
    assert ck.check_resume(meta, on, train_iters=10) == []
    with pytest.raises(CheckpointError, match=r"--shared-prefix True -> False; fix: resume with the checkpoint's "
                                              r"settings \(add --shared-prefix\)"):
        ck.check_resume(meta, _options("--micro-batch-size", "8", "--num-generations", "8"), train_iters=10)
    meta = _save(tmp_path / "off", options=_options("--drift-probe-interval", "2"))
    with pytest.raises(CheckpointError, match=r"--drift-controller False -> True.*; fix: resume with the "
                                              r"checkpoint's settings \(drop --drift-controller\)"):
        ck.check_resume(meta, _options("--drift-controller", "--drift-target-kl", "0.01",
                                       "--drift-probe-interval", "2"), train_iters=10)


def test_train_iters_may_grow_only_with_a_constant_schedule(tmp_path):
    const = _options("--train-iters", "6")
    meta = _save(tmp_path / "const", options=const)
    assert ck.check_resume(meta, _options("--train-iters", "20"), train_iters=20) == []  # train longer
    with pytest.raises(CheckpointError, match=r"the checkpoint is at iteration 3, past --train-iters 2; "
                                              r"fix: pass --train-iters 3 or more"):
        ck.check_resume(meta, _options("--train-iters", "2"), train_iters=2)
    cos = _options("--train-iters", "6", "--lr-decay-style", "cosine")
    meta = _save(tmp_path / "cos", options=cos)
    with pytest.raises(CheckpointError, match=r"--train-iters 6 -> 20; fix: resume with the checkpoint's settings "
                                              r"\(--train-iters 6\) \(--train-iters may change only with --lr-decay-style constant"):
        ck.check_resume(meta, _options("--train-iters", "20", "--lr-decay-style", "cosine"), train_iters=20)
    with pytest.raises(CheckpointError, match=r"--lr-decay-style cosine -> constant; fix: resume with "
                                              r"the checkpoint's settings \(--lr-decay-style cosine\)"):
        ck.check_resume(meta, _options("--train-iters", "6"), train_iters=6)


def test_old_checkpoints_without_options_load_with_a_warning(tmp_path):
    meta = _save(tmp_path / "run", options=None)  # as written before options were recorded
    assert "options" not in meta
    warnings = ck.check_resume(meta, _options(), train_iters=10)
    assert len(warnings) == 1
    assert "was written before run options were recorded: --adam-beta1, --adam-beta2," in warnings[0]
    assert "--seed," not in warnings[0]  # still compared, from meta["extra"]
    with pytest.raises(CheckpointError, match=r"--seed 1234 -> 5; fix: resume with the checkpoint's settings \(--seed 1234\)"):
        ck.check_resume(meta, _options("--seed", "5"), train_iters=10)


def test_options_of_another_version_are_reported_not_compared(tmp_path):
    opts = _options()
    meta = _save(tmp_path / "run", options=dict(opts, **{"--future-flag": 3}))
    (w,) = ck.check_resume(meta, opts, train_iters=10)
    assert "--future-flag recorded on one side only" in w


def test_sizes_only_verification_finds_a_truncated_file(tmp_path):
    meta = _save(tmp_path / "run", options=_options())
    path = os.path.join(meta["checkpoint_dir"], "stage_01", "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(CheckpointError, match=r"stage_01/model.safetensors is truncated or corrupt"):
        ck.verify_checkpoint(meta["checkpoint_dir"], sizes_only=True)
    with open(os.path.join(meta["checkpoint_dir"], "meta.json")) as f:
        assert json.load(f)["options"]["--lr"] == 1e-6


def _agree_worker(out_dir):
    """One rank of test_agree_on_errors_stops_every_rank (gloo, 3 ranks)."""
    import sys

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        def only_rank(r, exc):
            def fn():
                if rank == r:
                    raise exc
                return rank * 10
            return fn

        results = [ck.agree_on_errors(only_rank(-1, None))]  # nobody fails: each its own result
        for name, fn in (("config", only_rank(2, CheckpointError("stage_02/model.safetensors is corrupt; fix: x"))),
                         ("other", only_rank(1, KeyError("boom")))):
            try:
                ck.agree_on_errors(fn)
                results.append(None)
            except Exception as e:  # noqa: BLE001
                results.append([name, type(e).__name__, str(e), getattr(e, "agreed", False)])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        torch.distributed.destroy_process_group()
    sys.exit(0)


def test_agree_on_errors_stops_every_rank(tmp_path):
    """A checkpoint problem one rank finds is raised on every rank (marked agreed, so only
    rank 0 prints it); an unexpected error keeps its type on its rank, the others name it."""
    from distributed_util import run_ranks

    run_ranks([os.path.abspath(__file__), "--agree-worker", str(tmp_path)], 3, timeout=120)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r[0] for r in res] == [0, 10, 20]
    for r in range(3):
        assert res[r][1] == ["config", "CheckpointError", "stage_02/model.safetensors is corrupt; fix: x", True]
    assert res[1][2] == ["other", "KeyError", "'boom'", False]
    for r in (0, 2):
        assert res[r][2] == ["other", "RuntimeError", "rank 1 of the group failed: KeyError: 'boom'", False]


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--agree-worker"]:
        _agree_worker(sys.argv[2])
