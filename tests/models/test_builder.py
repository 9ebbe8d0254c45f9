"""models/: --model resolution, TransformerConfig mapping, stage splits, name map, loading.

Also runnable as a script: ``python test_builder.py --pp-worker OUT`` is one rank of the
2-process real-pipeline-group test below.
"""

import os
import re
import sys

import pytest
import torch

from megatron_cegrpo.models import (
    ModelSource,
    StageRankGroup,
    build_stage,
    hf_to_megatron,
    load_hf_config,
    load_hf_state_dict,
    load_stage_weights,
    load_tokenizer,
    megatron_to_hf,
    resolve_model,
    stage_layer_range,
    transformer_config_from_hf,
)
from megatron_cegrpo.models.hf_config import SMOLLM2_GGUF
from megatron_cegrpo.models.name_map import pack_qkv, unpack_qkv

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_llama():
    return load_hf_state_dict(resolve_model("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_qwen2():
    return load_hf_state_dict(resolve_model("tiny-qwen2"))


@pytest.fixture(scope="module")
def smollm2():
    return load_hf_state_dict(resolve_model("smollm2-135m-instruct"))


# ----------------------------------------------------------------------------- --model


def test_resolve_model_accepted_forms(tmp_path):
    s = resolve_model("smollm2-135m-instruct")
    assert s.kind == "gguf" and s.gguf_file == SMOLLM2_GGUF and os.path.isfile(s.gguf_path)
    assert resolve_model(s.gguf_path) == ModelSource("gguf", s.path, SMOLLM2_GGUF, name=s.gguf_path)
    assert resolve_model("tiny-llama").kind == "tiny" and resolve_model("TINY-QWEN2").path == "tiny-qwen2"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    d = resolve_model(str(tmp_path))
    assert (d.kind, d.path, d.gguf_file) == ("hf_dir", str(tmp_path), None)


@pytest.mark.parametrize("bad", ["gpt-17-mega", "no/such/dir", "__notes.txt", "__empty_dir"])
def test_resolve_model_errors_name_the_flag(bad, tmp_path):
    if bad == "__notes.txt":
        bad = str(tmp_path / "notes.txt")
        open(bad, "w").close()
    elif bad == "__empty_dir":
        bad = str(tmp_path)
    with pytest.raises(ValueError, match="^" + re.escape(f"--model {bad!r}: ")) as e:
        resolve_model(bad)
    msg = str(e.value)
    assert "--model" in msg and bad in msg
    assert ".gguf" in msg and "smollm2-135m-instruct" in msg and "tiny-llama" in msg and "tiny-qwen2" in msg


def test_tiny_configs_and_tokenizer():
    llama = load_hf_config(resolve_model("tiny-llama"))
    qwen = load_hf_config(resolve_model("tiny-qwen2"))
    for c, mt, tied in ((llama, "llama", True), (qwen, "qwen2", False)):
        assert c.model_type == mt and c.tie_word_embeddings is tied
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                c.intermediate_size, c.vocab_size) == (4, 64, 4, 2, 128, 49152)
        assert c.rope_parameters["rope_theta"] == 10000.0 and c.rms_norm_eps == 1e-5
    tok = load_tokenizer(resolve_model("tiny-llama"))
    assert len(tok) == llama.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        llama.bos_token_id, llama.eos_token_id, llama.pad_token_id)


def test_tiny_random_init_is_seeded_and_every_tensor_has_signal(tiny_qwen2):
    cfg, sd = tiny_qwen2
    _, sd2 = load_hf_state_dict(resolve_model("tiny-qwen2"))
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert "lm_head.weight" in sd and all(v.dtype == torch.float32 for v in sd.values())
    for k in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.input_layernorm.weight"):
        assert sd[k].std() > 0.01, k
    _, llama_sd = load_hf_state_dict(resolve_model("tiny-llama"))
    assert "lm_head.weight" not in llama_sd  # canonical tied dict


def test_gguf_config_and_tokenizer_cache(tmp_path, monkeypatch):
    """First load parses the GGUF and fills the cache; the second reads the cache and agrees."""
    from megatron_cegrpo.models.hf_config import gguf_cache_dir

    monkeypatch.setenv("MEGATRON_CEGRPO_CACHE", str(tmp_path))
    src = resolve_model("smollm2-135m-instruct")
    cdir = gguf_cache_dir(src)
    assert cdir.startswith(str(tmp_path)) and not os.path.exists(cdir)
    cfg1, tok1 = load_hf_config(src), load_tokenizer(src)
    assert os.path.isfile(os.path.join(cdir, "config.json"))
    assert os.path.isfile(os.path.join(cdir, "tokenizer", "tokenizer_config.json"))
    cfg2, tok2 = load_hf_config(src), load_tokenizer(src)
    assert cfg1.to_dict() == cfg2.to_dict() and cfg2.num_hidden_layers == 30
    texts = ["Hello world, the capital of France is", "  spaces\tand\nnewlines 123 ü €", "<|im_end|>"]
    for t in texts:
        assert tok1(t)["input_ids"] == tok2(t)["input_ids"]
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok1.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (tok2.eos_token, tok2.pad_token_id) == ("<|im_end|>", 2)


