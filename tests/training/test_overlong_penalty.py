"""DAPO's soft overlong punishment (``--overlong-buffer-len``): the penalty's values against
DAPO eq. (13) by hand, the driver's advantages computed from score + penalty, its metrics, and
the start-up checks (``grpo/core_algos.overlong_penalty``, ``Driver._pack``; no model is loaded)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.metrics import PhaseTimers
from megatron_cegrpo.rollout.base import RolloutOutput

from driver_double import bare_driver


def test_penalty_is_dapo_eq_13():
    # L_max 64, L_cache 16: free up to 48 tokens, then -1/16 a token, -1 at 64
    lengths = torch.tensor([1, 48, 49, 56, 64])
    assert ca.overlong_penalty(lengths, 64, 16).tolist() == [0.0, 0.0, -1 / 16, -0.5, -1.0]
    assert ca.overlong_penalty(lengths, 64, 16, 0.5).tolist() == [0.0, 0.0, -1 / 32, -0.25, -0.5]
    assert ca.overlong_penalty(lengths, 64, 16, 0.0).abs().sum() == 0
    # verl allows L_cache = L_max: every token is penalised
    assert ca.overlong_penalty(torch.tensor([0, 32, 64]), 64, 64).tolist() == [0.0, -0.5, -1.0]
    for bad in (0, 65):
        with pytest.raises(ValueError, match="buffer_len must be in"):
            ca.overlong_penalty(lengths, 64, bad)


class LengthEngine:
    """Response j of a group has 2 + 20 j tokens (2, 22, 42, 62) and scores 1 when j is odd."""

    pad_token_id = 0

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, generator_seed):
        n = len(prompts)
        resp = [torch.full((2 + 20 * (i % 4),), 5) for i in range(n)]
        return RolloutOutput(list(prompts), resp, [torch.zeros(len(r)) for r in resp],
                             [str(i % 4 % 2) for i in range(n)], torch.ones(n, dtype=torch.bool))


def _driver(*flags, verifier=lambda response, gt: float(response == gt)):
    cfg = build_config(parse_args(["--rollout-batch-size", "2", "--num-generations", "4", "--max-new-tokens", "64",
                                   *flags])).validate()
    records = [SimpleNamespace(question=f"q{i}", ground_truth="1", verifier="fake") for i in range(4)]
    return bare_driver(cfg, LengthEngine(), records, verifier, max_position_embeddings=256)


def test_advantages_come_from_score_plus_penalty_and_scores_stay_the_verifiers():
    d = _driver("--overlong-buffer-len", "32", "--overlong-penalty-factor", "1.0")
    batch = d.generate_and_score(1, PhaseTimers())
    scores = torch.tensor([0.0, 1.0, 0.0, 1.0] * 2)
    penalty = torch.tensor([0.0, 0.0, -10 / 32, -30 / 32] * 2)  # lengths 2, 22, 42, 62 past 32 free tokens
    assert torch.equal(batch["scores"], scores)
    want = ca.compute_grpo_outcome_advantage(scores + penalty, 4)
    seq_adv = batch["advantages"].sum(1) / batch["loss_mask"].sum(1)
    torch.testing.assert_close(seq_adv, want)
    # without the penalty the two long responses would tie with the short ones of their score
    assert not torch.allclose(want, ca.compute_grpo_outcome_advantage(scores, 4))
    m = d.rollout_metrics()
    assert m["critic/rewards/mean"] == pytest.approx(float((scores + penalty).mean()))
    assert m["critic/rewards/min"] == pytest.approx(-10 / 32)
    assert m["response_length/overlong_penalty"] == pytest.approx(-40 / 32 / 4)
    assert m["response_length/overlong_frac"] == 0.5
    assert m["response_length/length_only_groups"] == 0  # both groups have mixed scores


def test_groups_tied_on_the_score_train_on_length_alone():
    """Every answer wrong: the verifier ties both groups, the penalty unties them (lengths 42 and 62
    past 32 free tokens), and the std division makes the length spread unit-sized advantages."""
    d = _driver("--overlong-buffer-len", "32", verifier=lambda response, gt: 0.0)
    batch = d.generate_and_score(1, PhaseTimers())
    assert d.rollout_metrics()["response_length/length_only_groups"] == 2
    seq_adv = batch["advantages"].sum(1) / batch["loss_mask"].sum(1)
    penalty = torch.tensor([0.0, 0.0, -10 / 64, -30 / 64] * 2)  # factor 0.5
    torch.testing.assert_close(seq_adv, ca.compute_grpo_outcome_advantage(penalty, 4))
    assert float(seq_adv.abs().max()) > 1.0  # a spread of 0.47 in reward, advantages past 1
    # every answer inside the free length: the groups stay tied, no advantage at all
    d = _driver("--overlong-buffer-len", "2", verifier=lambda response, gt: 0.0)  # free up to 62 tokens
    batch = d.generate_and_score(1, PhaseTimers())
    assert d.rollout_metrics()["response_length/length_only_groups"] == 0
    assert batch["advantages"].abs().sum() == 0


def test_default_factor_is_half_a_correct_answer():
    """Scores here are 0/1 where DAPO's are +-1: the default factor 0.5 keeps verl's 1.0 relative to
    the gap between a right and a wrong answer (a right answer cut at the limit is worth 0.5)."""
    d = _driver("--overlong-buffer-len", "16")
    assert d.cfg.grpo.overlong_penalty_factor == 0.5
    assert float(1 + ca.overlong_penalty(torch.tensor([64]), 64, 16, d.cfg.grpo.overlong_penalty_factor)) == 0.5


def test_off_by_default_leaves_advantages_of_the_scores():
    d = _driver()
    batch = d.generate_and_score(1, PhaseTimers())
    seq_adv = batch["advantages"].sum(1) / batch["loss_mask"].sum(1)
    torch.testing.assert_close(seq_adv, ca.compute_grpo_outcome_advantage(batch["scores"], 4))
    assert d.rollout_metrics() == {}


@pytest.mark.parametrize("flags, match", [
    (["--overlong-buffer-len", "65"], r"--overlong-buffer-len 65 exceeds --max-new-tokens 64.*fix: pass "
                                      r"--overlong-buffer-len 16 or another value up to 64, or 0 \(off\)"),
    (["--overlong-buffer-len", "-1"], r"--overlong-buffer-len"),
    (["--overlong-buffer-len", "8", "--overlong-penalty-factor", "-0.5"], r"--overlong-penalty-factor"),
])
def test_bad_settings_are_refused_with_one_line(flags, match):
    with pytest.raises(ConfigError, match=match):
        build_config(parse_args(["--max-new-tokens", "64", *flags])).validate()
