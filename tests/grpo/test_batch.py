"""Packing rollouts: alignment of labels, masks, sampler log-probs and advantages."""

import pytest
import torch

from megatron_cegrpo.grpo.batch import microbatches, pack_rollouts


def test_pack_alignment_by_hand():
    prompts = [torch.tensor([10, 11, 12]), torch.tensor([20])]
    responses = [torch.tensor([13, 14]), torch.tensor([21, 22, 23])]
    lps = [torch.tensor([-0.5, -0.25]), torch.tensor([-1.0, -2.0, -3.0])]
    b = pack_rollouts(prompts, responses, lps, torch.tensor([1.0, 0.0]), torch.tensor([0.7, -0.7]),
                      pad_token_id=0, pad_to_multiple=8)
    assert b["tokens"].shape == (2, 8)
    assert b["tokens"][0, :5].tolist() == [10, 11, 12, 13, 14]
    assert b["tokens"][1, :4].tolist() == [20, 21, 22, 23]
    # logits at position j score labels[j] = tokens[j + 1]; mask marks response labels
    assert b["labels"][0, :4].tolist() == [11, 12, 13, 14]
    assert b["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert b["loss_mask"][1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert b["labels"][1, :3].tolist() == [21, 22, 23]
    assert b["sampler_logprobs"][0, 2:4].tolist() == [-0.5, -0.25]
    assert b["sampler_logprobs"][1, :3].tolist() == [-1.0, -2.0, -3.0]
    assert torch.allclose(b["advantages"][0], 0.7 * b["loss_mask"][0])
    assert b["response_lengths"].tolist() == [2, 3]
    assert b["sample_ids"].tolist() == [0, 1]


def test_pack_rejects_too_long_and_split_checks():
    with pytest.raises(ValueError, match="--max-new-tokens"):
        pack_rollouts([torch.arange(6)], [torch.arange(4)], [torch.zeros(4)], torch.zeros(1), torch.zeros(1),
                      pad_token_id=0, max_seq_length=8)
    b = pack_rollouts([torch.arange(3)] * 4, [torch.arange(2)] * 4, [torch.zeros(2)] * 4, torch.zeros(4),
                      torch.zeros(4), pad_token_id=0)
    mbs = microbatches(b, 2)
    assert len(mbs) == 2 and mbs[1]["sample_ids"].tolist() == [2, 3]
    with pytest.raises(ValueError, match="--micro-batch-size=3"):
        microbatches(b, 3)