# ----------------------------------------------------------------------------- config


def test_transformer_config_fields(tiny_qwen2, smollm2):
    import torch.nn.functional as F

    qcfg, _ = tiny_qwen2
    tf = transformer_config_from_hf(qcfg, pipeline_model_parallel_size=2, params_dtype=torch.bfloat16)
    assert (tf.num_layers, tf.hidden_size, tf.num_attention_heads, tf.num_query_groups,
            tf.kv_channels, tf.ffn_hidden_size) == (4, 64, 4, 2, 16, 128)
    assert tf.normalization == "RMSNorm" and tf.layernorm_epsilon == 1e-5
    assert tf.gated_linear_unit and tf.activation_func is F.silu
    assert tf.add_qkv_bias and not tf.add_bias_linear
    assert tf.params_dtype == tf.pipeline_dtype == torch.bfloat16 and tf.bf16
    assert not (tf.bias_dropout_fusion or tf.apply_rope_fusion or tf.masked_softmax_fusion
                or tf.gradient_accumulation_fusion or tf.persist_layer_norm or tf.variable_seq_lengths)
    assert tf.attention_dropout == tf.hidden_dropout == 0.0 and tf.init_method_std == 0.02
    scfg, _ = smollm2
    tf = transformer_config_from_hf(scfg, hidden_dropout=0.1)  # overrides pass through
    assert (tf.num_layers, tf.hidden_size, tf.num_attention_heads, tf.num_query_groups,
            tf.kv_channels, tf.ffn_hidden_size) == (30, 576, 9, 3, 64, 1536)
    assert not tf.add_qkv_bias and tf.hidden_dropout == 0.1 and tf.params_dtype == torch.float32


def test_unsupported_arch():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*llama, qwen2"):
        transformer_config_from_hf(GPT2Config())


def test_indivisible_pp_size_names_flags(tiny_llama, smollm2):
    cfg, _ = tiny_llama
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size=3 does not divide the model's 4 layers") as e:
        transformer_config_from_hf(cfg, pipeline_model_parallel_size=3)
    assert "--pipeline-model-parallel-size=3" in str(e.value)
    assert "--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers" in str(e.value)
    with pytest.raises(ValueError, match="--decoder-first-pipeline-num-layers"):
        transformer_config_from_hf(cfg, pipeline_model_parallel_size=2,
                                   num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=1)
    with pytest.raises(ValueError, match="must be > 0"):
        transformer_config_from_hf(cfg, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=0)
    # uneven split that works for 3 stages: 2 + 1 + 1
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=2)
    assert [stage_layer_range(tf, r, 3) for r in range(3)] == [(0, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize(
    "pp,first,last,expected",
    [
        (1, None, None, [(0, 30)]),
        (2, None, None, [(0, 15), (15, 30)]),
        (3, None, None, [(0, 10), (10, 20), (20, 30)]),
        (3, 8, None, [(0, 8), (8, 19), (19, 30)]),
        (3, None, 6, [(0, 12), (12, 24), (24, 30)]),
        (4, 6, 6, [(0, 6), (6, 15), (15, 24), (24, 30)]),
        (2, 29, 1, [(0, 29), (29, 30)]),
    ],
)
def test_stage_layer_range(smollm2, pp, first, last, expected):
    cfg, _ = smollm2
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=pp, num_layers_in_first_pipeline_stage=first,
                                    num_layers_in_last_pipeline_stage=last)
    assert [stage_layer_range(tf, r, pp) for r in range(pp)] == expected


def test_build_stage_single_process_layers_and_tied_copy(megatron_single_process, tiny_llama):
    cfg, _ = tiny_llama
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=2,
                                    num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=1)
    s0 = build_stage(cfg, tf, pp_rank=0, pp_size=2)
    s1 = build_stage(cfg, tf, pp_rank=1, pp_size=2)
    assert isinstance(s0.pg_collection.pp, StageRankGroup) and s1.pg_collection.pp.rank() == 1
    assert (s0.pre_process, s0.post_process, s1.pre_process, s1.post_process) == (True, False, False, True)
    # global 1-based layer numbers follow the stage offset
    assert [l.layer_number for l in s0.decoder.layers] == [1, 2, 3]
    assert [l.layer_number for l in s1.decoder.layers] == [4]
    assert s0.decoder.final_layernorm is None and s1.decoder.final_layernorm is not None
    n0 = dict(s0.named_parameters())
    n1 = dict(s1.named_parameters())
    assert "embedding.word_embeddings.weight" in n0 and "output_layer.weight" not in n0
    assert "output_layer.weight" in n1 and "embedding.word_embeddings.weight" not in n1
    assert s1.shared_embedding_or_output_weight() is n1["output_layer.weight"]
    # PP=1 tied: the output layer has no weight of its own
    whole = build_stage(cfg, transformer_config_from_hf(cfg), pp_rank=0, pp_size=1)
    assert "output_layer.weight" not in dict(whole.named_parameters())
    with pytest.raises(ValueError, match="pp_size=3"):
        build_stage(cfg, tf, pp_rank=0, pp_size=3)


