"""The one parser of ``--boundary-codec`` specs, and the byte-budget check.

Grammar (issue 10, item 4)::

    SPEC   := NAME                      a registered BoundaryCodec, both directions
                                        (dense, mask, and any later registration)
            | HALF ":" HALF             forward half ":" backward half (PairCodec)
    HALF   := HNAME ("/" KEY "=" VALUE)*  a registered half (dense, mask, pcaq, lrq)
                                          with optional parameters, e.g. pcaq/rank=96

Examples: ``mask``; ``mask:mask`` (bit-identical to ``mask``); ``pcaq:lrq``;
``pcaq/rank=96/share=0.1:lrq/rank=32``; ``dense:mask``. ``--boundary-keep-ratio`` is the
byte budget every compressing half is sized for (its default parameters follow from it).

:func:`build_codec` is THE entry point (trainer, tools/codec_fidelity.py): it parses and
validates the syntax and the parameters. :func:`check_codec_budget` is the start-up check of
a spec's documented bytes against the budget it claims (``train.preflight``).

Pure Python/tensor code: no torch.distributed.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, Tuple

from .codecs import _REGISTRY, BoundaryCodec, available_codecs
from .halves import available_halves, get_half
from .pair import PairCodec
from .prf import keep_count

__all__ = ["CodecSpec", "parse_codec_spec", "build_codec", "check_codec_budget", "spec_bytes"]

_HALF_RE = re.compile(r"^[a-z][a-z0-9_]*(/[a-z_]+=[0-9.eE+-]+)*$")


@dataclass(frozen=True)
class CodecSpec:
    """A parsed spec: ``single`` (a registered codec name) or ``fwd``/``bwd`` halves with params."""

    text: str
    single: str = ""
    fwd: str = ""
    bwd: str = ""
    fwd_params: Dict[str, str] = field(default_factory=dict)
    bwd_params: Dict[str, str] = field(default_factory=dict)


def _parse_half(text: str, which: str) -> Tuple[str, Dict[str, str]]:
    if not _HALF_RE.match(text):
        raise ValueError(f"{which} half {text!r} is not NAME or NAME/key=value/...")
    name, *pairs = text.split("/")
    if name not in available_halves():
        raise ValueError(f"unknown {which} half {name!r}; valid halves: {', '.join(available_halves())}")
    params: Dict[str, str] = {}
    for p in pairs:
        k, v = p.split("=", 1)
        if k in params:
            raise ValueError(f"{which} half {text!r} sets {k} twice")
        params[k] = v
    return name, params


def parse_codec_spec(text: str) -> CodecSpec:
    """Parse a ``--boundary-codec`` value (grammar in the module docstring).

    Raises:
        ValueError: empty, more than one ':', an unknown name or a malformed half; the
        message lists the valid names.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("empty codec spec")
    text = text.strip()
    if ":" not in text:
        if text not in available_codecs():
            raise ValueError(f"unknown codec {text!r}; valid names: {', '.join(available_codecs())}, "
                             f"or FWD:BWD with halves from {', '.join(available_halves())}")
        return CodecSpec(text=text, single=text)
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"{text!r} has {len(parts) - 1} ':'; a pair is FWD:BWD")
    (f, fp), (b, bp) = _parse_half(parts[0], "forward"), _parse_half(parts[1], "backward")
    return CodecSpec(text=text, fwd=f, bwd=b, fwd_params=fp, bwd_params=bp)


def build_codec(spec: str, keep_ratio: float, *, warn: bool = True, **options) -> BoundaryCodec:
    """The codec for ``--boundary-codec spec --boundary-keep-ratio keep_ratio``.

    A single registered name gets ``keep_ratio`` when it claims the budget
    (``BoundaryCodec.claims_budget``: ``mask``, ``lowrank``); for ``dense`` it does not apply and
    a warning says so when it differs from 0.05 (``warn=False``: no warning, for the start-up
    checks that build a codec only to validate it). Each of ``options``
    (``TrainConfig.boundary_codec_options``: the lowrank basis owner, tokens per iteration, ...)
    goes to a single codec's constructor only when the codec declares it
    (``BoundaryCodec.RUN_OPTIONS``). A pair gets a :class:`PairCodec` of its two halves, each
    sized for ``keep_ratio``.

    Raises:
        ValueError: malformed spec, unknown name, bad parameter, keep_ratio outside (0, 1].
    """
    keep_count(1, keep_ratio)  # validates the ratio
    p = parse_codec_spec(spec)
    if p.single:
        cls = _REGISTRY[p.single]
        kwargs = {k: v for k, v in options.items() if k in cls.RUN_OPTIONS}
        if cls.claims_budget:
            return cls(keep_ratio=keep_ratio, **kwargs)
        if keep_ratio != 0.05 and warn:
            warnings.warn(f"--boundary-keep-ratio {keep_ratio} is ignored by --boundary-codec {p.single}")
        return cls(**kwargs)
    return PairCodec(get_half(p.fwd, keep_ratio, p.fwd_params), get_half(p.bwd, keep_ratio, p.bwd_params),
                     spec=p.text)


def spec_bytes(codec: BoundaryCodec, shape, elem: int, fwd_messages: int, bwd_messages: int) -> Tuple[int, int]:
    """Documented wire bytes (fwd, bwd) of one step's messages of ``shape`` (s, b, d), ``elem``
    bytes per wire element.

    A pair asks each half's :meth:`~megatron_cegrpo.compression.halves.DirectionCodec.step_nbytes`
    with the direction's message count and ``bwd_messages`` (or, without a backward,
    ``fwd_messages``) distinct micro-batches: by default the first message carries any per-step
    basis; ``rpq`` counts each micro-batch's first crossing as a full one and the others as
    repeats. A single-name codec sends ``payload_shape`` elements per message."""
    counts = {"fwd": int(fwd_messages), "bwd": int(bwd_messages)}
    if isinstance(codec, PairCodec):
        keys = counts["bwd"] or counts["fwd"]  # distinct micro-batches: those of the update pass(es)
        return (codec.fwd.step_nbytes(shape, elem, counts["fwd"], keys),
                codec.bwd.step_nbytes(shape, elem, counts["bwd"], keys))
    n = 1
    for v in codec.payload_shape(tuple(shape)):
        n *= int(v)
    return counts["fwd"] * n * elem, counts["bwd"] * n * elem


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
