"""tools/checkpoint/convert.py: HF / GGUF <-> megatron (any PP size), checked on values.

Measured (CPU fp32, 1 thread, torch 2.13, megatron-core 0.16.1, transformers 5.24) and
printed by the tests (run with -s):
* HF -> megatron PP=2 -> HF: every tensor torch.equal, same keys (tiny-llama, tiny-qwen2,
  and SmolLM2 from its GGUF);
* PP=2 (2+2) -> PP=3 (2+1+1): max |PP3 - PP2| logits = 0 and max |PP3 - HF| = 0 (tiny models);
* exported HF dir via AutoModelForCausalLM.from_pretrained against the original model:
  max |diff| = 0 with eager attention, 3.0e-7 (llama) / 2.7e-7 (qwen2) with the default
  (sdpa) attention, |logits| <= 0.92;
* SmolLM2 GGUF -> megatron PP=2 -> HF (eager) against the GGUF-loaded model: max |diff| = 0
  (|logits| max 27.4), next token after "The capital of France is" = " Paris".
Asserted bounds: 1e-5 (tiny, eager / megatron), 1e-4 (sdpa, SmolLM2); weights bit-exact.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from megatron_cegrpo import checkpointing as ck
from megatron_cegrpo.checkpointing import CheckpointError
from megatron_cegrpo.models import (
    build_hf_model,
    build_stage,
    hf_to_megatron,
    load_hf_state_dict,
    load_tokenizer,
    resolve_model,
    transformer_config_from_hf,
)

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = os.path.join(REPO, "tools", "checkpoint", "convert.py")


def _convert_module():
    spec = importlib.util.spec_from_file_location("cegrpo_convert_tool", CONVERT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


convert = _convert_module()


def run_convert(*argv):
    return convert.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """tiny-llama / tiny-qwen2 random weights written as HF model directories (no tokenizer)."""
    from safetensors.torch import save_file

    out = {}
    for name in ("tiny-llama", "tiny-qwen2"):
        cfg, sd = load_hf_state_dict(resolve_model(name))
        d = tmp_path_factory.mktemp(name)
        cfg.save_pretrained(d)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[name] = (str(d), cfg, sd)
    return out


def _ids(vocab=49152, b=2, s=12, seed=5):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _load_hf_dir(path, attn="eager"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()


def _report(tag, out, ref):
    diff = (out - ref).abs().max().item()
    print(f"\n{tag}: max |diff| logits = {diff:.3g} (|logits| max {ref.abs().max():.3g})")
    return diff


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_hf_megatron_pp2_hf_round_trip_bit_exact_and_loads_in_transformers(tmp_path, hf_dirs, name):
    from safetensors.torch import load_file

    src, cfg, sd = hf_dirs[name]
    final = run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", src, "--save-dir",
                        tmp_path / "mg", "--target-pp-size", 2)
    assert final == str(tmp_path / "mg" / "iter_0000000")
    meta = ck.verify_checkpoint(final)
    assert (meta["iteration"], meta["pp_size"], meta["codec"], meta["num_layers_in_first"]) == (0, 2, None, None)
    assert meta["hf_config"]["model_type"] == cfg.model_type and meta["model_name"] == src
    assert not os.path.exists(os.path.join(final, ck.TOKENIZER_DIR))  # the source had none
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=2)
    for r in range(2):  # stage files hold exactly hf_to_megatron's names and values
        got, want = ck.read_stage_file(final, r), hf_to_megatron(sd, cfg, tf, r, 2)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)

    out = run_convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "mg",
                      "--save-dir", tmp_path / "hf")
    back = load_file(os.path.join(out, "model.safetensors"))
    assert back.keys() == sd.keys()
    assert all(back[k].dtype == torch.float32 and torch.equal(back[k], sd[k]) for k in sd)

    ids = _ids()
    with torch.no_grad():
        ref = build_hf_model(cfg, sd)(ids).logits
        exported = _load_hf_dir(out)
        assert type(exported).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.model_type]
        assert exported.config.tie_word_embeddings == cfg.tie_word_embeddings
        d_eager = _report(f"{name} exported HF (eager) vs original", exported(ids).logits, ref)
        d_sdpa = _report(f"{name} exported HF (default attention) vs original", _load_hf_dir(out, None)(ids).logits, ref)
    assert d_eager < 1e-5 and d_sdpa < 1e-4


def _chain(cfg, ckpt_dir):
    """Build every stage of a checkpoint in one process, load it, run the pipeline on ids."""
    meta = ck.read_meta(ckpt_dir)
    pp = meta["pp_size"]
    tf = transformer_config_from_hf(cfg, pipeline_model_parallel_size=pp, perform_initialization=False,
                                    num_layers_in_first_pipeline_stage=meta["num_layers_in_first"],
                                    num_layers_in_last_pipeline_stage=meta["num_layers_in_last"])
    ck.check_compatible(meta, hf_config=cfg, pp_size=pp, num_layers_in_first=meta["num_layers_in_first"],
                        num_layers_in_last=meta["num_layers_in_last"], codec="mask")
    stages = []
    for r in range(pp):
        m = build_stage(cfg, tf, pp_rank=r, pp_size=pp)
        ck.load_stage_model(ckpt_dir, r, m, meta=meta)
        stages.append(m.eval())
    ids = _ids()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    with torch.no_grad():
        h = None
        for r, m in enumerate(stages):
            if r > 0:
                m.set_input_tensor(h)
            h = m(ids if r == 0 else None, pos, None)
    return h, [len(m.decoder.layers) for m in stages]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_pp2_to_pp3_uneven_same_logits(megatron_single_process, tmp_path, hf_dirs, name):
    src, cfg, sd = hf_dirs[name]
    run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", src, "--save-dir", tmp_path / "pp2",
                "--target-pp-size", 2)
    pp3 = run_convert("--loader", "megatron", "--saver", "megatron", "--load-dir", tmp_path / "pp2",
                      "--save-dir", tmp_path / "pp3", "--target-pp-size", 3,
                      "--target-decoder-first-pipeline-num-layers", 2)
    meta3 = ck.verify_checkpoint(pp3)
    assert (meta3["pp_size"], meta3["num_layers_in_first"], meta3["num_layers_in_last"]) == (3, 2, None)
    assert meta3["extra"]["source_pp_size"] == 2 and meta3["extra"]["loader"] == "megatron"
    if cfg.tie_word_embeddings:
        s0, s2 = ck.read_stage_file(pp3, 0), ck.read_stage_file(pp3, 2)
        assert torch.equal(s0["embedding.word_embeddings.weight"], s2["output_layer.weight"])

    out2, layers2 = _chain(cfg, os.path.join(tmp_path, "pp2", "iter_0000000"))
    out3, layers3 = _chain(cfg, pp3)
    assert layers2 == [2, 2] and layers3 == [2, 1, 1]
    with torch.no_grad():
        ref = build_hf_model(cfg, sd)(_ids()).logits
    d23 = _report(f"{name} PP=3 (2+1+1) vs PP=2 (2+2)", out3, out2)
    d3h = _report(f"{name} PP=3 (2+1+1) vs HF", out3, ref)
    assert d23 < 1e-5 and d3h < 1e-5
    assert torch.equal(out3.argmax(-1), ref.argmax(-1))

    # stage files do not fit the stages of another split (load_stage_model is strict)
    other = transformer_config_from_hf(cfg, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3,
                                       num_layers_in_last_pipeline_stage=1)
    with pytest.raises(CheckpointError, match=r"stage_00/model.safetensors does not fit stage 0: .*missing keys "
                                              r"\['decoder.layers.2.input_layernorm.weight'"):
        ck.load_stage_model(pp3, 0, build_stage(cfg, other, pp_rank=0, pp_size=2))

    # the PP=2 checkpoint refuses a PP=3 run and names the conversion
    with pytest.raises(CheckpointError, match=r"convert it with tools/checkpoint/convert.py --target-pp-size 3"):
        ck.check_compatible(ck.read_meta(ck.resolve_load_dir(str(tmp_path / "pp2"))[0]), hf_config=cfg, pp_size=3, num_layers_in_first=2)


def test_gguf_smollm2_to_megatron_pp2_to_hf(tmp_path):
    from safetensors.torch import load_file

    src = resolve_model("smollm2-135m-instruct")
    cfg, sd = load_hf_state_dict(src)  # the GGUF-loaded (dequantised) model
    final = run_convert("--loader", "gguf", "--saver", "megatron", "--load-dir", "smollm2-135m-instruct",
                        "--save-dir", tmp_path / "mg", "--target-pp-size", 2)
    meta = ck.verify_checkpoint(final)
    assert meta["pp_size"] == 2 and meta["hf_config"]["num_hidden_layers"] == 30
    assert any(f.startswith("tokenizer/") for f in meta["files"])
    out = run_convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "mg",
                      "--save-dir", tmp_path / "hf")
    back = load_file(os.path.join(out, "model.safetensors"))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    from transformers import AutoTokenizer

    tok_ref, tok = load_tokenizer(src), AutoTokenizer.from_pretrained(out)
    prompt = "The capital of France is"
    assert tok(prompt)["input_ids"] == tok_ref(prompt)["input_ids"] and tok.eos_token == tok_ref.eos_token
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        ref = build_hf_model(cfg, sd)(ids).logits
        exported = _load_hf_dir(out)
        got = exported(ids).logits
    assert exported.config.num_hidden_layers == 30
    diff = _report("SmolLM2 GGUF -> megatron PP=2 -> HF vs GGUF-loaded", got, ref)
    assert diff < 1e-4
    assert tok.decode([got[0, -1].argmax().item()]).strip() == "Paris"


def test_bad_split_names_the_tool_flags(tmp_path, hf_dirs):
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size=3 does not divide the model's 4 layers") as e:
        run_convert("--loader", "hf", "--saver", "megatron", "--load-dir", hf_dirs["tiny-llama"][0],
                    "--save-dir", tmp_path / "x", "--target-pp-size", 3)
    msg = str(e.value)
    assert "--pipeline-model-parallel-size=3 does not divide the model's 4 layers" in msg
    assert "in this tool the flags are --target-pp-size, --target-decoder-first-pipeline-num-layers" in msg
    assert not os.path.exists(tmp_path / "x")  # nothing written


def test_cli_as_a_script_refuses_an_occupied_target(tmp_path):
    """`python tools/checkpoint/convert.py ...` runs as written; errors are one line, exit 1,
    and an occupied --save-dir is refused before the source is loaded."""
    tmp = ck.begin_save(str(tmp_path / "run"), 4)
    ck.write_stage_file(tmp, 0, "model", {"w": torch.ones(2)})
    ck.commit_save(str(tmp_path / "run"), tmp, 4, ck.make_meta(hf_config={"model_type": "llama"}, pp_size=1))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, CONVERT, "--loader", "gguf", "--saver", "megatron", "--load-dir",
                        "smollm2-135m-instruct", "--save-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        f"convert.py: error: --save-dir {tmp_path / 'run'} already holds a checkpoint; choose an empty directory"]
    assert "[convert] loaded" not in p.stdout
    p = subprocess.run([sys.executable, CONVERT, "--loader", "nope"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "invalid choice: 'nope'" in p.stderr


def test_every_plugin_has_its_protocol_functions_and_a_lacking_one_is_refused(monkeypatch):
    """convert.py calls the saver's preflight unconditionally: plugin() checks the protocol."""
    import types

    from megatron_cegrpo import conversion
    for kind, names in (("loader", conversion.LOADERS), ("saver", conversion.SAVERS)):
        for name in names:
            module = conversion.plugin(kind, name)
            assert all(callable(getattr(module, f)) for f in conversion.PLUGIN_FUNCTIONS[kind])
    fake = types.ModuleType("megatron_cegrpo.conversion.saver_fake")
    fake.add_arguments = fake.save_checkpoint = lambda *a: None
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    with pytest.raises(TypeError, match=r"--saver fake: conversion plugin \S+saver_fake lacks preflight; fix: define"):
        conversion.plugin("saver", "fake")
