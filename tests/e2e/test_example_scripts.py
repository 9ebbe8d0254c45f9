"""examples/run_smollm2_mawps.sh (`make demo`) runs the CPU study's learnable configuration
(examples/learnable_config.sh, shared with examples/study_cpu.sh): the two scripts' train.py
command lines agree on every flag of that configuration, read with a stand-in launcher."""

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: the flags of the learnable configuration and the run's shape, which the demo must share with the study
SHARED = ("--model", "--train-data", "--prompt-template", "--num-holdout", "--holdout-seed", "--max-new-tokens",
          "--eval-max-new-tokens", "--eval-batch-size", "--pipeline-model-parallel-size", "--micro-batch-size",
          "--rollout-batch-size", "--num-generations", "--temperature", "--lr", "--kl-coef", "--boundary-codec",
          "--boundary-keep-ratio", "--anchor-ranks", "--seed", "--deepspeed_config", "--bf16", "--rollout-dtype")


def _flags(argv):
    """{flag: value} of a train.py command line (a flag followed by another flag has value None)."""
    args = argv[argv.index("megatron_cegrpo/train.py") + 1:]
    out = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def _env(**extra):
    """A clean environment (the scripts read every setting from it): the venv's python first on PATH."""
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(REPO),
           "HOME": os.environ.get("HOME", "/tmp"), "OMP_NUM_THREADS": "1"}
    return dict(env, **extra)


