"""models/tp_shard.py on whole stage state dicts (no processes; the layout itself is checked
against megatron's TP layers in tests/pipeline/test_tensor_parallel.py)."""

import pytest
import torch

from megatron_cegrpo.models import hf_to_megatron, load_hf_state_dict, resolve_model, transformer_config_from_hf
from megatron_cegrpo.models.builder import check_tensor_parallel
from megatron_cegrpo.models.name_map import pack_qkv
from megatron_cegrpo.models.tp_shard import merge_tp_shards, partition_dim, shard_stage_state_dict


@pytest.fixture(scope="module")
def qwen2():
    cfg, sd = load_hf_state_dict(resolve_model("tiny-qwen2"))
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=2, perform_initialization=False)
    return cfg, sd, [hf_to_megatron(sd, cfg, tf, r, 2) for r in range(2)]


def test_shard_merge_round_trip_is_exact(qwen2):
    _, _, stages = qwen2
    for stage in stages:
        shards = [shard_stage_state_dict(stage, r, 2) for r in range(2)]
        merged = merge_tp_shards(shards)
        assert merged.keys() == stage.keys() and all(torch.equal(merged[k], stage[k]) for k in stage)


def test_qkv_and_fc1_shards_hold_whole_groups_and_glu_halves(qwen2):
    cfg, sd, stages = qwen2
    shard = shard_stage_state_dict(stages[0], 1, 2)
    # tiny: 4 heads in 2 KV groups, head_dim 16 -> TP rank 1 holds group 1: q heads 2, 3 with k_1, v_1
    hd = 16
    q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv")
    want = torch.cat([q[2 * hd:4 * hd], k[hd:2 * hd], v[hd:2 * hd]])
    assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.bias"], want)
    assert torch.equal(want, pack_qkv(q, k, v, cfg)[want.numel():])
    ffn = cfg.intermediate_size
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(shard["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([gate[ffn // 2:], up[ffn // 2:]]))
    assert torch.equal(shard["decoder.layers.0.mlp.linear_fc2.weight"],
                       sd["model.layers.0.mlp.down_proj.weight"][:, ffn // 2:])
    assert shard["decoder.layers.0.input_layernorm.weight"] is stages[0]["decoder.layers.0.input_layernorm.weight"]
    assert partition_dim("module.decoder.layers.3.self_attention.linear_qkv.bias") == 0
    assert partition_dim("decoder.final_layernorm.weight") is None


def test_bad_tp_sizes(qwen2):
    cfg, _, stages = qwen2
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size=3 does not divide the model's 4 attention "
                                         r"heads and 2 KV heads .* choose one of 1, 2"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="out of range"):
        shard_stage_state_dict(stages[0], 2, 2)
    with pytest.raises(KeyError, match="TP shard 1"):
        merge_tp_shards([stages[0], stages[1]])
