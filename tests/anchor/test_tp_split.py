"""The anchor's signs at tensor-parallel size 2 (issue 14, ``anchor/relay.py``'s TP hop).

Unit level, one process: a TP rank's slice of the whole-stage signs (``shard_signs``) is exactly
the matching slice of the whole tensor along megatron's partition dim (column-, row- and
vocab-parallel weights, the GLU fc1's gate/up halves), the whole tensor for a replicated norm, and
the TP ranks' slices merge back to the whole signs bit for bit.

Two real gloo processes (one stage's TP ranks): TP rank 0 holds the whole signs, its own hook gets
shard 0, TP rank 1's hook gets exactly shard 1 (new, unchanged, partial: no sign for a tensor
whose M is all 0, cleared with the anchor lost), and the bytes sent are the headers, the bitmap and
one packed shard.
"""

import os

import pytest
import torch

from distributed_util import REPO, run_ranks

from megatron_cegrpo.anchor.signs import packed_nbytes
from megatron_cegrpo.anchor.relay import shard_signs
from megatron_cegrpo.models.tp_shard import merge_tp_shards

WORKER = os.path.join(REPO, "tests", "anchor", "tp_split_worker.py")
NAMES = ["embedding.word_embeddings.weight", "output_layer.weight",
         "decoder.layers.1.self_attention.linear_qkv.weight", "decoder.layers.1.self_attention.linear_qkv.bias",
         "decoder.layers.1.self_attention.linear_proj.weight", "decoder.layers.1.mlp.linear_fc1.weight",
         "decoder.layers.1.mlp.linear_fc2.weight", "decoder.layers.1.input_layernorm.weight",
         "decoder.final_layernorm.weight"]
SHAPES = [(16, 4), (16, 4), (12, 4), (12,), (4, 8), (16, 4), (4, 8), (4,), (4,)]


def _whole(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.where(torch.rand(s, generator=gen) < 0.5, -1.0, 1.0) for s in SHAPES]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tp_ranks_slice_is_the_matching_slice_of_the_whole_signs(tp):
    whole = _whole()
    shards = [shard_signs(NAMES, whole, r, tp) for r in range(tp)]
    for r, shard in enumerate(shards):
        for name, w, s in zip(NAMES, whole, shard):
            if name.endswith("layernorm.weight"):  # replicated: the whole tensor on every TP rank
                assert s is w
            elif name.endswith("linear_fc1.weight"):  # GLU: rank r's gate rows, then its up rows
                gate, up = w.chunk(2, dim=0)
                n = gate.shape[0] // tp
                assert torch.equal(s, torch.cat([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]]))
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):  # row parallel: columns
                n = w.shape[1] // tp
                assert torch.equal(s, w[:, r * n:(r + 1) * n])
            else:  # column parallel and the vocab-parallel embedding / output layer: rows
                n = w.shape[0] // tp
                assert torch.equal(s, w[r * n:(r + 1) * n])
    merged = merge_tp_shards([dict(zip(NAMES, s)) for s in shards])
    assert all(torch.equal(merged[n], w) for n, w in zip(NAMES, whole))
    partial = shard_signs(NAMES, [None] + whole[1:], 1, tp)
    assert partial[0] is None and shard_signs(NAMES, None, 0, tp) is None
    with pytest.raises(ValueError, match="sign tensors for"):
        shard_signs(NAMES, whole[:-1], 0, tp)


def test_tp_rank_1_holds_exactly_its_slice_of_tp_rank_0s_signs(tmp_path):
    run_ranks([WORKER, str(tmp_path)], 2, timeout=600)
    lead, follow = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight",
             "decoder.layers.0.input_layernorm.weight"]
    whole = lead["whole"]
    assert follow["codes"] == [(True, 1), (True, 0), (True, 3), (False, 2)]
    for r, out in ((0, lead), (1, follow)):
        want = shard_signs(names, whole, r, 2)
        new, keep, partial, cleared = out["held"]
        assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(new, want)), r
        assert all(torch.equal(a, b) for a, b in zip(keep, want)), r
        assert partial[1] is None and all(torch.equal(partial[i], want[i]) for i in (0, 2, 3, 4)), r
        assert cleared is None, r
    # 4 headers of 16 bytes, one 1-byte bitmap of 5 tensors, two packed shards (new, partial)
    shard_numel = sum(torch.Size(s).numel() for s in follow["shapes"])
    assert lead["sent"] == 4 * 16 + 1 + 2 * packed_nbytes(shard_numel)
