"""Per-iteration metrics of every stage, reduced on the driver by a declared rule per key.

Each stage reports a flat dict of numbers; every key matches exactly one declared prefix
and its reduction over the stages (in stage order):

- ``sum``: bytes, token counts, squared norms;
- ``min``: flags that hold only if every stage agrees (``anchor/alive``);
- ``first``: values every stage shares (the schedule's ``anchor/fire``);
- ``stages``: the list of per-stage values (a derived metric reads it);
- ``max``: a deviation that must be 0 everywhere (``anchor/sign_dev_across_dp``).

With data parallelism (issue 14) the replicas of each stage are merged first
(:meth:`StageMetricsReducer.merge_replicas`): bytes and sums add up over the replicas, ``min``
and ``max`` keep their meaning, and ``first`` / ``stages`` values (the replicas hold the same
weights and follow the same schedule) are replica 0's.

With tensor parallelism the TP ranks of each stage are merged before anything else
(:meth:`StageMetricsReducer.merge_tp_ranks`): every TP rank reports what it sent and the sums over
the parameters it counts (its TP shards, the replicated ones on TP rank 0 only), so ``sum`` and
``stages`` values add up over the TP ranks (a ``stages`` list elementwise); ``min``, ``max`` and
``first`` keep their meaning.

Keys starting with ``_`` are inputs of derived metrics (``derive`` callbacks) and are
dropped from the log after the derivation.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

__all__ = ["StageMetricsReducer"]

_OPS = {
    "sum": lambda vals: sum(vals),
    "min": lambda vals: min(vals),
    "first": lambda vals: vals[0],
    "stages": lambda vals: list(vals),
    "max": lambda vals: max(vals),
}

#: how the data-parallel replicas of one stage merge, per stage-reduction op
_REPLICA_OPS = {"sum": "sum", "min": "min", "max": "max", "first": "first", "stages": "first"}


def _add(vals):
    """Sum numbers, or lists of numbers elementwise (a ``stages`` key's per-step list)."""
    if isinstance(vals[0], (list, tuple)):
        return [sum(x) for x in zip(*vals)]
    return sum(vals)


#: how the tensor-parallel ranks of one stage merge, per stage-reduction op
_TP_OPS = {"sum": _add, "stages": _add, "min": _OPS["min"], "max": _OPS["max"], "first": _OPS["first"]}


class StageMetricsReducer:
    """Declare ``(prefix, reduction)`` rules and derived metrics; reduce gathered stage dicts."""

    def __init__(self):
        self._rules: List[Tuple[str, str]] = []
        self._derive: List[Callable[[Dict], Dict]] = []

    def declare(self, prefix: str, op: str) -> "StageMetricsReducer":
        """Reduce every key starting with ``prefix`` by ``op`` (sum, min, first, stages).

        Raises:
            ValueError: an unknown op, or a prefix that overlaps an earlier declaration.
        """
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}; one of {', '.join(_OPS)}")
        for p, _ in self._rules:
            if p.startswith(prefix) or prefix.startswith(p):
                raise ValueError(f"metric prefix {prefix!r} overlaps {p!r}")
        self._rules.append((prefix, op))
        return self

    def derive(self, fn: Callable[[Dict], Dict]) -> "StageMetricsReducer":
        """``fn(reduced) -> metrics`` runs after the reduction, in declaration order."""
        self._derive.append(fn)
        return self

    def _op(self, key: str) -> str:
        for prefix, op in self._rules:
            if key.startswith(prefix):
                return op
        raise KeyError(f"stage metric {key!r} has no declared reduction")

    def merge_replicas(self, replicas: List[Dict[str, float]]) -> Dict[str, float]:
        """One stage's dict from its data-parallel replicas' (replica order), by each key's
        declared op (``_REPLICA_OPS``). Raises KeyError for an undeclared key."""
        keys: List[str] = []
        for d in replicas:
            keys.extend(k for k in d if k not in keys)
        return {k: _OPS[_REPLICA_OPS[self._op(k)]]([d[k] for d in replicas if k in d]) for k in keys}

    def merge_tp_ranks(self, ranks: List[Dict]) -> Dict:
        """One stage's dict from its tensor-parallel ranks' (TP rank order), by each key's declared
        op (``_TP_OPS``: ``sum`` and ``stages`` add, lists elementwise). Each rank's sums must count
        a replicated parameter on one TP rank only. Raises KeyError for an undeclared key."""
        keys: List[str] = []
        for d in ranks:
            keys.extend(k for k in d if k not in keys)
        return {k: _TP_OPS[self._op(k)]([d[k] for d in ranks if k in d]) for k in keys}

    def reduce(self, gathered: List[Dict[str, float]]) -> Dict:
        """Reduce the stages' dicts (stage order) by the declared rules, then derive.

        Keys are reduced in first-seen order; a key missing on some stage is reduced over
        the stages that have it. Raises KeyError for an undeclared key.
        """
        keys: List[str] = []
        for d in gathered:
            keys.extend(k for k in d if k not in keys)
        out = {k: _OPS[self._op(k)]([d[k] for d in gathered if k in d]) for k in keys}
        for fn in self._derive:
            out.update(fn(out))
        return {k: v for k, v in out.items() if not k.startswith("_")}
