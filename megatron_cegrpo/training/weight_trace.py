"""A weight trajectory for offline analysis (``--log-weight-sample N``, issue 31 item 4).

Every trainer rank of data-parallel replica 0 keeps the same ``N`` coordinates of its stage's fp32
(master) parameters, drawn once with a seeded generator, and after every iteration ``t`` (and once
at the start, iteration 0 or the resumed one) appends one record to
``<log-dir>/weight_trace/stage<pp>_tp<tp>.bin``: ``t`` as int64, then the ``N`` values as float32.
The chosen coordinates are written once to ``stage<pp>_tp<tp>.json`` (parameter names, shapes and
flat indices). A resumed run appends again from its checkpoint's iteration; a reader keeps the
last record of each iteration (:func:`read_trace`), which is the resumed run's.

Why a sample: the distance ratios the forecast report needs (``tools/forecast_report.py``:
``||theta_hat - theta|| / ||theta_stale - theta||``) are ratios of sums of squares over
coordinates; a uniform sample of the coordinates estimates each sum up to a common factor, so
the ratio is estimated without storing the whole model every iteration (SmolLM2-135M: 540 MB an
iteration in fp32; the default sample, 262144 coordinates, is 1 MB).

Under ``--bf16`` the parameters outside a pass are the fp32 masters (``optim/mixed_precision.py``),
so the trace sees moves far below bf16's resolution (a 1e-5 step on a weight of 0.05 is a tenth of
a bf16 ulp).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import numpy as np
import torch

__all__ = ["WeightTrace", "read_trace", "start_weight_trace"]

_RECORD_HEADER = np.dtype("<i8")


class WeightTrace:
    """The sampled coordinates of one stage rank, appended to its trace file every iteration.

    Args:
        named_params: the stage's ``(name, parameter)`` pairs (fp32 between passes); a tied
            embedding's duplicate is left out by the caller.
        n: coordinates to keep (>= 1); capped at the stage's parameter count.
        out_dir: ``<log-dir>/weight_trace``; created.
        tag: the file stem, ``stage<pp>_tp<tp>``.
        seed: the generator's seed (``--seed`` plus the stage's rank: every stage its own sample).
    Raises:
        ValueError: ``n`` < 1, or no parameters.
    """

    def __init__(self, named_params: List[Tuple[str, torch.nn.Parameter]], n: int, out_dir: str, tag: str,
                 seed: int):
        if n < 1 or not named_params:
            raise ValueError(f"WeightTrace needs n >= 1 and parameters; got n={n}, {len(named_params)} parameters")
        self.params = [p for _, p in named_params]
        sizes = [p.numel() for p in self.params]
        total = sum(sizes)
        g = torch.Generator().manual_seed(int(seed))
        flat = torch.randperm(total, generator=g)[:min(n, total)].sort().values
        bounds = np.cumsum([0] + sizes)
        self.index: List[Tuple[int, torch.Tensor]] = []  # (parameter position, its flat indices)
        meta = []
        for i, (name, p) in enumerate(named_params):
            sel = flat[(flat >= int(bounds[i])) & (flat < int(bounds[i + 1]))] - int(bounds[i])
            if sel.numel():
                self.index.append((i, sel))
                meta.append({"name": name, "shape": list(p.shape), "count": int(sel.numel())})
        self.n = int(flat.numel())
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, f"{tag}.bin")
        with open(os.path.join(out_dir, f"{tag}.json"), "w", encoding="utf-8") as f:
            json.dump({"coordinates": self.n, "parameters": sum(sizes), "seed": int(seed), "sampled": meta,
                       "record": "int64 iteration, then float32 values in this order"}, f, indent=1)

    def values(self) -> np.ndarray:
        """The sampled coordinates now: float32, shape ``(n,)``, in the order of the json's ``sampled``."""
        with torch.no_grad():
            parts = [self.params[i].detach().reshape(-1)[idx.to(self.params[i].device)].float().cpu()
                     for i, idx in self.index]
        return torch.cat(parts).numpy()

    def record(self, t: int) -> None:
        """Append iteration ``t``'s record (one write, flushed)."""
        with open(self.path, "ab") as f:
            f.write(np.asarray([t], dtype=_RECORD_HEADER).tobytes() + self.values().astype("<f4").tobytes())
            f.flush()


class _NoTrace:
    """``--log-weight-sample 0`` (or a data-parallel replica other than 0): records nothing."""

    def record(self, t: int) -> None:
        pass


def start_weight_trace(cfg, ctx, named_params: List[Tuple[str, torch.nn.Parameter]], iteration: int):
    """This stage rank's trace under ``--log-weight-sample N`` (replica 0 only: the replicas hold the
    same weights), with its record of ``iteration`` (0, or the resumed one) written; else a no-op.

    Args:
        cfg: the TrainConfig; ctx: the DistContext; named_params: ``StageWorker.named_owned``.
    """
    n = cfg.logging.log_weight_sample
    if not n or not ctx.is_replica_leader:
        return _NoTrace()
    trace = WeightTrace(named_params, n, os.path.join(cfg.logging.log_dir, "weight_trace"),
                        f"stage{ctx.pp_rank}_tp{ctx.tp_rank}", cfg.optim.seed + 1000 * ctx.pp_rank + ctx.tp_rank)
    trace.record(iteration)
    return trace


def read_trace(path: str, n: int) -> Dict[int, np.ndarray]:
    """``{iteration: float32 values (n,)}`` of one trace file; the last record of an iteration
    wins (a resumed run's). A torn last record (a kill mid-write) is dropped.

    Raises:
        FileNotFoundError: no such file.
    """
    raw = open(path, "rb").read()
    size = 8 + 4 * n
    out: Dict[int, np.ndarray] = {}
    for off in range(0, len(raw) - size + 1, size):
        t = int(np.frombuffer(raw, dtype=_RECORD_HEADER, count=1, offset=off)[0])
        out[t] = np.frombuffer(raw, dtype="<f4", count=n, offset=off + 8).copy()
    return out
