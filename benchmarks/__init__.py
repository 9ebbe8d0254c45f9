"""Benchmarks for megatron_cegrpo (not part of the test suite; see docs/benchmarks.md).

    python -m benchmarks.bench_codec   bytes per token per boundary, codec cost vs one layer
    python -m benchmarks.bench_link    the real GRPO step over a simulated / tbf-throttled link
    python -m benchmarks.bench_peer    s/step of TRL's GRPOTrainer and this trainer on the same job

Everything here prints ratios measured in one run; nothing is a timed test.
"""
