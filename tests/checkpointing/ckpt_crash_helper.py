"""Writes a checkpoint and stalls at a chosen point so a test can SIGKILL it there.

    python ckpt_crash_helper.py SAVE_DIR ITERATION MODE

MODE:
* ``mid-write``: begin_save, then writes big stage files forever, printing ``WRITING k``
  before each (the test kills it while one is being written);
* ``before-commit``: writes every stage file, prints ``READY``, sleeps;
* ``before-latest``: commits, but stalls (``RENAMED``) after the rename of the tmp dir and
  before ``latest`` is rewritten (the helper wraps the module's own latest writer; nothing
  is patched in the test process).
"""

import sys
import time

import torch

from megatron_cegrpo import checkpointing as ck

CFG = {"model_type": "llama", "vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 2}


def say(msg):
    print(msg, flush=True)


def main(save_dir, iteration, mode):
    torch.set_num_threads(1)
    tmp = ck.begin_save(save_dir, iteration)
    say(f"TMP {tmp}")
    big = {"w": torch.randn(16 << 20)}  # 64 MiB per file
    if mode == "mid-write":
        k = 0
        while True:
            say(f"WRITING {k}")
            ck.write_stage_file(tmp, k % 2, f"part{k}", big)
            k += 1
    for r in range(2):
        ck.write_stage_file(tmp, r, "model", {"w": torch.full((1000,), float(iteration))})
        ck.write_stage_file(tmp, r, "big", big)
    if mode == "before-commit":
        say("READY")
        time.sleep(600)
    if mode == "before-latest":
        def stall(path, text):
            say("RENAMED")
            time.sleep(600)

        ck.atomic.write_text_atomic = stall  # the writer commit.py rewrites `latest` with
        ck.commit_save(save_dir, tmp, iteration, ck.make_meta(hf_config=CFG, pp_size=2))
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
