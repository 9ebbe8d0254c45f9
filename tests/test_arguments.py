"""Start-up validation: each bad flag or combination names the flag."""

import argparse
import dataclasses
import json
import os
import re

import pytest

from megatron_cegrpo.arguments import ConfigError, TrainConfig, build_config, build_parser, option_of, parse_args


def cfg(*argv):
    return build_config(parse_args(list(argv)))


def test_defaults_validate_and_derived_sizes():
    c = cfg("--rollout-batch-size", "4", "--num-generations", "8", "--global-batch-size", "16",
            "--micro-batch-size", "4").validate(world_size=3)
    assert (c.grpo.sequences_per_iteration, c.global_batch_size) == (32, 16)
    assert c.num_microbatches == 4


@pytest.mark.parametrize("argv, match", [
    (["--micro-batch-size", "3"], "--micro-batch-size=3 must divide"),
    (["--global-batch-size", "5"], "--global-batch-size=5 must divide"),
    (["--temperature", "0"], "--temperature"),
    (["--boundary-keep-ratio", "1.5"], "--boundary-keep-ratio"),
    (["--train-iters", "0"], "--train-iters"),
    (["--clip-ratio-low", "1.0"], "--clip-ratio-low"),
    (["--lr-decay-style", "step"], "--lr-decay-style"),
    (["--min-lr", "1.0", "--lr", "1e-6"], "--min-lr"),
    (["--boundary-codec", "topk"], "--boundary-codec 'topk': unknown codec 'topk'"),
    (["--anchor-ranks", "2"], "--anchor-ranks"),
    (["--anchor-interval", "0"], "--anchor-interval"),
    (["--save-interval", "5"], "--save-interval needs --save"),
    (["--holdout-eval-interval", "40"], "^--holdout-eval-interval needs held-out rows; fix: add e.g. --num-holdout"),
    (["--holdout-eval-interval", "-1", "--num-holdout", "8"], "^--holdout-eval-interval must be an integer >= 0"),
])
def test_bad_flags_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        cfg(*argv).validate()


