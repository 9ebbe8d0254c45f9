"""DAPO's dynamic sampling (``--filter-groups``): the group filter's pure functions
(``grpo/dynamic_sampling.py``) and the tie rule they share with the advantage (``core_algos``)."""

import pytest
import torch

from megatron_cegrpo.grpo import core_algos as ca
from megatron_cegrpo.grpo.dynamic_sampling import ROUND_SEED_STRIDE, enough_mixed, round_seed, select_groups


def _flags(*bits):
    return torch.tensor([bool(b) for b in bits])


def test_tied_groups_on_a_synthetic_score_tensor():
    # G = 4; groups: all 0, mixed, all 1, all 0.35 (fp32 rounding: still tied), nearly equal but mixed
    scores = torch.tensor([0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1, .35, .35, .35, .35, 1, 1, 1, 1.001])
    tied = ca.tied_groups(scores, 4)
    assert tied.tolist() == [True, False, True, True, False]
    # the same rule as the advantage: a tied group's advantages are exactly 0, a mixed one's are not
    for norm in (True, False):
        adv = ca.compute_grpo_outcome_advantage(scores, 4, norm_adv_by_std=norm).reshape(-1, 4)
        assert ((adv == 0).all(dim=1) == tied).all()
    assert ca.tied_groups(torch.tensor([1, 2, 3]), 1).tolist() == [True, True, True]
    assert ca.tied_groups(torch.tensor([1, 1, 0, 1], dtype=torch.int64), 2).tolist() == [True, False]
    with pytest.raises(ValueError, match="scores must be 1-D with a length divisible by group_size=4"):
        ca.tied_groups(torch.zeros(6), 4)


def test_kept_groups_are_the_first_mixed_in_draw_order():
    # B = 3; round 0 has one mixed group (1), round 1 three: the third of them is surplus
    rounds = [_flags(1, 0, 1), _flags(0, 0, 0)]
    assert not enough_mixed(rounds[:1], 3) and enough_mixed(rounds, 3)
    sel = select_groups(rounds, 3)
    assert sel.groups == ((0, 1), (1, 0), (1, 1))
    assert (sel.kept, sel.filled_with_tied, sel.tied_dropped, sel.mixed_unused, sel.rounds) == (3, 0, 2, 1, 2)
    m = sel.metrics()
    assert m == {"batch/num_gen_batches": 2, "batch/kept_groups": 3, "batch/tied_groups_dropped": 2,
                 "batch/filled_with_tied": 0, "batch/mixed_groups_unused": 1}
    assert m["batch/num_gen_batches"] * 3 == sum(v for k, v in m.items() if k != "batch/num_gen_batches")


def test_bound_hit_fills_with_the_newest_tied_groups():
    # B = 4, the bound allowed 3 rounds with 2 mixed groups in all: the newest 2 tied groups fill,
    # the last round's last tied group first, and the batch is in draw order
    rounds = [_flags(1, 0, 1, 1), _flags(1, 1, 1, 1), _flags(1, 1, 0, 1)]
    sel = select_groups(rounds, 4)
    assert sel.groups == ((0, 1), (2, 1), (2, 2), (2, 3))
    assert (sel.kept, sel.filled_with_tied, sel.tied_dropped, sel.mixed_unused, sel.rounds) == (2, 2, 8, 0, 3)
    # every group tied: the whole last round
    sel = select_groups([_flags(1, 1), _flags(1, 1)], 2)
    assert sel.groups == ((1, 0), (1, 1)) and sel.filled_with_tied == 2 and sel.kept == 0


def test_one_mixed_round_is_the_unfiltered_batch():
    sel = select_groups([_flags(0, 0, 0)], 3)
    assert sel.groups == ((0, 0), (0, 1), (0, 2)) and sel.rounds == 1 and sel.kept == 3


def test_select_groups_rejects_bad_input():
    with pytest.raises(ValueError, match="1 groups drawn in 1 rounds, fewer than the batch's 2"):
        select_groups([_flags(0)], 2)  # fewer groups drawn than the batch holds
    with pytest.raises(ValueError, match="round 0: tie flags must be a 1-D bool tensor, got torch.float32"):
        select_groups([torch.zeros(2)], 1)  # not bool
    with pytest.raises(ValueError, match="batch_groups must be >= 1, got 0"):
        enough_mixed([], 0)


def test_round_seed_keeps_round_zero_and_separates_rounds():
    assert round_seed(1234, 7, 0) == 1234 * 1_000_003 + 7  # the seed of a run without the filter
    seeds = {round_seed(5, t, r) for t in range(1, 50) for r in range(4)}
    assert len(seeds) == 49 * 4
    assert round_seed(2**32 - 1, 10**6, 64) < 2**63 and ROUND_SEED_STRIDE > 10**6
