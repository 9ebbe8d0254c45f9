"""Shared-prefix packing (grpo/shared_prefix.py): the layout by hand, and an exact round trip on
ragged random groups."""

import pytest
import torch

from megatron_cegrpo.grpo.batch import pack_rollouts
from megatron_cegrpo.grpo.shared_prefix import pack_shared_prefix, packed_microbatch, rows_from_packed


def _batch(prompts, responses):
    n = len(prompts)
    return pack_rollouts(prompts, responses, [torch.zeros(len(r)) for r in responses], torch.zeros(n),
                         torch.zeros(n), pad_token_id=0, pad_to_multiple=1)


def test_layout_by_hand():
    # group 0: prompt [5, 6], responses [7] and [8, 9]; group 1: prompt [1, 2, 3], responses [4] and [10]
    b = _batch([torch.tensor([5, 6])] * 2 + [torch.tensor([1, 2, 3])] * 2,
               [torch.tensor([7]), torch.tensor([8, 9]), torch.tensor([4]), torch.tensor([10])])
    lay = pack_shared_prefix(b["tokens"], b["prompt_lengths"], b["response_lengths"], 2, pad_to_multiple=1)
    assert lay.tokens.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 10]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 2, 3], [0, 1, 2, 3, 3]]
    visible = (~lay.attention_mask[:, 0]).int().tolist()
    assert visible[0] == [[1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [1, 1, 1, 0, 0],   # r1[0]: the prompt and itself
                          [1, 1, 0, 1, 0],   # r2[0]: the prompt, not r1
                          [1, 1, 0, 1, 1]]
    assert visible[1] == [[1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [1, 1, 1, 0, 0],
                          [1, 1, 1, 1, 0],
                          [1, 1, 1, 0, 1]]
    # batch rows are [5 6 7 -], [5 6 8 9], [1 2 3 4], [1 2 3 10] (S = 4)
    assert lay.token_index.tolist() == [[0, 1, 2, -1], [0, 1, 3, 4], [0, 1, 2, 3], [0, 1, 2, 4]]
    # the logits at j score token j + 1: none for a row's last token; the last prompt position is shared
    assert lay.logit_index.tolist() == [[0, 1, -1, -1], [0, 1, 3, -1], [0, 1, 2, -1], [0, 1, 2, -1]]
    assert lay.seq_length == 5


def _random_groups(g, ngroups, seed):
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(ngroups):
        p = torch.randint(1, 50, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
        for _ in range(g):
            prompts.append(p)
            responses.append(torch.randint(1, 50, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen))
    return prompts, responses


@pytest.mark.parametrize("g", [1, 2, 4])
def test_round_trip_exact(g):
    prompts, responses = _random_groups(g, 3, seed=g)
    b = pack_rollouts(prompts, responses, [torch.zeros(len(r)) for r in responses], torch.zeros(len(prompts)),
                      torch.zeros(len(prompts)), pad_token_id=0)
    lay = pack_shared_prefix(b["tokens"], b["prompt_lengths"], b["response_lengths"], g)
    assert lay.seq_length % 8 == 0
    assert lay.seq_length >= max(len(prompts[k * g]) + sum(len(r) for r in responses[k * g:(k + 1) * g])
                                 for k in range(3))
    real = lay.token_index >= 0
    lengths = b["prompt_lengths"] + b["response_lengths"]
    assert real.sum(1).tolist() == lengths.tolist()
    assert torch.equal(rows_from_packed(lay.tokens, lay.token_index, g)[real], b["tokens"][real])
    assert torch.equal(rows_from_packed(lay.position_ids, lay.token_index, g)[real], b["position_ids"][real])
    # every response label is scored at a packed position; the loss mask lies inside the valid logits
    valid = lay.logit_index >= 0
    assert valid.sum(1).tolist() == (lengths - 1).tolist()
    assert bool((b["loss_mask"].bool() & ~valid).sum() == 0)
    # each packed token is read by the rows of its group: the prompt by all G, a response token by one
    counts = torch.zeros(lay.tokens.numel(), dtype=torch.long)
    grp = torch.arange(len(prompts)).div(g, rounding_mode="floor").unsqueeze(1).expand_as(real)
    counts.index_add_(0, (grp * lay.seq_length + lay.token_index)[real], torch.ones(int(real.sum()), dtype=torch.long))
    p_tot = sum(len(prompts[k * g]) for k in range(3))
    assert int((counts == g).sum()) == (p_tot if g > 1 else p_tot + sum(map(len, responses)))
    assert int(counts.sum()) == int(lengths.sum())
    mb = packed_microbatch(lay, g, 3 * g)
    assert torch.equal(mb["tokens"], lay.tokens[1:]) and mb["logit_index"].shape == (2 * g, b["tokens"].shape[1])


def test_rows_from_packed_gradient_adds_the_shared_position():
    x = torch.arange(10.0).reshape(1, 5, 2).requires_grad_(True)
    idx = torch.tensor([[0, 1], [0, 3]])
    y = rows_from_packed(x, idx, 2)
    assert y[:, :, 0].tolist() == [[0.0, 2.0], [0.0, 6.0]]
    y.sum().backward()
    assert x.grad[0, :, 0].tolist() == [2.0, 1.0, 0.0, 1.0, 0.0]


def test_refuses_groups_that_do_not_share_a_prompt():
    b = _batch([torch.tensor([5, 6]), torch.tensor([5, 7])], [torch.tensor([1]), torch.tensor([2])])
    with pytest.raises(ValueError, match="group 0"):
        pack_shared_prefix(b["tokens"], b["prompt_lengths"], b["response_lengths"], 2)
    with pytest.raises(ValueError, match="does not divide"):
        pack_shared_prefix(b["tokens"], b["prompt_lengths"], b["response_lengths"], 3)
    b4 = _batch([torch.tensor([5, 6])] * 4, [torch.tensor([1])] * 4)
    lay = pack_shared_prefix(b4["tokens"], b4["prompt_lengths"], b4["response_lengths"], 2)
    with pytest.raises(ValueError, match="cut a group"):
        packed_microbatch(lay, 1, 3)