@pytest.mark.parametrize("argv, message", [
    # registries of grpo/core_algos.py
    (["--kl-loss-type", "bogus"], "--kl-loss-type must be one of abs, k1, k2, k3, kl, low_var_kl, mse; got 'bogus'"),
    (["--loss-agg-mode", "bogus"],
     "--loss-agg-mode must be one of seq-mean-token-mean, seq-mean-token-sum, token-mean; got 'bogus'"),
    # 0 used to mean "all", -4 reached a ZeroDivisionError
    (["--global-batch-size", "0"], "--global-batch-size must be an integer >= 1, got 0"),
    (["--global-batch-size", "-4"], "--global-batch-size must be an integer >= 1, got -4"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be a finite number >= 0 and < 1, got 1.5"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0, got 0.0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0, got -0.1"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number >= 0, got inf"),
    (["--kl-coef", "nan"], "--kl-coef must be a finite number >= 0, got nan"),
    (["--top-p", "0"], "--top-p must be a finite number > 0 and <= 1, got 0.0"),
    (["--num-threads", "-1"], "--num-threads must be an integer >= 1, got -1"),
    (["--eval-limit", "0"], "--eval-limit must be an integer >= 1, got 0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 4294967295], got -1"),
    (["--drift-probe-interval", "2", "--pipeline-model-parallel-size", "1", "--anchor-ranks", "0"],
     "--drift-probe-interval 2 probes nothing with --pipeline-model-parallel-size 1"),
    (["--prompt-template", "chatml"], "--prompt-template must be one of answer_is, boxed, plain; got 'chatml'"),
    (["--train-data-format", "csv"], "--train-data-format must be one of"),
    (["--keep-last", "2"], "--keep-last has no effect without --save"),
    (["--wandb-mode", "offline"], "--wandb-mode has no effect without --wandb-project"),
    (["--sign-blend-alpha", "0", "--sign-blend-beta", "0"], "--sign-blend-alpha and --sign-blend-beta are both 0"),
    (["--anchor-forecast-points", "1"], "--anchor-forecast-points must be an integer >= 2, got 1"),
    (["--anchor-forecast-damping", "-0.5"], "--anchor-forecast-damping must be a finite number >= 0, got -0.5"),
    (["--anchor-forecast-damping", "0.53", "--anchor-forecast", "lsq"],
     "--anchor-forecast-damping 0.53 scales the secant forecast's step, but this run replays with --anchor-replay "
     "forecast --anchor-forecast lsq"),
    (["--dense-step-interval", "-1"], "--dense-step-interval must be an integer >= 0, got -1"),
    (["--dense-step-interval", "4", "--pipeline-model-parallel-size", "1", "--anchor-ranks", "0"],
     "--dense-step-interval 4 makes nothing dense with --pipeline-model-parallel-size 1"),
    (["--dense-step-interval", "4", "--anchor-interval", "20", "--sign-fold", "fire-only"],
     "--dense-step-interval 4 divides --anchor-interval 20: every fire is a dense step"),
    (["--drift-controller", "--drift-probe-interval", "2"], "--drift-controller needs its band's upper edge; fix: "
     "pass --drift-target-kl HIGH"),
    (["--drift-controller", "--drift-target-kl", "0.01"],
     "--drift-controller acts on the drift probe's measurements, but --drift-probe-interval is 0"),
    (["--drift-target-kl", "0.01"], "--drift-target-kl has no effect without --drift-controller"),
    (["--drift-target-kl-low", "0.01"], "--drift-target-kl-low has no effect without --drift-controller"),
    (["--drift-controller", "--drift-target-kl", "0", "--drift-probe-interval", "2"],
     "--drift-target-kl must be a finite number > 0, got 0.0"),
    (["--drift-controller", "--drift-target-kl", "0.01", "--drift-target-kl-low", "0.02", "--drift-probe-interval", "2"],
     "--drift-target-kl-low must be a finite number >= 0 and <= 0.01, got 0.02"),
    (["--drift-controller", "--drift-target-kl", "0.01", "--drift-max-boundary-ratio", "1.5",
      "--drift-probe-interval", "2"], "--drift-max-boundary-ratio must be a finite number > 0 and <= 1, got 1.5"),
    (["--drift-probe-window", "1"], "--drift-probe-window must be an integer >= 2, got 1"),
    (["--decoder-first-pipeline-num-layers", "2", "--pipeline-model-parallel-size", "1", "--anchor-ranks", "0"],
     "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size >= 2"),
    (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_every_flag_is_checked_at_start_up(argv, message):
    """Each of these used to pass start-up (or fail only at the first update)."""
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        cfg(*argv).validate()
    msg = str(e.value)
    assert message in msg
    assert "fix:" in msg and "\n" not in msg


def test_deepspeed_values_are_checked_and_named(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": -1.0, "betas": [0.9, 0.999]}}}))
    with pytest.raises(ConfigError, match=r"--lr \(from optimizer.params.lr in .*ds.json\) must be a finite number > 0, got -1.0"):
        cfg("--deepspeed_config", str(p)).validate()
    p.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}))
    with pytest.raises(ConfigError, match="optimizer.params.betas must be a list of two numbers, got 0.9"):
        cfg("--deepspeed_config", str(p))


def test_global_batch_size_unset_means_all_sequences():
    c = cfg("--rollout-batch-size", "2", "--num-generations", "4").validate()
    assert c.global_batch_size == 8 == c.grpo.sequences_per_iteration


def test_resume_options_leave_out_what_has_no_effect():
    plain = cfg("--anchor-ranks", "0", "--kl-coef", "0").resume_options()
    assert "--train-iters" not in plain and "--min-lr" not in plain  # constant LR: may train longer
    assert "--kl-loss-type" not in plain and "--anchor-interval" not in plain
    assert plain["--lr"] == 1e-6 and plain["--seed"] == 1234 and plain["--anchor-ranks"] == 0
    assert plain["--global-batch-size"] == 16 and plain["--no-norm-adv-by-std"] is False
    decay = cfg("--lr-decay-style", "cosine", "--train-iters", "30", "--no-norm-adv-by-std").resume_options()
    assert decay["--train-iters"] == 30 and decay["--min-lr"] == 0.0 and decay["--anchor-interval"] == 20
    assert decay["--no-norm-adv-by-std"] is True
    # the shipment's rounding shapes G_anc: recorded with an anchor, not without one
    assert decay["--anchor-ship"] == "int4-delta" and "--anchor-ship" not in plain
    assert "--anchor-nice" not in decay and "--anchor-timeout-minutes" not in decay
    # the length penalty's factor only counts with a buffer; the buffer (0: off) is always recorded
    assert plain["--overlong-buffer-len"] == 0 and "--overlong-penalty-factor" not in plain
    shaped = cfg("--overlong-buffer-len", "16", "--overlong-penalty-factor", "0.5").resume_options()
    assert (shaped["--overlong-buffer-len"], shaped["--overlong-penalty-factor"]) == (16, 0.5)
    # dynamic sampling's bound and round size count only with it; the round size as used (default: the batch)
    assert "--max-num-gen-batches" not in plain and "--gen-batch-size" not in plain
    rounds = cfg("--filter-groups", "--rollout-batch-size", "3").resume_options()
    assert (rounds["--max-num-gen-batches"], rounds["--gen-batch-size"]) == (4, 3)
    assert cfg("--filter-groups", "--rollout-batch-size", "3", "--gen-batch-size", "9").resume_options()[
        "--gen-batch-size"] == 9
    # the held-out split's seed is recorded as used: --seed unless --holdout-seed fixes it
    assert plain["--holdout-seed"] == 1234
    fixed = cfg("--seed", "7", "--holdout-seed", "1234")
    assert fixed.resume_options()["--holdout-seed"] == 1234 == fixed.holdout_split_seed
    assert cfg("--seed", "7").holdout_split_seed == 7
    # every recorded name is a real flag of the parser (or the DeepSpeed key)
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert set(decay) - flags == {"optimizer.type in --deepspeed_config"}


def test_resume_options_record_the_drift_controller_when_on():
    off = cfg("--drift-probe-interval", "2").resume_options()
    assert off["--drift-controller"] is False and "--drift-target-kl" not in off and "--drift-probe-interval" not in off
    on = cfg("--drift-controller", "--drift-target-kl", "0.004", "--drift-probe-interval", "5").resume_options()
    assert (on["--drift-controller"], on["--drift-target-kl"], on["--drift-target-kl-low"]) == (True, 0.004, 0.002)
    assert on["--drift-max-boundary-ratio"] == 0.1 and on["--drift-probe-interval"] == 5  # its cadence
    # the base model: a stage keeps it for a KL term or for the probe
    assert cfg("--kl-coef", "0").keeps_base_model is False
    assert cfg("--kl-coef", "0", "--drift-probe-interval", "2").keeps_base_model is True


def test_reliability_doc_lists_every_resume_option():
    """docs/reliability.md's list of the recorded options names every key resume_options() can hold
    (every option on, so that the ones recorded only with another appear): the anchor's flags as
    "every anchor flag", the drift controller's band and budget as "the controller's band, byte
    budget", the optimizer's two betas and the two clip ratios in the doc's a/b shorthand."""
    from megatron_cegrpo.arguments import AnchorConfig, flag_name
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "reliability.md")).read()
    listed = doc[doc.index("Every checkpoint records in `meta.json`"):doc.index("Intended overrides:")]
    everything = cfg("--lr-decay-style", "cosine", "--kl-coef", "0.1", "--filter-groups", "--overlong-buffer-len", "4",
                     "--rollout-rs", "token", "--rollout-rs-threshold", "2", "--drift-controller", "--drift-target-kl", "0.1", "--drift-probe-interval", "2",
                     "--anchor-ranks", "1").resume_options()
    anchor = {flag_name(AnchorConfig, n) for n in AnchorConfig.RESUME} - {"--anchor-ranks"}
    band = {"--drift-target-kl", "--drift-target-kl-low", "--drift-max-boundary-ratio"}
    shorthand = {"--adam-beta2": "--adam-beta1/2", "--adam-beta1": "--adam-beta1/2",
                 "--clip-ratio-low": "--clip-ratio-low/high", "--clip-ratio-high": "--clip-ratio-low/high",
                 "optimizer.type in --deepspeed_config": "the DeepSpeed optimizer type"}
    assert "every anchor flag but the operational" in listed and "the controller's band, byte budget" in listed
    fields = {f.name for f in dataclasses.fields(AnchorConfig)}
    assert fields == set(AnchorConfig.RESUME) | set(AnchorConfig.OPERATIONAL), \
        "an anchor flag is neither recorded for resume nor declared operational"
    operational = listed[listed.index("every anchor flag but the operational"):].split("(so")[0]
    assert sorted(re.findall(r"--[\w-]+", operational)) == sorted(flag_name(AnchorConfig, n)
                                                              for n in AnchorConfig.OPERATIONAL)
    missing = [k for k in set(everything) - anchor - band
               if not re.search(re.escape(shorthand.get(k, k)) + r"(?![\w-])", listed)]
    assert not missing, f"docs/reliability.md does not list the resume options {sorted(missing)}"