# ----------------------------------------------------------------------------- name map


def test_qkv_packing_layout():
    from types import SimpleNamespace

    # 4 query heads in 2 groups, head_dim 2, hidden 3: row r of q/k/v is tagged.
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=8, head_dim=2)
    q = torch.arange(8.0)[:, None].repeat(1, 3) + 100  # heads 0..3 -> rows 100..107
    k = torch.arange(4.0)[:, None].repeat(1, 3) + 200
    v = torch.arange(4.0)[:, None].repeat(1, 3) + 300
    qkv = pack_qkv(q, k, v, cfg)
    expected_rows = ([100, 101, 102, 103, 200, 201, 300, 301]    # group 0: q heads 0,1 | k0 | v0
                     + [104, 105, 106, 107, 202, 203, 302, 303])  # group 1: q heads 2,3 | k1 | v1
    assert qkv[:, 0].tolist() == expected_rows
    bias = pack_qkv(q[:, 0], k[:, 0], v[:, 0], cfg)
    assert bias.tolist() == expected_rows
    q2, k2, v2 = unpack_qkv(qkv, cfg)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("which", ["tiny_qwen2", "tiny_llama", "smollm2"])
def test_name_map_round_trip_pp2_bit_exact(request, which):
    cfg, sd = request.getfixturevalue(which)
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=2)
    stages = [hf_to_megatron(sd, cfg, tf, r, 2) for r in range(2)]
    assert not any(k.startswith("decoder.layers.") and int(k.split(".")[2]) >= cfg.num_hidden_layers // 2
                   for s in stages for k in s)  # stage-local indices
    assert ("output_layer.weight" in stages[1]) and ("output_layer.weight" not in stages[0])
    if cfg.tie_word_embeddings:
        assert torch.equal(stages[1]["output_layer.weight"], stages[0]["embedding.word_embeddings.weight"])
    back = megatron_to_hf(stages, cfg, tf, 2)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # per-stage form covers disjoint halves that add up to the whole
    parts = [megatron_to_hf(stages[r], cfg, tf, 2, pp_rank=r) for r in range(2)]
    assert not (parts[0].keys() & parts[1].keys()) and (parts[0].keys() | parts[1].keys()) == sd.keys()


def test_round_trip_through_real_stage_modules(megatron_single_process, tiny_qwen2):
    cfg, sd = tiny_qwen2
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=2,
                                    num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=1)
    stages = []
    for r in range(2):
        m = build_stage(cfg, tf, pp_rank=r, pp_size=2)
        load_stage_weights(m, hf_to_megatron(sd, cfg, tf, r, 2))
        stages.append(m)
    msd = [m.state_dict() for m in stages]
    assert any(k.endswith("_extra_state") for k in msd[0])  # ignored cleanly below
    back = megatron_to_hf(msd, cfg, tf, 2)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # DDP-style "module." prefixes are accepted
    wrapped = [{"module." + k: v for k, v in s.items()} for s in msd]
    assert megatron_to_hf(wrapped, cfg, tf, 2).keys() == sd.keys()


