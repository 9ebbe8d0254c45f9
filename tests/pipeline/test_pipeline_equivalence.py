"""Real gloo pipelines (megatron-core 1F1B + CompressedP2PCommunicator) against one process.

- dense codec: every loss, log-prob and gradient equals the single-process PP=1 model.
- mask codec: equals a single-process model that applies the same PRF masks
  (codec.forward_map with the same seed/boundary/step/sample ids) at the boundary; every
  rank's masks were precomputed on its background prefetch thread (both ends of a boundary
  in separate processes), none derived on the critical path.
- a FWD:BWD pair (pcaq:lrq): equals a single process applying BoundaryCodec.forward_map.
"""

import os

import torch

from distributed_util import run_ranks, run_single

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_worker.py")


def _run(tmp_path, codec, pp, first_layers=None, prompt_len=0):
    extra = (["--first-layers", str(first_layers)] if first_layers else []) + ["--prompt-len", str(prompt_len)]
    run_ranks([WORKER, "--mode", "pipeline", "--codec", codec, "--out", str(tmp_path)] + extra, pp)
    run_single([WORKER, "--mode", "reference", "--codec", codec, "--pp", str(pp), "--out", str(tmp_path)] + extra)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(pp)]
    ref = torch.load(tmp_path / "reference.pt")
    return ranks, ref


def _compare(ranks, ref, atol):
    last = ranks[-1]
    # losses and log-probs of every micro-batch (last stage)
    assert len(last["losses"]) == len(ref["losses"]) == 4
    for a, b in zip(last["losses"], ref["losses"]):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    for a, b in zip(last["logprobs"], ref["logprobs"]):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    # forward-only pass saw the same masks as the update pass
    for a, b in zip(last["fwd_logprobs"], last["logprobs"]):
        assert torch.equal(a, b)
    # every gradient, by global name; a tied output copy compares to the embedding grad
    seen = set()
    for r in ranks:
        for name, g in r["grads"].items():
            ref_name = name
            if name == "output_layer.weight" and name not in ref["grads"]:
                ref_name = "embedding.word_embeddings.weight"
            torch.testing.assert_close(g, ref["grads"][ref_name], rtol=1e-5, atol=atol,
                                       msg=lambda m: f"{name}: {m}")
            seen.add(ref_name)
    assert seen == set(ref["grads"]), set(ref["grads"]) ^ seen


def _assert_prefetched(ranks, per_boundary):
    """Every rank's masks came from the background prefetch, none derived on the critical path."""
    for r, out in enumerate(ranks):
        n = per_boundary * ((r > 0) + (r < len(ranks) - 1))  # boundaries this rank touches
        assert out["prefetch_queued"] == n
        assert out["derivations"] == {"precomputed": n, "on_demand": 0}


def test_dense_pipeline_equals_single_process(tmp_path):
    ranks, ref = _run(tmp_path, "dense", 2)
    _compare(ranks, ref, atol=1e-6)
    assert [r["prefetch_queued"] for r in ranks] == [0, 0]  # nothing to precompute
    assert [r["prepassed"] for r in ranks] == [0, 0]  # and no prepass
    m = ranks[0]["meter"]
    assert m["comm/bytes_ratio"] == 1.0


def test_mask_pipeline_equals_masked_reference(tmp_path):
    ranks, ref = _run(tmp_path, "mask", 2)
    _compare(ranks, ref, atol=1e-6)
    k, d = ranks[0]["k_d"]
    assert k == 16 and d == 64  # ceil(0.25 * 64)
    # bytes: forward sent by rank 0, backward by rank 1; each exactly k/d of dense
    f, b = ranks[0]["meter"], ranks[1]["meter"]
    assert f["comm/fwd_bytes"] == 2 * 4 * 16 * 2 * k * 4  # 2 passes x 4 mbs x [S=16, mbs=2, k] fp32
    assert b["comm/bwd_bytes"] == 4 * 16 * 2 * k * 4  # one backward pass
    assert f["comm/bytes_ratio"] == b["comm/bytes_ratio"] == k / d
    _assert_prefetched(ranks, 4)  # 4 micro-batches, one mask each per boundary, both passes


def test_mask_three_stage_uneven_pipeline(tmp_path):
    # 4 layers as 2 + 1 + 1: two boundaries, each with its own masks
    ranks, ref = _run(tmp_path, "mask", 3, first_layers=2)
    _compare(ranks, ref, atol=1e-6)
    _assert_prefetched(ranks, 4)


#: the boundary tensor [S, mbs, d] and micro-batches per pass of ``_run(..., 2)`` (the pair tests)
PAIR_SHAPE, PAIR_MICRO_BATCHES = (16, 2, 64), 4


def _run_pair(tmp_path, spec):
    """A PP=2 run of codec ``spec`` at keep ratio 0.25 compared with its single-process map;
    returns (the codec as the trainer builds it, stage 0's meter, stage 1's meter)."""
    from megatron_cegrpo.compression import build_codec

    ranks, ref = _run(tmp_path, spec, 2)
    _compare(ranks, ref, atol=1e-5)
    return build_codec(spec, 0.25), ranks[0]["meter"], ranks[1]["meter"]