def test_world_size_must_match_pipeline_plus_anchor():
    with pytest.raises(ValueError, match=r"--num_gpus 3"):
        cfg("--pipeline-model-parallel-size", "2").validate(world_size=2)
    cfg("--pipeline-model-parallel-size", "2").validate(world_size=3)
    cfg("--pipeline-model-parallel-size", "2", "--anchor-ranks", "0").validate(world_size=2)


def test_deepspeed_config_values_and_conflicts(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {
        "lr": 3e-6, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}}}))
    c = cfg("--deepspeed_config", str(p))
    o = c.optim
    assert (o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay, o.clip_grad) == (
        3e-6, 0.8, 0.95, 1e-6, 0.1, 0.5)
    assert cfg("--deepspeed_config", str(p), "--lr", "3e-6").optim.lr == 3e-6  # agreeing is fine
    with pytest.raises(ValueError, match="--lr=1e-05 conflicts"):
        cfg("--deepspeed_config", str(p), "--lr", "1e-5")
    p.write_text(json.dumps({"optimizer": {"type": "Lamb"}}))
    with pytest.raises(ValueError, match="Lamb"):
        cfg("--deepspeed_config", str(p))
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        cfg("--deepspeed_config", str(p))
    with pytest.raises(ValueError, match="no such file"):
        cfg("--deepspeed_config", str(tmp_path / "missing.json"))


