"""The sparse tied-embedding exchange at TP > 1 (``TiedEmbeddingSync._ids``): each TP rank's rows are
the batch's tokens inside its vocabulary slice, as local row indices; the TP ranks' rows together
are the TP = 1 rows, each once. No process group (the ids are what both ends compute)."""

from types import SimpleNamespace

import torch

from megatron_cegrpo.pipeline.tied_embedding import TiedEmbeddingSync


def _sync(tp_rank, tp_size, vocab=12):
    s = TiedEmbeddingSync.__new__(TiedEmbeddingSync)  # only the fields _ids reads
    s.tp_rank, s.tp_size = tp_rank, tp_size
    s.weight = SimpleNamespace(shape=(vocab // tp_size, 4))
    return s


def test_each_tp_rank_takes_its_vocabulary_slice_as_local_rows():
    tokens = torch.tensor([[11, 0, 5, 5], [6, 3, 11, 7]])
    assert _sync(0, 1)._ids(tokens).tolist() == [0, 3, 5, 6, 7, 11]
    assert _sync(0, 2)._ids(tokens).tolist() == [0, 3, 5]  # rows 0..5
    assert _sync(1, 2)._ids(tokens).tolist() == [0, 1, 5]  # rows 6..11 -> 0..5
    parts = [_sync(r, 3)._ids(tokens) + r * 4 for r in range(3)]
    assert torch.cat(parts).tolist() == _sync(0, 1)._ids(tokens).tolist()  # every TP = 1 row once


def test_a_slice_without_tokens_has_no_rows():
    assert _sync(1, 2)._ids(torch.tensor([[1, 2]])).numel() == 0
