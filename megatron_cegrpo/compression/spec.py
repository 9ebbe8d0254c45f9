"""The one parser of ``--boundary-codec`` specs, and the byte-budget check.

Grammar (issue 10, item 4)::

    SPEC   := NAME                      a codec that goes alone, in both directions
                                        (dense, mask, lowrank: ``alone``)
            | HALF ":" HALF             forward half ":" backward half
    HALF   := NAME ("/" KEY "=" VALUE)*  a registered codec (halves.py: one registry) with
                                         optional parameters, e.g. pcaq/rank=96

Examples: ``mask``; ``mask:mask`` (bit-identical to ``mask``); ``pcaq:lrq``;
``pcaq/rank=96/share=0.1:lrq/rank=32``; ``dense:mask``. A ``coupled`` codec (``lowrank``: both
directions share one basis) only goes alone; ``pcaq``, ``lrq``, ``rpq`` only in a pair. ``--boundary-keep-ratio`` is the byte budget
every compressing half is sized for (its default parameters follow from it).

:func:`build_codec` is THE constructor of a codec (the run plan, tools, benchmarks): it parses
and validates the syntax and the parameters. :func:`check_codec_budget` is the start-up check of
a spec's documented bytes against the budget it claims (``train.preflight``).

Pure Python/tensor code: no torch.distributed.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .codecs import BoundaryCodec
from .halves import available_halves, get_half, half_class, half_params
from .prf import keep_count

__all__ = ["CodecSpec", "available_codecs", "pair_halves", "parse_codec_spec", "build_codec", "check_codec_budget", "spec_bytes"]

_HALF_RE = re.compile(r"^[a-z][a-z0-9_]*(/[a-z_]+=[0-9.eE+-]+)*$")


def available_codecs() -> List[str]:
    """Sorted names of the codecs that go alone (``--boundary-codec NAME``: the halves that declare
    ``alone``: dense, lowrank, mask); every other registered half only goes in a ``FWD:BWD`` pair."""
    return sorted(n for n in available_halves() if half_class(n).alone)


def pair_halves() -> List[str]:
    """Sorted names usable on either side of ``FWD:BWD`` (every half but the ``coupled`` ones)."""
    return sorted(n for n in available_halves() if not half_class(n).coupled)


@dataclass(frozen=True)
class CodecSpec:
    """A parsed spec: the ``fwd``/``bwd`` halves with their params; ``single`` is the name when the
    spec named one codec for both directions ("" for ``FWD:BWD``)."""

    text: str
    fwd: str
    bwd: str
    fwd_params: Dict[str, str] = field(default_factory=dict)
    bwd_params: Dict[str, str] = field(default_factory=dict)
    single: str = ""


def _parse_half(text: str, which: str) -> Tuple[str, Dict[str, str]]:
    if not _HALF_RE.match(text):
        raise ValueError(f"{which} half {text!r} is not NAME or NAME/key=value/...")
    name, *pairs = text.split("/")
    if name not in available_halves():
        raise ValueError(f"unknown {which} half {name!r}; valid halves: {', '.join(pair_halves())}")
    params: Dict[str, str] = {}
    for p in pairs:
        k, v = p.split("=", 1)
        if k in params:
            raise ValueError(f"{which} half {text!r} sets {k} twice")
        params[k] = v
    half_params(name, params)
    return name, params


def parse_codec_spec(text: str) -> CodecSpec:
    """Parse a ``--boundary-codec`` value (grammar in the module docstring) and type-check its
    parameters (:func:`~megatron_cegrpo.compression.halves.half_params`); builds nothing (a
    parameter's range is checked when :func:`build_codec` constructs the half).

    Raises:
        ValueError: empty, more than one ':', an unknown name, a malformed half, an unknown or
        non-numeric parameter, a coupled codec in a pair; the message lists the valid names.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("empty codec spec")
    text = text.strip()
    if ":" not in text:
        if text not in available_codecs():
            raise ValueError(f"unknown codec {text!r}; valid names: {', '.join(available_codecs())}, "
                             f"or FWD:BWD with halves from {', '.join(pair_halves())}")
        return CodecSpec(text=text, fwd=text, bwd=text, single=text)
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"{text!r} has {len(parts) - 1} ':'; a pair is FWD:BWD")
    (f, fp), (b, bp) = _parse_half(parts[0], "forward"), _parse_half(parts[1], "backward")
    for name in (f, b):
        if half_class(name).coupled:
            raise ValueError(f"{name} couples its two directions (one basis for both): use --boundary-codec "
                             f"{name} alone, not in {text!r}")
    return CodecSpec(text=text, fwd=f, bwd=b, fwd_params=fp, bwd_params=bp)


