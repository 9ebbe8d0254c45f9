"""Deterministic, resumable epoch-based prompt sampler."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

__all__ = ["PromptSampler"]


class PromptSampler:
    """Draws batches of record indices, epoch after epoch.

    Epoch ``e`` visits every index once, in the order of
    ``torch.randperm(num_records, generator=torch.Generator().manual_seed(seed + e))``.
    Batches run across epoch boundaries without a gap or a short batch.
    :meth:`state_dict` / :meth:`load_state_dict` capture ``(epoch, position)``
    so a resumed run draws exactly the indices the uninterrupted run would.
    """

    def __init__(self, num_records: int, batch_size: int, seed: int):
        if int(num_records) <= 0:
            raise ValueError(f"num_records must be > 0, got {num_records}")
        if int(batch_size) <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.num_records = int(num_records)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0  # next index into the current epoch's permutation
        self._perm: Optional[List[int]] = None
        self._perm_epoch = -1

    def _permutation(self) -> List[int]:
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._perm = torch.randperm(self.num_records, generator=g).tolist()
            self._perm_epoch = self.epoch
        return self._perm  # type: ignore[return-value]

    def next_batch(self, size: Optional[int] = None) -> List[int]:
        """The next ``size`` indices (default ``batch_size``), crossing into the next epoch if needed.
        Raises ValueError for ``size`` < 1."""
        want = self.batch_size if size is None else int(size)
        if want <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        out: List[int] = []
        while len(out) < want:
            perm = self._permutation()
            take = min(want - len(out), self.num_records - self.position)
            out.extend(perm[self.position : self.position + take])
            self.position += take
            if self.position == self.num_records:
                self.epoch += 1
                self.position = 0
        return out

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_records": self.num_records,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the data set size and seed must match."""
        for key in ("epoch", "position", "seed"):
            if key not in state:
                raise ValueError(f"sampler state is missing {key!r}: {state!r}")
        if "num_records" in state and int(state["num_records"]) != self.num_records:
            raise ValueError(
                f"sampler state is for {state['num_records']} records, this sampler has "
                f"{self.num_records}; resume with the same data set"
            )
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"sampler state has seed {state['seed']}, this sampler has seed {self.seed}"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_records:
            raise ValueError(f"invalid sampler state epoch={epoch} position={position}")
        self.epoch, self.position = epoch, position
        self._perm_epoch = -1
