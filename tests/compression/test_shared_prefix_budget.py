"""The start-up byte-budget check under ``--shared-prefix`` (``plan.check_codec_budget``): a message
is then a packed group ``[max prompt + G x max new tokens, mbs / G, d]``, not ``[max prompt + max
new tokens, mbs, d]``, so a per-step basis is paid from fewer bytes. At the main job's settings
(SmolLM2's d = 576, G = 8, 64 new tokens, bf16, micro-batches of one group) ``pcaq/every=2:lrq``
fits the budget unshared (5.03 % forward, the mask's 29 of 576) and not shared (6.49 %); the mask fits both."""

import pytest

from megatron_cegrpo import plan
from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.compression import build_codec
from megatron_cegrpo.errors import ConfigError

MAIN_JOB = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "8", "--rollout-batch-size", "4",
            "--num-generations", "8", "--max-new-tokens", "64", "--kl-coef", "0", "--bf16"]


def _check(codec: str, *extra: str) -> None:
    cfg = build_config(parse_args(MAIN_JOB + ["--boundary-codec", codec, *extra]))
    plan.check_codec_budget(cfg, build_codec(codec, 0.05, warn=False), 576)


def test_shared_prefix_checks_the_packed_message():
    _check("pcaq/every=2:lrq")
    _check("mask")
    _check("mask", "--shared-prefix")
    with pytest.raises(ConfigError, match="^--boundary-codec pcaq/every=2:lrq exceeds --boundary-keep-ratio") as e:
        _check("pcaq/every=2:lrq", "--shared-prefix")
    msg = str(e.value)
    # 256-token prompts + 8 x 64 = 768 tokens, one group a micro-batch, 4 micro-batches an iteration;
    # every=2: the basis rides on the window's first message, so a step pays half of it (rounded up)
    # on top of 4 messages without it
    fwd = build_codec("pcaq/every=2:lrq", 0.05, warn=False).fwd
    first, later = fwd.nbytes((768, 1, 576), 2, True), fwd.nbytes((768, 1, 576), 2, False)
    sent = 4 * later + -(-(first - later) // 2)
    assert (first, later, sent) == (186884, 38916, 229648)  # pinned: a change of the half's sizes shows here
    dense = 4 * 768 * 1 * 576 * 2  # bf16
    assert f"forward sends {sent} B per step ({100 * sent / dense:.2f}% of dense)" in msg, msg
    assert f"{100 * sent / dense:.2f}" == "6.49" and "(768, 1, 576) x 4" in msg, msg
    assert msg.endswith("or drop --shared-prefix") and "\n" not in msg