def test_pair_pipeline_equals_single_process_map(tmp_path):
    """A FWD:BWD pair in a real gloo pipeline equals one process applying BoundaryCodec.forward_map
    (forward half's roundtrip, backward half's roundtrip of the gradient; per-step basis sent on
    the first message of step 7 and reused by the update pass)."""
    codec, f, b = _run_pair(tmp_path, "pcaq/rank=16:lrq")
    shape, mbs = PAIR_SHAPE, PAIR_MICRO_BATCHES
    # bytes exactly as documented: 2 passes x 4 micro-batches forward, the first one with the basis
    assert f["comm/fwd_bytes"] == (codec.bytes_per_message("fwd", shape, 4, True)
                                   + (2 * mbs - 1) * codec.bytes_per_message("fwd", shape, 4, False))
    assert b["comm/bwd_bytes"] == mbs * codec.bytes_per_message("bwd", shape, 4, False)
    assert f["comm/fwd_bytes"] <= 0.25 * 2 * mbs * 16 * 2 * 64 * 4  # within the claimed budget
    assert b["comm/bwd_bytes"] <= 0.25 * mbs * 16 * 2 * 64 * 4


def test_prepass_basis_pipeline_equals_single_process_map(tmp_path):
    """pcaq/prefix=1/prepass=1 in a real gloo pipeline, each micro-batch's 2 rows sharing their
    first 6 tokens: the boundary states there are equal (the prefix is found: p = 6); the first
    stage's prepass (a no-gradient forward of the 4 micro-batches) fits the step's basis, which the
    first message carries and both passes reuse; the pipeline equals one process that observes the
    same boundary states and then applies forward_map; bytes as documented; the last stage runs no
    prepass."""
    spec = "pcaq/rank=16/prefix=1/prepass=1:lrq"
    ranks, ref = _run(tmp_path, spec, 2, prompt_len=6)
    _compare(ranks, ref, atol=1e-5)
    assert ranks[0]["prefix_p"] == 6
    assert [r["prepassed"] for r in ranks] == [PAIR_MICRO_BATCHES, 0]
    from megatron_cegrpo.compression import build_codec

    codec, shape = build_codec(spec, 0.25), PAIR_SHAPE
    assert ranks[0]["meter"]["comm/fwd_bytes"] == (codec.bytes_per_message("fwd", shape, 4, True)
                                                   + (2 * PAIR_MICRO_BATCHES - 1) * codec.bytes_per_message(
                                                       "fwd", shape, 4, False))


def test_lowrank_pipeline_equals_projected_reference(tmp_path):
    # issue 10 item 3: the fast-owned basis is refreshed by the sender from the first micro-batch
    # of the step and shipped once; both processes hold the same Q bit for bit, the pipeline
    # equals one process applying (x Q) Q^T at the boundary, and the meter counts exactly the
    # coefficients (both directions) plus one [d, r] basis
    ranks, ref = _run(tmp_path, "lowrank", 2)
    _compare(ranks, ref, atol=1e-5)
    (q0, step0), (q1, step1) = ranks[0]["codec_state"]["fwd"]["bases"][0], ranks[1]["codec_state"]["fwd"]["bases"][0]
    assert torch.equal(q0, q1) and step0 == step1 == 7
    d, r = 64, 13
    assert q0.shape == (d, r)
    torch.testing.assert_close(q0.t() @ q0, torch.eye(r), rtol=0, atol=1e-5)
    f, b = ranks[0]["meter"], ranks[1]["meter"]
    coeff = 4 * 16 * 2 * r * 4  # one pass: 4 micro-batches x [S=16, mbs=2, r] fp32
    assert f["comm/basis_bytes"] == d * r * 4
    assert f["comm/fwd_bytes"] == 2 * coeff + d * r * 4
    assert b["comm/bwd_bytes"] == coeff
    dense = 3 * 4 * 16 * 2 * d * 4
    assert (f["comm/fwd_bytes"] + b["comm/bwd_bytes"]) / dense <= 0.25


def test_rpq_pair_pipeline_equals_single_process_map(tmp_path):
    """rpq (compression/repeat.py) in a real gloo pipeline: the forward-only pass's crossings are
    first crossings, the update pass's are repeats of the same tensors, decoded bit for bit as
    the first; so the pipeline equals one process applying BoundaryCodec.forward_map once per
    micro-batch, and the bytes are 4 first crossings (each with its own basis, the default) + 4 repeats."""
    from megatron_cegrpo.compression.spec import spec_bytes

    codec, f, b = _run_pair(tmp_path, "rpq/rank=16:lrq")
    shape, mbs = PAIR_SHAPE, PAIR_MICRO_BATCHES
    h = codec.fwd
    assert f["comm/fwd_bytes"] == (h.nbytes(shape, 4, True) + (mbs - 1) * h.nbytes(shape, 4, False)
                                   + mbs * h.nbytes(shape, 4, False, repeat=True)) == spec_bytes(codec, shape, 4, 8, 4)[0]
    assert b["comm/bwd_bytes"] == mbs * codec.bytes_per_message("bwd", shape, 4, False)
    assert f["comm/fwd_bytes"] + b["comm/bwd_bytes"] <= 0.25 * 3 * mbs * 16 * 2 * 64 * 4  # both directions


def test_lagged_basis_pair_pipeline_equals_single_process_map(tmp_path):
    """lag=1 halves (compression/subspace.py: each message carries the basis a background thread
    built from the previous message at that boundary) in a real gloo pipeline: the sender's
    sequence of messages, and so every lagged basis, is the single-process map's; bytes as lag=0."""
    from megatron_cegrpo.compression import build_codec

    codec, f, b = _run_pair(tmp_path, "rpq/rank=16/warm=1/lag=1:lrq/warm=1/lag=1")
    plain = build_codec("rpq/rank=16:lrq", 0.25)
    shape, mbs = PAIR_SHAPE, PAIR_MICRO_BATCHES
    h = plain.fwd
    assert f["comm/fwd_bytes"] == (h.nbytes(shape, 4, True) + (mbs - 1) * h.nbytes(shape, 4, False)
                                   + mbs * h.nbytes(shape, 4, False, repeat=True))
    assert b["comm/bwd_bytes"] == mbs * plain.bytes_per_message("bwd", shape, 4, False)
