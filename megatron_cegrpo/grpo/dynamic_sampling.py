"""DAPO's dynamic sampling (``--filter-groups``): keep only groups whose rewards are mixed.

A group whose G rewards are all equal gets advantage 0 for every response (``core_algos``):
its sequences cost a generation, a forward and a backward pass and teach nothing. Dynamic
sampling (Yu et al. 2025, "DAPO", section 3.2; verl ``algorithm.filter_groups``) drops such
groups and draws more prompts until the batch holds the configured number B of mixed groups.

Here the number of generation rounds an iteration may draw is bounded
(``--max-num-gen-batches``, verl's name). verl raises an error when the bound is hit; here
the run goes on: the batch is the mixed groups drawn plus the newest tied groups, B in all
(``batch/filled_with_tied`` counts them), so its shape stays B x G and the pipeline's
micro-batching is unchanged.

Pure functions of the per-round tie flags; the driver (``training/driver.py``) draws the
rounds, the sampler continues across them (its ``(epoch, position)`` state covers the extra
draws, so a resumed run draws the same prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

__all__ = ["GroupSelection", "ROUND_SEED_STRIDE", "enough_mixed", "round_seed", "select_groups"]

#: the generation seed of round r of iteration t is ``seed * 1_000_003 + t + r * ROUND_SEED_STRIDE``:
#: round 0 keeps the seed of a run without the filter, later rounds never meet another
#: iteration's seed (t < 2**40) and stay below 2**63 for every --seed and bound.
ROUND_SEED_STRIDE = 2 ** 40


def round_seed(seed: int, t: int, r: int) -> int:
    """The sampler's ``generator_seed`` for generation round ``r`` (0-based) of iteration ``t``."""
    return int(seed) * 1_000_003 + int(t) + int(r) * ROUND_SEED_STRIDE


@dataclass(frozen=True)
class GroupSelection:
    """The B groups of an iteration's batch, in draw order.

    Attributes:
        groups: ``(round, group)`` pairs, B of them, sorted by round then group.
        kept: the mixed groups among them.
        filled_with_tied: the tied groups among them (only when the bound was hit).
        tied_dropped: tied groups drawn and left out.
        mixed_unused: mixed groups drawn past the B-th and left out (the last round's surplus).
        rounds: the generation rounds drawn.
    """

    groups: Tuple[Tuple[int, int], ...]
    kept: int
    filled_with_tied: int
    tied_dropped: int
    mixed_unused: int
    rounds: int

    def metrics(self) -> dict:
        """verl-style ``batch/*`` metrics of the selection; rounds x prompts per round (B, or
        ``--gen-batch-size``) = kept + filled_with_tied + tied_groups_dropped + mixed_groups_unused."""
        return {"batch/num_gen_batches": self.rounds, "batch/kept_groups": self.kept,
                "batch/tied_groups_dropped": self.tied_dropped, "batch/filled_with_tied": self.filled_with_tied,
                "batch/mixed_groups_unused": self.mixed_unused}


def _check(tied_rounds: Sequence[torch.Tensor], batch_groups: int) -> None:
    if int(batch_groups) < 1:
        raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
    for r, tied in enumerate(tied_rounds):
        if tied.dtype != torch.bool or tied.dim() != 1:
            raise ValueError(f"round {r}: tie flags must be a 1-D bool tensor, got {tied.dtype} {tuple(tied.shape)}")


def enough_mixed(tied_rounds: Sequence[torch.Tensor], batch_groups: int) -> bool:
    """True once the rounds drawn hold at least ``batch_groups`` mixed (untied) groups."""
    _check(tied_rounds, batch_groups)
    return sum(int((~t).sum()) for t in tied_rounds) >= int(batch_groups)


def select_groups(tied_rounds: Sequence[torch.Tensor], batch_groups: int) -> GroupSelection:
    """The batch's groups from the tie flags of the rounds drawn.

    Mixed groups first come first (round by round, group by group) up to ``batch_groups``;
    when fewer were drawn (the bound was hit), the newest tied groups fill the batch (the
    last round's last tied group first). The chosen groups are returned in draw order.

    Args:
        tied_rounds: one bool tensor per round drawn, True for a tied group
            (``core_algos.tied_groups``).
        batch_groups: B, the groups of the batch.
    Raises:
        ValueError: B < 1, malformed flags, or fewer than B groups drawn in all.
    """
    _check(tied_rounds, batch_groups)
    b = int(batch_groups)
    mixed: List[Tuple[int, int]] = []
    tied: List[Tuple[int, int]] = []
    for r, flags in enumerate(tied_rounds):
        for g, is_tied in enumerate(flags.tolist()):
            (tied if is_tied else mixed).append((r, g))
    if len(mixed) + len(tied) < b:
        raise ValueError(f"{len(mixed) + len(tied)} groups drawn in {len(tied_rounds)} rounds, fewer than the "
                         f"batch's {b}")
    kept = mixed[:b]
    fill = tied[::-1][:b - len(kept)]  # the newest tied groups
    return GroupSelection(groups=tuple(sorted(kept + fill)), kept=len(kept), filled_with_tied=len(fill),
                          tied_dropped=len(tied) - len(fill), mixed_unused=len(mixed) - len(kept),
                          rounds=len(tied_rounds))