def test_the_demo_runs_the_studys_configuration(tmp_path):
    fake = tmp_path / "fake_deepspeed"
    fake.write_text('#!/usr/bin/env bash\necho "ARGV $*"\n')
    fake.chmod(0o755)
    env = _env(DEEPSPEED=str(fake), LOG_DIR=str(tmp_path / "demo"))
    demo = subprocess.run(["bash", "examples/run_smollm2_mawps.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert demo.returncode == 0, demo.stderr
    demo_argv = shlex.split(demo.stdout.splitlines()[0][len("ARGV "):])
    # the stand-in wrote no summary.json (as on a host without the driver): said so, the study's table printed
    assert f"[demo] no {tmp_path / 'demo' / 'summary.json'} on this host (the driver, rank 0, writes it)" in demo.stdout
    assert "| dense | 1234 | dense | no | 48 |" in demo.stdout and demo.stderr == ""
    # the table of this kind of host's study: bf16 on AMX, bf16 on AVX512-BF16, the fp32 path elsewhere
    from megatron_cegrpo.compat.precision import cpu_bf16_kernels

    bf16 = "--bf16" in demo_argv
    name = ("study_bf16_amx" if cpu_bf16_kernels() == "amx" else "study_bf16") if bf16 else "study"
    assert f"the study (docs/{name}.md;" in demo.stdout

    # the main job is the study's pcaq/every=2:lrq + anchor arm at lr 6e-6 (issue 33 item 7: its best paired gain
    # in the budget). DRY_RUN=1 puts every printed launch through start-up's checks (train.check_flags) in one
    # process: the main job's arm passes, a mistyped arm fails the dry run with the trainer's line and its name
    env = _env(DRY_RUN="1", ARMS="pcaq/every=2:lrq_anchor_lr6e-6 mask_ancor", SEEDS="1234",
               STUDY_DIR=str(tmp_path / "study"))
    study = subprocess.run(["bash", "examples/study_cpu.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert study.returncode == 1, study.stderr
    assert study.stderr.splitlines()[-2:] == [
        "[cegrpo] error: --boundary-codec 'mask_ancor': unknown codec 'mask_ancor'; valid names: dense, lowrank, "
        "mask, or FWD:BWD with halves from dense, lrq, mask, pcaq, rpq; fix: e.g. --boundary-codec mask, or "
        "--boundary-codec pcaq:lrq",
        "[study] mask_ancor seed 1234: would fail at start-up (the line above); fix the arm or its flags"]
    assert "pcaq/every=2:lrq_anchor_lr6e-6 seed 1234: would fail" not in study.stderr
    line = next(ln for ln in study.stdout.splitlines()
                if ln.startswith("[study] pcaq/every=2:lrq_anchor_lr6e-6 seed 1234: flock"))
    study_argv = shlex.split(line.split(": ", 1)[1])

    d, s = _flags(demo_argv), _flags(study_argv)
    assert {f: d.get(f) for f in SHARED} == {f: s.get(f) for f in SHARED}
    assert {f: d[f] for f in ("--prompt-template", "--max-new-tokens", "--lr", "--kl-coef", "--num-holdout",
                              "--holdout-seed", "--boundary-codec", "--boundary-keep-ratio", "--anchor-ranks")} == {
        "--prompt-template": "answer_is", "--max-new-tokens": "64", "--lr": "6e-6", "--kl-coef": "0",
        "--num-holdout": "300", "--holdout-seed": "1234", "--boundary-codec": "pcaq/every=2:lrq",
        "--boundary-keep-ratio": "0.05", "--anchor-ranks": "1"}
    # the default log folder is named after the codec, without the spec's "/" and ":" (no nested folders)
    plain = subprocess.run(["bash", "examples/run_smollm2_mawps.sh"], cwd=REPO, env=_env(DEEPSPEED=str(fake)),
                           capture_output=True, text=True, timeout=120)
    assert _flags(shlex.split(plain.stdout.splitlines()[0][len("ARGV "):]))["--log-dir"] == \
        "runs/smollm2_mawps_pcaq_every=2_lrq"
    # without the anchor's fold (CODEC=dense ANCHOR_RANKS=0, the dense control) the study's lr, LR
    dense = subprocess.run(["bash", "examples/run_smollm2_mawps.sh"], cwd=REPO, capture_output=True, text=True,
                           env=_env(DEEPSPEED=str(fake), CODEC="dense", ANCHOR_RANKS="0"), timeout=120)
    assert _flags(shlex.split(dense.stdout.splitlines()[0][len("ARGV "):]))["--lr"] == "1e-5"
    # what differs, on purpose: the demo is short and fires its anchor every 4 iterations; it samples
    # with vLLM where vLLM is installed (the study only in its *_vllm arms)
    assert (d["--train-iters"], d["--anchor-interval"], d["--anchor-delay"]) == ("10", "4", "4")
    assert d["--rollout-engine"] == ("vllm" if importlib.util.find_spec("vllm") else "hf")
    assert "--rollout-engine" not in s
    assert (s["--train-iters"], s["--anchor-interval"], s["--anchor-delay"]) == ("48", "8", "8")
    assert s["--holdout-eval-interval"] == "0"  # HOLDOUT_EVAL_INTERVAL: the long horizon's curve


def test_study_arm_suffixes_add_their_flags(tmp_path):
    """``<arm>_dense<N>`` adds ``--dense-step-interval N`` to the arm's command, ``_filter`` adds
    DAPO's dynamic sampling, ``_vllm`` the vLLM sampler, ``_shared`` shared-prefix passes over
    micro-batches of one group, ``_overlong`` DAPO's length penalty, ``_controller`` the drift
    controller, ``_c2`` the seeds' fire-only fold at beta 0.5, ``_lr<X>`` another learning rate,
    ``lowrank_anchorq`` the anchor-owned basis; the arm's folder keeps its whole name."""
    env = _env(DRY_RUN="print", ARMS="mask_anchor_dense16 pcaq:lrq_anchor_dense8_filter dense_vllm mask_anchor_shared "
                                 "dense_overlong mask_anchor_controller mask_anchor_c2 lowrank_anchorq "
                                 "pcaq/every=2:lrq_anchor_lr6e-6",
               SEEDS="1234",
               STUDY_DIR=str(tmp_path / "study"))
    study = subprocess.run(["bash", "examples/study_cpu.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert study.returncode == 0, study.stderr
    lines = {ln.split(" seed ")[0][len("[study] "):]: shlex.split(ln.split(": ", 1)[1])
             for ln in study.stdout.splitlines() if " seed 1234: flock" in ln}
    dense16, both = _flags(lines["mask_anchor_dense16"]), _flags(lines["pcaq:lrq_anchor_dense8_filter"])
    assert (dense16["--boundary-codec"], dense16["--anchor-ranks"]) == ("mask", "1")
    assert dense16["--dense-step-interval"] == "16"
    assert "--filter-groups" not in dense16
    assert (both["--boundary-codec"], both["--anchor-ranks"], both["--dense-step-interval"]) == ("pcaq:lrq", "1", "8")
    assert "--filter-groups" in both and both["--max-num-gen-batches"] == "4"
    assert dense16["--log-dir"] == str(tmp_path / "study" / "mask_anchor_dense16-s1234")
    vllm = _flags(lines["dense_vllm"])
    assert (vllm["--boundary-codec"], vllm["--anchor-ranks"], vllm["--rollout-engine"]) == ("dense", "0", "vllm")
    assert "--rollout-engine" not in dense16
    shared = lines["mask_anchor_shared"]  # its micro-batch (the group, 8) comes after the study's 4: argparse's last wins
    assert _flags(shared)["--boundary-codec"] == "mask" and "--shared-prefix" in shared
    assert [shared[i + 1] for i, a in enumerate(shared) if a == "--micro-batch-size"] == ["4", "8"]
    assert "--shared-prefix" not in lines["mask_anchor_dense16"]
    overlong = _flags(lines["dense_overlong"])
    assert (overlong["--boundary-codec"], overlong["--overlong-buffer-len"]) == ("dense", "16")
    assert "--overlong-buffer-len" not in dense16
    ctl = _flags(lines["mask_anchor_controller"])
    assert (ctl["--boundary-codec"], ctl["--anchor-ranks"], ctl["--drift-target-kl"],
            ctl["--drift-max-boundary-ratio"]) == ("mask", "1", "0.05", "0.11")
    assert "--drift-controller" in lines["mask_anchor_controller"] and "--drift-controller" not in dense16
    # the controller's input, the drift probe, every 4 iterations on its arms; every 8 (48 / 6) elsewhere
    assert (ctl["--drift-probe-interval"], dense16["--drift-probe-interval"]) == ("4", "8")
    c2 = _flags(lines["mask_anchor_c2"])
    assert (c2["--anchor-ranks"], c2["--sign-fold"], c2["--sign-blend-beta"]) == ("1", "fire-only", "0.5")
    assert "--sign-fold" not in dense16
    q = _flags(lines["lowrank_anchorq"])
    assert (q["--boundary-codec"], q["--anchor-ranks"], q["--lowrank-q-owner"]) == ("lowrank", "1", "anchor")
    lr = lines["pcaq/every=2:lrq_anchor_lr6e-6"]  # the study's --lr first, the arm's after it: argparse's last wins
    assert (_flags(lr)["--boundary-codec"], _flags(lr)["--anchor-ranks"]) == ("pcaq/every=2:lrq", "1")
    assert [lr[i + 1] for i, a in enumerate(lr) if a == "--lr"] == ["1e-5", "6e-6"]
    assert _flags(lr)["--log-dir"] == str(tmp_path / "study" / "pcaq,every=2:lrq_anchor_lr6e-6-s1234")
    plain = lines["mask_anchor_dense16"]
    assert [plain[i + 1] for i, a in enumerate(plain) if a == "--lr"] == ["1e-5"]


def test_the_scripts_launch_this_checkouts_code(tmp_path):
    """Both scripts put their own checkout first on PYTHONPATH: a study arm run from a git worktree
    imports the worktree's package, not the one the venv's editable install points at (deepspeed's
    local launch passes PYTHONPATH on; study_arm.json's commit is then the code that ran)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "deepspeed"  # what the launched ranks would see: their PYTHONPATH and the package they import
    fake.write_text('#!/usr/bin/env bash\necho "PYTHONPATH $PYTHONPATH"\n'
                    'echo "PACKAGE $(python -c "import megatron_cegrpo, os; print(os.path.dirname(megatron_cegrpo.__file__))")"\n')
    fake.chmod(0o755)
    env = _env(PATH=f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(tmp_path / "elsewhere"))
    demo = subprocess.run(["bash", "examples/run_smollm2_mawps.sh"], cwd=REPO, capture_output=True, text=True,
                          env=dict(env, DEEPSPEED=str(fake), LOG_DIR=str(tmp_path / "demo")), timeout=120)
    study = subprocess.run(["bash", "examples/study_cpu.sh"], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env=dict(env, ARMS="dense", SEEDS="1", STUDY_DIR=str(tmp_path / "study"),
                                    STUDY_LOCK=str(tmp_path / "lock")))
    for run in (demo, study):
        assert run.returncode == 0, run.stderr
        got = dict(ln.split(" ", 1) for ln in run.stdout.splitlines() if ln.startswith(("PYTHONPATH ", "PACKAGE ")))
        assert got["PYTHONPATH"] == f"{REPO}{os.pathsep}{tmp_path / 'elsewhere'}"
        assert got["PACKAGE"] == str(REPO / "megatron_cegrpo")
