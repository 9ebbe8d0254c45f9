"""Gather every stage's parameters on the driver (for the dense sampler).

Not a pipeline boundary: this is the "theta synced to the sampler after every
step" arrow of status 2026-07-31 figure 1. Its bytes are metered separately
(``sync/bytes``). Each stage flattens its parameters into one buffer in a
fixed order and sends it to the driver; names and shapes travel once, at
construction.

``--rollout-dtype fp32`` (the default) sends every non-driver stage's parameters in fp32 after
every step (:class:`StageWeightGatherer`); ``bf16`` sends only the bf16 entries that changed
(``delta_sync.py``). :func:`build_weight_sync` picks one.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["StageWeightGatherer", "build_weight_sync", "gather_meta", "flatten_params", "unflatten"]


def flatten_params(params: List[torch.Tensor]) -> torch.Tensor:
    """One fp32 buffer [sum numel] holding ``params`` in order (what crosses the wire)."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def unflatten(flat: torch.Tensor, shapes: List[Tuple[int, ...]]) -> List[torch.Tensor]:
    """Views of ``flat`` with ``shapes``, in order (inverse of :func:`flatten_params`)."""
    out, off = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(flat[off:off + n].view(shape))
        off += n
    assert off == flat.numel(), (off, flat.numel())
    return out


def gather_meta(model: torch.nn.Module, pp_group) -> Optional[List[list]]:
    """Collective: on the pipeline's rank 0, [(name, shape, dtype) per parameter] per stage (stage
    order); None elsewhere."""
    meta = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    gathered: Optional[List[Optional[list]]] = [None] * pp_group.size() if pp_group.rank() == 0 else None
    dist.gather_object(meta, gathered, dst=dist.get_global_rank(pp_group, 0), group=pp_group)
    return gathered


def build_weight_sync(model: torch.nn.Module, pp_group, rollout_dtype: str = "fp32", baseline=None):
    """The sampler's weight sync for ``--rollout-dtype`` (collective over the pipeline).

    Args:
        rollout_dtype: ``fp32`` (every parameter in fp32, :class:`StageWeightGatherer`) or
            ``bf16`` (changed bf16 entries, :class:`~megatron_cegrpo.pipeline.delta_sync.DeltaWeightSync`).
        baseline: bf16 only, on the driver: ``baseline(r)`` -> stage r's weights as the sampler
            was loaded (see DeltaWeightSync).
    Raises:
        ValueError: an unknown ``rollout_dtype``.
    """
    if rollout_dtype == "fp32":
        return StageWeightGatherer(model, pp_group)
    if rollout_dtype == "bf16":
        from megatron_cegrpo.pipeline.delta_sync import DeltaWeightSync
        return DeltaWeightSync(model, pp_group, baseline=baseline)
    raise ValueError(f"unknown rollout dtype {rollout_dtype!r}; valid: fp32, bf16")


class StageWeightGatherer:
    """Collect {name: tensor} of all pipeline stages on the driver rank.

    Args:
        model: this rank's stage.
        pp_group: the pipeline group; its rank 0 is the driver.
    """

    def __init__(self, model: torch.nn.Module, pp_group):
        self.model = model
        self.group = pp_group
        self.pp_rank = pp_group.rank()
        self.pp_size = pp_group.size()
        self.driver = dist.get_global_rank(pp_group, 0)
        self.names = [n for n, _ in model.named_parameters()]
        self.meta = gather_meta(model, pp_group)
        self.last_bytes = 0

    @torch.no_grad()
    def gather(self) -> Optional[List[Dict[str, torch.Tensor]]]:
        """Returns on the driver one state dict per stage (stage order); None elsewhere."""
        if self.pp_rank != 0:
            flat = flatten_params(list(self.model.parameters())).cpu()  # the driver receives on the CPU
            dist.send(flat, dst=self.driver, group=self.group)
            self.last_bytes = flat.numel() * flat.element_size()
            return None
        out = [{n: p.clone() for n, p in self.model.named_parameters()}]
        total = 0
        for r in range(1, self.pp_size):
            meta = self.meta[r]
            numel = sum(int(torch.Size(s).numel()) for _, s, _ in meta)
            flat = torch.empty(numel, dtype=torch.float32)
            dist.recv(flat, src=dist.get_global_rank(self.group, r), group=self.group)
            total += flat.numel() * flat.element_size()
            views = unflatten(flat, [shape for _, shape, _ in meta])
            out.append({name: v.to(dtype) for (name, _, dtype), v in zip(meta, views)})
        self.last_bytes = total
        return out

    def metrics(self) -> Dict[str, float]:
        """The last gather's bytes (driver): ``sync/bytes`` (fp32 payloads of the non-driver
        stages; the driver's own stage is local and counted nowhere), ``sync/dense_bytes`` and
        ``sync/dense_fp32_bytes`` (one dense copy of those stages in the sampler dtype, fp32:
        both equal ``sync/bytes`` here)."""
        return {"sync/bytes": self.last_bytes, "sync/dense_bytes": self.last_bytes,
                "sync/dense_fp32_bytes": self.last_bytes}