def build_codec(spec: str, keep_ratio: float = 0.05, *, warn: bool = True, **options) -> BoundaryCodec:
    """The codec for ``--boundary-codec spec --boundary-keep-ratio keep_ratio``: a
    :class:`BoundaryCodec` of two halves from the one registry.

    Each half that claims the budget (``DirectionCodec.claims_budget``: all but ``dense``) is
    sized for ``keep_ratio``; for ``dense`` it does not apply and a warning says so when it
    differs from 0.05 (``warn=False``: no warning). Each of ``options``
    (``TrainConfig.boundary_codec_options``: the lowrank basis owner, tokens per iteration, ...)
    goes to a half's constructor only when the half declares it (``DirectionCodec.RUN_OPTIONS``).
    A single name is that codec in both directions: its backward is
    :meth:`~megatron_cegrpo.compression.halves.DirectionCodec.own_backward` (the same instance
    for ``dense`` and ``mask``, a view of the same basis for ``lowrank``).

    Raises:
        ValueError: malformed spec, unknown name, bad parameter, keep_ratio outside (0, 1], a
            coupled codec in a pair.
    """
    keep_count(1, keep_ratio)  # validates the ratio
    p = parse_codec_spec(spec)
    fwd = get_half(p.fwd, keep_ratio, p.fwd_params, options)
    bwd = fwd.own_backward() if p.single else get_half(p.bwd, keep_ratio, p.bwd_params, options)
    codec = BoundaryCodec(fwd, bwd, spec=p.text)
    if not codec.claims_budget and keep_ratio != 0.05 and warn:
        warnings.warn(f"--boundary-keep-ratio {keep_ratio} is ignored by --boundary-codec {p.text}")
    return codec


def spec_bytes(codec: BoundaryCodec, shape, elem: int, fwd_messages: int, bwd_messages: int) -> Tuple[int, int]:
    """Documented wire bytes (fwd, bwd) of one step's messages of ``shape`` (s, b, d), ``elem``
    bytes per wire element.

    Each half's :meth:`~megatron_cegrpo.compression.halves.DirectionCodec.step_nbytes` with the
    direction's message count and ``bwd_messages`` (or, without a backward, ``fwd_messages``)
    distinct micro-batches: by default the first message carries any per-step basis; ``rpq``
    counts each micro-batch's first crossing as a full one and the others as repeats."""
    counts = {"fwd": int(fwd_messages), "bwd": int(bwd_messages)}
    keys = counts["bwd"] or counts["fwd"]  # distinct micro-batches: those of the update pass(es)
    return (codec.fwd.step_nbytes(tuple(shape), elem, counts["fwd"], keys),
            codec.bwd.step_nbytes(tuple(shape), elem, counts["bwd"], keys))


def check_codec_budget(codec: BoundaryCodec, keep_ratio: float, shape, messages: int, elem: int = 4,
                       bwd_messages: int = None) -> None:
    """Reject a codec whose documented bytes exceed the budget ``keep_ratio`` claims.

    Budget per direction and step: ``messages * s * b * keep_count(d, keep_ratio) * elem``
    (the exact-k mask's bytes at this ratio), for ``messages`` forward and ``bwd_messages``
    (default: ``messages``) backward micro-batches of ``shape`` = (s, b, d) in one step (a
    per-step basis is paid once). The per-step basis of ``pcaq`` is amortised over fewer
    bytes when micro-batches are shorter than ``shape``: the run's ``comm/bytes_ratio``
    (measured from the payloads) is the truth. The single-name ``dense`` codec (the
    uncompressed control) claims no budget and is not checked.

    Raises:
        ValueError: the direction, its bytes and the budget.
    """
    if not codec.claims_budget:
        return
    s, b, d = (int(v) for v in shape)
    counts = (int(messages), int(messages if bwd_messages is None else bwd_messages))
    sent = spec_bytes(codec, (s, b, d), elem, *counts)
    for direction, nbytes, m in zip(("forward", "backward"), sent, counts):
        budget, dense = m * s * b * keep_count(d, keep_ratio) * elem, m * s * b * d * elem
        if nbytes > budget:
            raise ValueError(f"{direction} sends {nbytes} B per step ({nbytes / dense:.2%} of dense) > the "
                             f"budget {budget} B ({budget / dense:.2%}) of keep ratio {keep_ratio:g} at micro-batch "
                             f"shape {(s, b, d)} x {m}")
