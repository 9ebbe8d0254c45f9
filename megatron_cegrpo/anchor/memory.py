"""The anchor's memory M: an fp32 moving average of the stale-weight gradient.

``M <- a M + (1 - a) G_anc`` with ``a = decay`` (``--anchor-ema-decay``,
default 0.25), for every tensor, in fp32 (DESIGN.md section 4).  M starts at
zero and the first update applies the same formula, so ``M_1 = (1 - a) G_1``
(0.75 G_1 at the default); there is no bias correction.  The anchor's product
is ``sign(M)`` with 0 -> +1 (:meth:`AnchorMemory.signs`, or
:meth:`AnchorMemory.packed_signs` for the 1-bit wire form).

A zero M carries no direction (issue "zero M"; found by the SmolLM2 study, where the first
fire replayed a batch whose every response scored 0: all advantages 0, G_anc = 0, M = 0,
and sign(M) = +1 everywhere pushed every corrected weight the same way for c steps).
Two granularities:

- a whole tensor whose M is exactly 0 (in particular all of M before the first informative
  replay) is flagged uninformative (:meth:`AnchorMemory.informative`); the anchor sends that
  flag with the signs and the stage's hook leaves that tensor's gradient unchanged;
- a zero coordinate inside a non-zero tensor still reads +1 on the 1-bit wire (there is no
  third value): its corrected gradient is ``alpha g + beta |g| >= 0`` instead of ``g``, i.e.
  a coordinate whose fast gradient is negative gets ``-(beta - alpha) |g|`` flipped to the
  wrong side by ``(alpha + beta) |g|`` per step until the anchor sees it.  Possible cause:
  rows of an *untied* input embedding for tokens the anchor never replayed (a tied
  embedding gets a gradient in every row through the output softmax, so this is rare).
  :meth:`AnchorMemory.zero_fraction` measures it (``anchor/m_zero_frac``, logged at every
  fire). Measured 2026-12-01: 0.0 at every informative fire of the tiny recorded run
  (tests/equivalence, tiny-llama tied, c = K = 2) and of tests/anchor/test_anchor_e2e.py,
  1.0 at a fire that replayed a reward-free batch (then no signs are sent at all).

Pure tensor code, no torch.distributed; the state is a plain dict of
ints/floats/tensors.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .signs import pack_sign_list

__all__ = ["AnchorMemory"]

NamesAndShapes = Union[Mapping[str, Sequence[int]], Iterable[Tuple[str, Sequence[int]]]]


class AnchorMemory:
    """M per parameter, fp32.

    Args:
        names_and_shapes: ``{name: shape}`` or ``[(name, shape), ...]``; the
            order is kept (it is the order of :meth:`packed_signs`).
        decay: a in ``[0, 1)``.
        device: where M lives (default CPU).
    """

    def __init__(self, names_and_shapes: NamesAndShapes, decay: float = 0.25, device=None):
        items = list(names_and_shapes.items()) if isinstance(names_and_shapes, Mapping) else list(names_and_shapes)
        if not items:
            raise ValueError("AnchorMemory needs at least one parameter")
        decay = float(decay)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"anchor EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._m: Dict[str, torch.Tensor] = {}
        for name, shape in items:
            if name in self._m:
                raise ValueError(f"duplicate parameter name {name!r}")
            self._m[name] = torch.zeros(tuple(int(d) for d in shape), dtype=torch.float32, device=device)
        self.num_updates = 0

    @property
    def names(self) -> List[str]:
        return list(self._m)

    @property
    def is_set(self) -> bool:
        """False until the first :meth:`update`."""
        return self.num_updates > 0

    def update(self, grads: Mapping[str, torch.Tensor]) -> None:
        """``M <- a M + (1 - a) G`` for every parameter (G cast to fp32).

        Raises:
            ValueError: ``grads`` names differ from M's, or a shape differs.
                Nothing is updated in that case.
        """
        if set(grads) != set(self._m):
            raise ValueError(
                "anchor gradient names differ from M: "
                f"missing={sorted(set(self._m) - set(grads))}, extra={sorted(set(grads) - set(self._m))}"
            )
        for name, m in self._m.items():
            if tuple(grads[name].shape) != tuple(m.shape):
                raise ValueError(f"gradient {name!r} has shape {tuple(grads[name].shape)}, M has {tuple(m.shape)}")
        for name, m in self._m.items():
            g = grads[name].detach().to(device=m.device, dtype=torch.float32)
            m.mul_(self.decay).add_(g, alpha=1.0 - self.decay)
        self.num_updates += 1

    def _select(self, names: Optional[Iterable[str]]) -> List[str]:
        if not self.is_set:
            raise RuntimeError("sign(M) requested before the first update: an unset M has no direction")
        selected = self.names if names is None else list(names)
        unknown = [n for n in selected if n not in self._m]
        if unknown:
            raise KeyError(f"unknown parameter names: {unknown}")
        return selected

    def signs(self, names: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
        """``{name: sign(M)}`` as fp32 -1/+1 tensors (0 -> +1); all names by default.

        Raises:
            RuntimeError: before the first update.
            KeyError: an unknown name.
        """
        return {n: torch.where(self._m[n] >= 0, 1.0, -1.0).to(torch.float32) for n in self._select(names)}

    def packed_signs(self, names: Optional[Iterable[str]] = None) -> Tuple[torch.Tensor, List[int]]:
        """``sign(M)`` of ``names`` (default: all, construction order) as one
        :func:`~megatron_cegrpo.anchor.signs.pack_sign_list` buffer."""
        return pack_sign_list([self._m[n] for n in self._select(names)])

    def informative(self, names: Optional[Iterable[str]] = None) -> List[bool]:
        """Per tensor of ``names`` (default: all, construction order): False where M is exactly 0
        everywhere (its sign carries no information; the stage applies no correction there).
        All False before the first update."""
        selected = self.names if names is None else list(names)
        return [bool(torch.count_nonzero(self._m[n])) for n in selected]

    def zero_fraction(self) -> float:
        """``anchor/m_zero_frac``: the fraction of M's coordinates (all parameters, each once)
        that are exactly 0 (sign +1 on the wire, see the module docstring); 1.0 before the first
        update."""
        zeros = total = 0
        for m in self._m.values():
            zeros += m.numel() - int(torch.count_nonzero(m))
            total += m.numel()
        return zeros / total if total else 1.0

    def tensor(self, name: str) -> torch.Tensor:
        """M for ``name`` (the stored tensor; do not modify in place)."""
        return self._m[name]

    def norm(self) -> float:
        """Global L2 norm of M over all parameters (accumulated in float64)."""
        total = 0.0
        for m in self._m.values():
            total += float(torch.linalg.vector_norm(m, dtype=torch.float64)) ** 2
        return math.sqrt(total)

    def state_dict(self) -> dict:
        """Plain dict: decay, num_updates, names and M (stored tensors, not copies)."""
        return {
            "decay": self.decay,
            "num_updates": self.num_updates,
            "names": self.names,
            "M": dict(self._m),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict` (tensors copied into M's storage).

        Raises:
            ValueError: different decay, parameter names or shapes.
        """
        for key in ("decay", "num_updates", "names", "M"):
            if key not in state:
                raise ValueError(f"anchor memory state is missing {key!r}")
        if float(state["decay"]) != self.decay:
            raise ValueError(f"anchor memory state has decay={state['decay']}, this memory has {self.decay}")
        if list(state["names"]) != self.names or set(state["M"]) != set(self._m):
            raise ValueError("anchor memory state has different parameter names")
        for name, m in self._m.items():
            if tuple(state["M"][name].shape) != tuple(m.shape):
                got = tuple(state["M"][name].shape)
                raise ValueError(f"anchor memory state: {name!r} has shape {got}, M has {tuple(m.shape)}")
        for name, m in self._m.items():
            m.copy_(state["M"][name])
        self.num_updates = int(state["num_updates"])
