"""The supervisor's last line names what a rerun can resume from (megatron_cegrpo/supervisor.py)."""

import signal

from megatron_cegrpo import supervisor


def test_resume_hint_names_the_checkpoint_or_says_there_is_none_yet(tmp_path):
    save = tmp_path / "ckpt"
    argv = ["--model", "tiny-llama", "--save", str(save), "--save-interval", "8"]
    # --save given, nothing written yet (the study arm killed at iteration 6 of a save-interval of 8)
    assert supervisor._resume_hint(argv) == (
        f"; no checkpoint had been written under --save {save} yet (the first comes at --save-interval): "
        "rerunning starts the run over")
    save.mkdir()
    (save / "latest").write_text("iter_0000008\n")
    assert supervisor._resume_hint(argv) == (
        f"; the newest complete checkpoint is {save / 'iter_0000008'}: rerun the same command with --load to resume")
    assert supervisor._resume_hint(["--model", "tiny-llama"]).startswith("; no checkpoint was written (pass --save")


def test_sigkill_points_at_the_out_of_memory_killer():
    assert supervisor._describe(-signal.SIGKILL) == "was killed by SIGKILL (if nobody sent it: out of memory? see `dmesg`)"
    assert supervisor._describe(-signal.SIGTERM) == "was killed by SIGTERM"
    assert supervisor._describe(3) == "exited with status 3"
