"""Model FLOPs of the update pass and its utilisation (verl's ``perf/mfu/actor``).

A stage's update pass runs forward and backward over every position of its mini-batches
(``N`` sequences of ``S`` positions, padding included: the pass computes them; with
``--shared-prefix`` the ``N / G`` packed sequences of ``L`` positions it computes instead,
``PipelineRunner.pass_shape``). Its model FLOPs,
the usual accounting (Kaplan et al. 2020, "6ND"; Narayanan et al. 2021, eq. 2, for attention):

    3 x forward,   forward = 2 P N S + 4 N S^2 h L

with ``P`` the weights the stage multiplies by (every 2-D parameter but an input embedding it
only looks rows up in; an output layer, tied or not, counts), ``h`` the attention width
(heads x head dim, this TP rank's share) and ``L`` the stage's layers: QK^T and AV are 2 S^2 h
each per layer and sequence (megatron's local attention computes the full S x S scores, the causal
mask then discards half; counted whole as computed). Recomputation (none here) would add to it.

``perf/update_flops`` = the stages' update FLOPs of the iteration, summed;
``perf/flops/actor`` (TFLOP/s) = ``perf/update_flops`` / ``timing_s/update``;
``perf/mfu/actor`` = that / ``--peak-tflops`` (the hardware's peak over all the trainer's stage
ranks in the compute dtype), logged only when the peak is given: a CPU has no datasheet number
that holds under this load, so ``benchmarks/bench_iteration.py`` measures it and passes it.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

__all__ = ["WALL_CLOCK_PREFIXES", "without_wall_clock", "matmul_params", "update_pass_flops", "perf_metrics"]

#: Metric keys that depend on wall-clock time: they differ between two runs of the same seeds, so
#: equality checks (resume, equivalence records, DP/TP parity) leave them out.
WALL_CLOCK_PREFIXES = ("timing_s/", "perf/flops/", "perf/mfu/")


def without_wall_clock(m: Dict, extra: tuple = ()) -> Dict:
    """``m`` without the keys under :data:`WALL_CLOCK_PREFIXES` (and the prefixes in ``extra``)."""
    drop = WALL_CLOCK_PREFIXES + tuple(extra)
    return {k: v for k, v in m.items() if not k.startswith(drop)}


def matmul_params(model: torch.nn.Module) -> int:
    """Weights this stage multiplies by: every 2-D parameter, less an input embedding that is not
    also the stage's output layer (a row lookup, no FLOPs). Counts this rank's shards at TP > 1."""
    seen, total = set(), 0
    out_w = model.shared_embedding_or_output_weight() if getattr(model, "post_process", False) and hasattr(
        model, "shared_embedding_or_output_weight") else None
    for name, p in model.named_parameters():
        if p.dim() != 2 or id(p) in seen:
            continue
        seen.add(id(p))
        if "word_embeddings" in name and p is not out_w:
            continue
        total += p.numel()
    return total


def update_pass_flops(model: torch.nn.Module, tf_config, num_layers: int, n: int, s: int) -> int:
    """Model FLOPs of one forward + backward of ``n`` sequences of ``s`` positions through this stage
    (module docstring's formula; ``num_layers``: the stage's decoder layers)."""
    tp = max(1, int(getattr(tf_config, "tensor_model_parallel_size", 1)))
    h = int(tf_config.num_attention_heads) * int(tf_config.kv_channels) // tp
    forward = 2 * matmul_params(model) * n * s + 4 * n * s * s * h * num_layers
    return 3 * forward


def perf_metrics(m: Dict, peak_tflops: Optional[float]) -> Dict[str, float]:
    """``perf/flops/actor`` and, with a peak, ``perf/mfu/actor`` from the reduced metrics ``m``
    (``perf/update_flops`` summed over the stages, ``timing_s/update``); {} without either."""
    flops, secs = m.get("perf/update_flops"), m.get("timing_s/update")
    if not flops or not secs:
        return {}
    out = {"perf/flops/actor": flops / secs / 1e12}
    if peak_tflops:
        out["perf/mfu/actor"] = out["perf/flops/actor"] / peak_tflops
    return out
