"""The stateful codecs at tensor-parallel size 2 (issue 14): every TP rank encodes the same bits.

With sequence parallelism off the TP ranks of a stage hold bit-identical boundary tensors; the
communicator lets each send 1/T of every payload (and of a ``lowrank`` basis), which is only
right if every TP rank's codec produces bit-identical payloads, bases and state, in separate
processes (eigh, QR, topk, the quantiser on identical inputs). ``tp_codec_worker.py`` runs each
codec on 2 real gloo processes (2 threads each) through two iterations of old-logprob, reference
and update passes (forward and the update's backward, both ends of the boundary); this test checks:

- every payload, basis, decoded tensor (both directions, both ends) and the final warm-started
  ``lowrank`` Q hash the same on both ranks;
- the split bytes: the two pieces sum to the payload's bytes plus at most one padding element, the
  payload's bytes are the documented ones (``BoundaryCodec.bytes_per_message``; ``lowrank``: s b r
  elements a message and d r for the basis once per iteration; ``rpq``: a first crossing or a
  repeat, ``RepeatPcaHalf.nbytes``), and the all-gather of the pieces
  rebuilds the payload bit for bit.
"""

import json
import math
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from distributed_util import run_ranks  # noqa: E402

sys.path.insert(0, HERE)
from tp_codec_specs import B, D, OPTIONS, S, SPECS  # noqa: E402  (not the worker: it bootstraps on import)

TP = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_codecs")
    run_ranks([os.path.join(HERE, "tp_codec_worker.py"), str(d), "2"], TP, timeout=600)
    return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(TP)]


@pytest.mark.parametrize("spec", [s for s, _ in SPECS])
def test_every_tp_rank_encodes_bit_identical_payloads_bases_and_state(ranks, spec):
    a, b = (r["codecs"][spec] for r in ranks)
    assert ranks[0]["threads"] == ranks[1]["threads"] == 2
    assert len(a) == len(b) == len([m for m in a if m["dir"] != "state"]) + (spec == "lowrank")
    keys = ("sha", "decoded_sha", "sent_decode_sha", "recv_sha", "bytes")
    for ma, mb in zip(a, b):
        for k in keys:
            assert ma.get(k) == mb.get(k), (spec, ma.get("step"), ma.get("pass"), ma.get("mb"), ma["dir"], k)
        if "basis" in ma:
            assert ma["basis"]["sha"] == mb["basis"]["sha"], (spec, ma["step"])
    if spec == "lowrank":  # both ends hold the same warm-started Q (the receiver's came whole)
        assert a[-1]["sha"] == a[-1]["recv_sha"]
    # not vacuous: the codec's messages differ between iterations and directions
    assert len({m["sha"] for m in a if m["dir"] == "fwd"}) > 4


def _documented(spec: str, msg: dict) -> int:
    from megatron_cegrpo.compression import build_codec

    codec = build_codec(spec, dict(SPECS)[spec], warn=False, **OPTIONS)
    if spec == "lowrank":
        return S * B * codec.fwd.rank(D) * 4
    if spec == "mask":
        return S * B * codec.fwd.k(D) * 4
    return None


@pytest.mark.parametrize("spec", [s for s, _ in SPECS])
def test_the_split_pieces_sum_to_the_documented_payload_bytes(ranks, spec):
    from megatron_cegrpo.compression import build_codec

    codec = build_codec(spec, dict(SPECS)[spec], warn=False, **OPTIONS)
    msgs = [list(zip(*(r["codecs"][spec] for r in ranks)))][0]
    fwd_total = 0
    for pair in msgs:
        m = pair[0]
        if m["dir"] == "state":
            continue
        assert all(p["rejoined"] for p in pair), (spec, m)
        elem = 4
        pieces = sum(p["piece_bytes"] for p in pair)
        assert m["bytes"] <= pieces <= m["bytes"] + (TP - 1) * elem and pieces == TP * math.ceil(m["bytes"] / elem / TP) * elem
        if m["dir"] == "fwd":
            assert m["bytes"] == math.prod(m["wire_shape"]) * elem  # what the receiver expected
            fwd_total += m["bytes"]
        if spec in ("lowrank", "mask"):
            assert m["bytes"] == _documented(spec, m), (spec, m)
        elif spec.startswith("rpq") and m["dir"] == "fwd":
            # rpq: a micro-batch's first crossing of the step (the old-logprob pass) is coded whole, with
            # a basis (own=1: every first crossing; own=0: the step's first); the reference and update
            # passes' crossings of it are repeats, coded against it at the small repeat budget
            repeat = m["pass"] != "old"
            first = not repeat and (codec.fwd.own == 1 or m["mb"] == 0)
            assert m["bytes"] == codec.fwd.nbytes((S, B, D), elem, first, repeat=repeat), (spec, m)
        elif m["dir"] == "bwd":
            # lrq: a basis in every message; pcaq: in the step's first backward message only
            assert m["bytes"] == codec.bytes_per_message("bwd", (S, B, D), elem, m["mb"] == 0), (spec, m)
        if "basis" in m:
            assert spec == "lowrank" and m["pass"] == "old" and m["mb"] == 0
            assert m["basis"]["bytes"] == D * codec.fwd.rank(D) * elem and all(p["basis"]["rejoined"] for p in pair)
            assert sum(p["basis"]["piece_bytes"] for p in pair) == m["basis"]["bytes"]  # d r divides by 2: no padding
    if spec.startswith("rpq"):  # not vacuous: a repeat is far smaller than a first crossing
        assert codec.fwd.nbytes((S, B, D), 4, False, repeat=True) < codec.fwd.nbytes((S, B, D), 4, False) / 4
    if spec.startswith("pcaq"):  # per step: the first message carries the basis, the rest do not
        first = codec.bytes_per_message("fwd", (S, B, D), 4, True)
        later = codec.bytes_per_message("fwd", (S, B, D), 4, False)
        assert first > later and fwd_total == 2 * (first + 5 * later)
    if spec == "lowrank":
        assert sum(1 for m in ranks[0]["codecs"][spec] if "basis" in m) == 2  # one basis per iteration