def test_load_stage_weights_errors(megatron_single_process, tiny_qwen2):
    cfg, sd = tiny_qwen2
    tf = transformer_config_from_hf(cfg)
    m = build_stage(cfg, tf, pp_rank=0, pp_size=1)
    good = hf_to_megatron(sd, cfg, tf, 0, 1)
    before = m.decoder.final_layernorm.weight.detach().clone()

    missing = dict(good)
    del missing["decoder.layers.2.mlp.linear_fc1.weight"]
    with pytest.raises(KeyError, match=r"missing keys \['decoder.layers.2.mlp.linear_fc1.weight'\]"):
        load_stage_weights(m, missing)

    extra = dict(good, **{"decoder.layers.9.mlp.linear_fc1.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"unexpected keys \['decoder.layers.9.mlp.linear_fc1.weight'\]"):
        load_stage_weights(m, extra)

    bad = dict(good, **{"decoder.final_layernorm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match=r"decoder.final_layernorm.weight: model \(64,\) vs given \(65,\)"):
        load_stage_weights(m, bad)
    assert torch.equal(m.decoder.final_layernorm.weight, before)  # nothing copied on error

    load_stage_weights(m, dict(good, **{"output_layer._extra_state": None}))  # ignored
    assert torch.equal(m.decoder.final_layernorm.weight, sd["model.norm.weight"])
    assert torch.equal(m.output_layer.weight, sd["lm_head.weight"])


def test_gguf_cache_weights_are_the_real_model(smollm2):
    """The (cached, dequantised) SmolLM2 weights predict ' Paris' after the France prompt."""
    from megatron_cegrpo.models import build_hf_model

    cfg, sd = smollm2
    assert len(sd) == 272 and "lm_head.weight" not in sd
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.no_grad():
        nxt = build_hf_model(cfg, sd)(ids).logits[0, -1].argmax().item()
    assert tok.decode([nxt]).strip() == "Paris"


# ----------------------------------------------------------------------------- real PP group


def _pp_worker(out_dir):
    """One rank of a 2-stage tiny-llama pipeline in a real gloo PP group (1F1B, tied)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from megatron_cegrpo.compat import apply_cpu_compat
    from megatron_cegrpo.models import allreduce_tied_embedding_grads
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    apply_cpu_compat()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel(1, world)
    model_parallel_cuda_manual_seed(7)
    cfg, sd = load_hf_state_dict(resolve_model("tiny-llama"))
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=2,
                                    num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=1)
    m = build_stage(cfg, tf, pp_rank=rank, pp_size=2)
    assert not isinstance(m.pg_collection.pp, StageRankGroup)  # the real group
    w = m.shared_embedding_or_output_weight()
    init_sum = float(w.detach().double().sum())  # megatron's construction-time all-reduce
    load_stage_weights(m, hf_to_megatron(sd, cfg, tf, rank, 2))
    ids, pos = _pp_batch()

    def step(it, model):
        x = next(it)
        out = model(x, pos, None)
        return out, lambda o: (_lp_loss(o, x), {})

    forward_backward_pipelining_without_interleaving(
        forward_step_func=step, data_iterator=iter(ids), model=[m], num_microbatches=ids.shape[0],
        seq_length=ids.shape[2], micro_batch_size=ids.shape[1])
    own_grad = w.grad.clone()
    allreduce_tied_embedding_grads(m, ps.get_embedding_group())
    torch.save({"layers": [l.layer_number for l in m.decoder.layers], "init_sum": init_sum,
                "own_grad": own_grad, "tied_grad": w.grad.clone(),
                "fc2_grad": m.decoder.layers[-1].mlp.linear_fc2.weight.grad.clone()},
               os.path.join(out_dir, f"rank{rank}.pt"))
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _pp_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 49152, (3, 2, 8), generator=g)  # 3 micro-batches of [2, 8]
    return ids, torch.arange(8).unsqueeze(0).expand(2, -1)


def _lp_loss(logits, ids):
    return -torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).mean()


def test_real_pipeline_group_tied_embeddings(tmp_path, tiny_llama):
    from distributed_util import run_ranks

    from megatron_cegrpo.models import build_hf_model

    run_ranks([os.path.abspath(__file__), "--pp-worker", str(tmp_path)], 2, timeout=300)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["layers"] == [1, 2, 3] and r1["layers"] == [4]
    assert r0["init_sum"] == pytest.approx(r1["init_sum"])  # copies synced at construction
    # HF reference: mean over micro-batches of the same loss; the tied weight's grad is the
    # embedding grad + the lm_head grad, which the all-reduce must give on both stages.
    cfg, sd = tiny_llama
    hf = build_hf_model(cfg, sd)
    ids, _ = _pp_batch()
    loss = sum(_lp_loss(hf(x).logits, x) for x in ids) / ids.shape[0]
    loss.backward()
    ref = hf.model.embed_tokens.weight.grad
    assert not torch.allclose(r0["own_grad"], ref, atol=1e-6)  # each stage alone is partial
    torch.testing.assert_close(r0["tied_grad"], ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(r1["tied_grad"], ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(r0["own_grad"] + r1["own_grad"], ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(r1["fc2_grad"], hf.model.layers[3].mlp.down_proj.weight.grad, rtol=0, atol=1e-6)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pp-worker"]:
        torch.set_num_threads(1)
        _pp_worker(sys.argv[2])
