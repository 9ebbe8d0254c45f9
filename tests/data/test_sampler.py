"""Tests for megatron_cegrpo.data.sampler.PromptSampler."""

from pathlib import Path

import pytest
import torch

_REPO = Path(__file__).resolve().parents[2]

from megatron_cegrpo.data import PromptSampler


def test_resume_gives_identical_batches():
    straight = PromptSampler(num_records=10, batch_size=4, seed=123)
    expected = [straight.next_batch() for _ in range(7)]  # 28 indices: crosses 2 epochs

    first = PromptSampler(num_records=10, batch_size=4, seed=123)
    got = [first.next_batch() for _ in range(3)]
    state = first.state_dict()
    assert state["epoch"] == 1 and state["position"] == 2 and state["seed"] == 123

    resumed = PromptSampler(num_records=10, batch_size=4, seed=123)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(4)]
    assert got == expected


def test_epochs_are_seeded_permutations_and_cross_boundaries():
    n, bs, seed = 7, 3, 5
    s = PromptSampler(n, bs, seed)
    flat = [i for _ in range(7) for i in s.next_batch()]  # 21 = 3 full epochs
    for e in range(3):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
        assert flat[e * n : (e + 1) * n] == perm
        assert sorted(perm) == list(range(n))
    assert s.state_dict()["epoch"] == 3 and s.state_dict()["position"] == 0
    # consecutive epochs are shuffled differently
    assert flat[:n] != flat[n : 2 * n]


def test_batch_larger_than_dataset():
    s = PromptSampler(3, 8, 0)
    b = s.next_batch()
    assert len(b) == 8
    assert sorted(b[:3]) == [0, 1, 2] and sorted(b[3:6]) == [0, 1, 2]
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 2


def test_deterministic_and_seed_dependent():
    a = [PromptSampler(50, 5, 1).next_batch() for _ in range(2)]
    assert a[0] == a[1]
    assert PromptSampler(50, 5, 1).next_batch() != PromptSampler(50, 5, 2).next_batch()


@pytest.mark.parametrize("num_records,batch_size,message", [(0, 4, "num_records must be > 0, got 0"),
                                                             (10, 0, "batch_size must be > 0, got 0"),
                                                             (10, -1, "batch_size must be > 0, got -1")])
def test_invalid_arguments(num_records, batch_size, message):
    with pytest.raises(ValueError, match=message):
        PromptSampler(num_records, batch_size, seed=0)


def test_load_state_rejects_mismatch():
    state = PromptSampler(10, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="records"):
        PromptSampler(11, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(10, 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        PromptSampler(10, 2, seed=1).load_state_dict({"epoch": 0, "position": 10, "seed": 1})


def test_resume_after_extra_draws_continues_the_same_prompt_order():
    """--filter-groups draws a varying number of batches per iteration; the state after any
    number of draws resumes the uninterrupted order (the sampler's part of a bit-exact resume)."""
    draws_per_iteration = [1, 3, 2, 4, 1]
    straight = PromptSampler(num_records=9, batch_size=4, seed=7)
    expected = [straight.next_batch() for _ in range(sum(draws_per_iteration))]
    s = PromptSampler(num_records=9, batch_size=4, seed=7)
    got = []
    for n in draws_per_iteration:  # a checkpoint after every iteration, resumed by a fresh sampler
        got += [s.next_batch() for _ in range(n)]
        state = s.state_dict()
        s = PromptSampler(num_records=9, batch_size=4, seed=7)
        s.load_state_dict(state)
    assert got == expected


def test_next_batch_of_another_size_continues_the_same_order():
    """``next_batch(size)`` (``--gen-batch-size`` rounds) takes the next ``size`` indices of the same
    epoch order, across an epoch boundary, and the default size continues after them."""
    ref = PromptSampler(7, 3, seed=5)
    flat = [i for _ in range(4) for i in ref.next_batch()]  # 12 indices: epoch 0 then 5 of epoch 1
    s = PromptSampler(7, 3, seed=5)
    assert s.next_batch(5) + s.next_batch(4) + s.next_batch() == flat
    assert (s.epoch, s.position) == (1, 5)
    with pytest.raises(ValueError, match="size must be > 0, got 0"):
        s.next_batch(0)