def test_unused_deepspeed_keys_warn(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam"}}))
    with pytest.warns(UserWarning, match="train_micro_batch_size_per_gpu"):
        c = cfg("--deepspeed_config", str(p))
    assert c.optim.optimizer == "adam"


def test_every_flag_has_a_help_sentence():
    """``--help`` explains every flag; only the launcher's own flags are hidden."""
    hidden = set()
    for a in build_parser()._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        assert isinstance(a.help, str) and a.help.strip(), f"{a.option_strings} has no help"
        if a.help == argparse.SUPPRESS:
            hidden.update(a.option_strings)
    assert hidden == {"--local_rank", "--local-rank", "--deepspeed"}


def test_every_field_is_reachable_from_exactly_one_flag():
    """Each field of each sub-config is set by one flag (its own), or is marked internal
    (``cli=False``: set from the DeepSpeed JSON); no flag sets two fields."""
    actions = [a for a in build_parser()._actions if a.option_strings and a.help != argparse.SUPPRESS
               and not isinstance(a, argparse._HelpAction)]
    by_dest = {}
    for a in actions:
        assert a.dest not in by_dest, f"{a.option_strings} and {by_dest[a.dest].option_strings} share {a.dest}"
        by_dest[a.dest] = a
    claimed = set()
    internal = []
    for section in dataclasses.fields(TrainConfig):
        cls = section.default_factory
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), f"{cls.__name__} has no docstring"
        for f in dataclasses.fields(cls):
            opt = option_of(cls, f.name)
            assert opt.help.strip(), f"{cls.__name__}.{f.name} has no help"
            if not opt.cli:
                internal.append((cls.__name__, f.name))
                continue
            hits = [a for a in actions if a.dest == (opt.dest or f.name)]
            assert len(hits) == 1, f"{cls.__name__}.{f.name} is set by {len(hits)} flags"
            assert hits[0].option_strings[0] == (opt.flag or "--" + f.name.replace("_", "-"))
            claimed.add(hits[0].dest)
    assert set(by_dest) == claimed, f"flags that set no field: {set(by_dest) - claimed}"
    assert internal == [("OptimConfig", "optimizer")]


def test_a_flag_sets_its_field():
    """Changing one flag away from its default changes exactly its field in to_dict()."""
    base = cfg().to_dict()
    for argv, section, name, value in [
        (["--kl-coef", "0.5"], "grpo", "kl_coef", 0.5),
        (["--rollout-engine", "hf"], "rollout", "engine", "hf"),
        (["--no-tqdm"], "logging", "tqdm", False),
        (["--no-norm-adv-by-std"], "grpo", "norm_adv_by_std", False),
        (["--anchor-delay", "40"], "anchor", "anchor_delay", 40),
        (["--adam-beta1", "0.5"], "optim", "adam_beta1", 0.5),
    ]:
        got = cfg(*argv).to_dict()
        assert got[section][name] == value
        got[section][name] = base[section][name]
        assert got == base, argv


def test_shared_prefix_needs_whole_groups_per_micro_batch():
    """--shared-prefix packs a group into one sequence: a micro-batch holds whole groups or the
    launch is refused with one line naming both flags and the fix."""
    assert cfg().parallel.shared_prefix is False
    ok = cfg("--shared-prefix", "--rollout-batch-size", "4", "--num-generations", "4", "--micro-batch-size", "8",
             "--global-batch-size", "16").validate()
    assert ok.parallel.shared_prefix is True
    with pytest.raises(ConfigError, match=r"^--shared-prefix runs the 4 responses .* --micro-batch-size=2 is not a "
                                          r"multiple of --num-generations=4; fix: pass --micro-batch-size 4 .*$"):
        cfg("--shared-prefix", "--rollout-batch-size", "4", "--num-generations", "4", "--micro-batch-size", "2",
            "--global-batch-size", "16").validate()
