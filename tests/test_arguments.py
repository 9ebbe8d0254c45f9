"""Start-up validation: each bad flag or combination names the flag."""

import json

import pytest

from megatron_cegrpo.arguments import build_config, parse_args


def cfg(*argv):
    return build_config(parse_args(list(argv)))


def test_defaults_validate_and_derived_sizes():
    c = cfg("--rollout-batch-size", "4", "--num-generations", "8", "--global-batch-size", "16",
            "--micro-batch-size", "4").validate(world_size=3)
    assert c.grpo.sequences_per_iteration == 32
    assert (c.num_minibatches, c.num_microbatches) == (2, 4)


@pytest.mark.parametrize("argv, match", [
    (["--micro-batch-size", "3"], "--micro-batch-size=3 must divide"),
    (["--global-batch-size", "5"], "--global-batch-size=5 must divide"),
    (["--temperature", "0"], "--temperature"),
    (["--boundary-keep-ratio", "1.5"], "--boundary-keep-ratio"),
    (["--train-iters", "0"], "--train-iters"),
    (["--clip-ratio-low", "1.0"], "--clip-ratio-low"),
    (["--lr-decay-style", "step"], "--lr-decay-style"),
    (["--min-lr", "1.0", "--lr", "1e-6"], "--min-lr"),
    (["--boundary-codec", "topk"], "--boundary-codec must be one of dense, mask"),
    (["--anchor-ranks", "2"], "--anchor-ranks"),
    (["--anchor-interval", "0"], "--anchor-interval"),
    (["--save-interval", "5"], "--save-interval needs --save"),
])
def test_bad_flags_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        cfg(*argv).validate()


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
