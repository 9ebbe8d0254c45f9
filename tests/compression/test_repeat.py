"""The ``rpq`` forward half (compression/repeat.py): first crossings of a micro-batch get the
budget of all its crossings, later crossings a coded delta; bytes exactly as documented, both
ends in separate processes, the budget check and the start-up rejection naming the flags."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_cegrpo.compression import BoundaryContext, build_codec, check_codec_budget
from megatron_cegrpo.compression.spec import spec_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = (12, 2, 40)


def _ctx(step=4, ids=(0, 1)):
    return BoundaryContext(seed=1, boundary=0, step=step, sample_ids=torch.tensor(list(ids)))


def _data(seed, shape=SHAPE, rank=6, basis_seed=0):
    """Rank-``rank`` data on a basis that depends on ``basis_seed`` only, plus 1 % noise."""
    g, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(1000 + basis_seed)
    s, b, d = shape
    return (torch.randn(s, b, rank, generator=g) * torch.logspace(1, -1, rank)) @ torch.randn(rank, d, generator=gb) \
        + 0.01 * torch.randn(s, b, d, generator=g)


def _rel(a, b):
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


# the messages of one two-step "iteration": per step, 2 micro-batches x 3 passes; pass 2 (the
# "reference") changes the tensor, pass 3 (the "update") resends pass 1's tensor bit for bit
def _iteration():
    msgs = []
    for step in (4, 5):
        xs = {ids: _data(10 * step + ids[0], basis_seed=step) for ids in ((0, 1), (2, 3))}
        for p in range(3):
            for ids, x in xs.items():
                msgs.append((x + 0.05 * _data(99, rank=2, basis_seed=step) if p == 1 else x, step, ids, p))
    return msgs


@pytest.mark.parametrize("own", [0, 1])
def test_bytes_exactly_as_documented_and_repeats_decode_the_first_bit_for_bit(own):
    """Per message: first crossing of the step (with a step basis, own=0) / other first
    crossings / repeats, each equal to the module docstring's formula; an unchanged resend
    decodes to exactly the first crossing's tensor; a changed one adds its coded delta."""
    spec = f"rpq/rank=10/own={own}/repeat=0.05:lrq/rank=4"
    sender, receiver = build_codec(spec, 0.25), build_codec(spec, 0.25)
    h, (s, b, d), e = sender.fwd, SHAPE, 4
    n, r, k = s * b, 10, b
    rep_bits = min(8 * r, max(0, int(8 * (int(0.05 * n * d * e) - 4 * r) // n)))
    rep = 4 * r + (n * rep_bits + 7) // 8
    a = int(3 * 0.25 * n * d * e) - 2 * rep
    basis = r * (2 * d + 4)
    spend = (a * 0.88 if not own else a - basis) - 4 * r - k * (2 * d + 4)
    b1 = min(8 * r, int(8 * spend // n))
    first = k * (2 * d + 4) + 4 * r + (n * b1 + 7) // 8
    pad = lambda v: -(-v // e) * e  # noqa: E731
    assert h.nbytes(SHAPE, e, False, repeat=True) == pad(rep)
    assert h.nbytes(SHAPE, e, False) == pad(first + (basis if own else 0))
    assert h.nbytes(SHAPE, e, True) == pad(first + basis)
    decoded, firsts, sizes = [], {}, []
    for x, step, ids, p in _iteration():
        ctx = _ctx(step, ids)
        shape = receiver.wire_shape("fwd", SHAPE, ctx, torch.float32, "recv")
        payload = sender.encode_forward(x, ctx)
        assert tuple(payload.shape) == shape
        y = receiver.decode_forward(payload, ctx, SHAPE)
        assert torch.equal(sender.decode_sent_forward(payload, ctx, SHAPE), y)
        sizes.append(payload.numel() * e)
        if p == 0:
            firsts[(step, ids)] = y
            assert _rel(y, x) < 1e-3  # rank-6 data, 10 rows
        elif p == 2:
            assert torch.equal(y, firsts[(step, ids)])
        else:
            assert _rel(y, x) < _rel(firsts[(step, ids)], x)  # the delta was coded
        decoded.append(y)
    fb, fo, rp = h.nbytes(SHAPE, e, True), h.nbytes(SHAPE, e, False), h.nbytes(SHAPE, e, False, repeat=True)
    assert sizes == 2 * [fb, fo, rp, rp, rp, rp]
    # within the budget of all crossings (+ the step basis: at this tiny d the share cannot pay it)
    assert sum(sizes[:6]) == spec_bytes(sender, SHAPE, e, 6, 2)[0] <= 6 * int(0.25 * n * d * e) + (0 if own else basis)


@pytest.mark.parametrize("passes,n_tokens,r", [(2, 576, 86), (3, 576, 129), (2, 1024, 144)])
def test_a_short_micro_batch_shrinks_the_own_basis_instead_of_failing(passes, n_tokens, r):
    """rank 144 at d = 576 with 2 passes and 4 x 144 tokens (the study's micro-batch) used to
    leave no coefficient bits (ValueError mid-run); the basis is now capped at 3/4 of the first
    crossing's floor(passes * keep_ratio * D) bytes: r = floor(0.75 * that / (2 d + 4)), and the
    message encodes, decodes and fits the budget. Enough tokens: r = rank."""
    shape, e = (n_tokens // 4, 4, 576), 4
    c = build_codec(f"rpq/passes={passes}:lrq", 0.05)
    dense = n_tokens * 576 * e
    assert c.fwd.basis_rows(shape, e) == r == min(144, int(0.75 * int(passes * 0.05 * dense) / (2 * 576 + 4)))
    assert c.fwd.coef_bits(shape, e) >= 1
    x = _data(3, shape=shape, rank=40)
    payload = c.encode_forward(x, _ctx(ids=(0, 1, 2, 3)))
    assert payload.numel() * e == c.fwd.nbytes(shape, e, True) <= passes * 0.05 * dense
    y = c.decode_forward(payload, _ctx(ids=(0, 1, 2, 3)), shape)
    assert _rel(y, x) < 1e-2


def test_budget_check_counts_passes():
    """At the 128-token rollout shape rpq:lrq fits 24 forward / 8 backward messages (3 passes) and is
    rejected with 16 forward messages (--kl-coef 0: 2 passes) until passes=2; with a per-step
    basis (own=0) too."""
    demo = dict(shape=(199, 4, 576), bwd_messages=8)
    check_codec_budget(build_codec("rpq:lrq", 0.05), 0.05, messages=24, **demo)
    with pytest.raises(ValueError, match="forward sends"):
        check_codec_budget(build_codec("rpq:lrq", 0.05), 0.05, messages=16, **demo)
    check_codec_budget(build_codec("rpq/passes=2:lrq", 0.05), 0.05, messages=16, **demo)
    check_codec_budget(build_codec("rpq/own=0/rank=192:lrq", 0.05), 0.05, messages=24, **demo)
    with pytest.raises(ValueError, match="forward sends"):  # the share cannot pay a 192-row basis over 2 passes
        check_codec_budget(build_codec("rpq/own=0/rank=192/passes=2:lrq", 0.05), 0.05, messages=16, **demo)
    f, b = spec_bytes(build_codec("rpq:lrq", 0.05), (199, 4, 576), 4, 24, 8)
    assert (f + b) / (32 * 199 * 4 * 576 * 4) <= 0.05


@pytest.mark.parametrize("bad, msg", [("rpq/passes=0:lrq", "passes >= 1"), ("rpq/own=2:lrq", "own 0 or 1"),
                                      ("rpq/repeat=0.5:lrq", "repeat <= keep_ratio"),
                                      ("rpq/window=3:lrq", "rpq takes no parameter 'window'")])
def test_malformed_rpq_specs_are_rejected(bad, msg):
    with pytest.raises(ValueError, match=msg):
        build_codec(bad, 0.05)


_RECEIVER = r"""
import sys, torch
from megatron_cegrpo.compression import BoundaryContext, build_codec
c = build_codec(sys.argv[3], 0.1)
res = []
for p, step, ids in torch.load(sys.argv[1]):
    ctx = BoundaryContext(seed=1, boundary=0, step=step, sample_ids=torch.tensor(list(ids)))
    assert tuple(p.shape) == c.wire_shape("fwd", (12, 2, 40), ctx, p.dtype, "recv")
    res.append(c.decode_forward(p, ctx, (12, 2, 40)))
torch.save(res, sys.argv[2])
"""


def test_both_ends_in_separate_processes_hold_the_same_state(tmp_path):
    """The receiver process (its own basis, first-crossing cache and repeat decoding) decodes,
    bit for bit, what the sender says it will (``decode_sent``) for every message of two steps.
    own=0 (a per-step basis the receiver keeps) is the more stateful mode; the default own=1
    crosses real processes in tests/pipeline/test_pipeline_equivalence.py."""
    spec = "rpq/rank=10/own=0:lrq/rank=4"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    wire, got = tmp_path / "wire.pt", tmp_path / "got.pt"
    sender, msgs, at_sender = build_codec(spec, 0.1), [], []
    for x, step, ids, _ in _iteration():
        p = sender.encode_forward(x, _ctx(step, ids))
        at_sender.append(sender.decode_sent_forward(p, _ctx(step, ids), SHAPE))
        msgs.append((p, step, ids))
    torch.save(msgs, wire)
    subprocess.run([sys.executable, "-c", _RECEIVER, str(wire), str(got), spec], check=True, env=env, cwd=REPO)
    for a, b in zip(at_sender, torch.load(got)):
        assert torch.equal(a, b)


def test_start_up_rejects_rpq_over_budget_naming_the_flags(monkeypatch, capsys):
    """--kl-coef 0 leaves 1 forward pass (the update's: its old log-probs come from it), 2 with
    --recompute-old-log-prob: rpq planned for more passes is over --boundary-keep-ratio at start-up,
    one line naming --boundary-codec and --boundary-keep-ratio."""
    import megatron_cegrpo.initialize
    from megatron_cegrpo.train import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CEGRPO_DATA_ROOT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(megatron_cegrpo.initialize, "initialize_distributed",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("start-up passed")))
    argv = ["--model", "tiny-llama", "--pipeline-model-parallel-size", "2", "--anchor-ranks", "0",
            "--micro-batch-size", "4", "--rollout-batch-size", "2", "--num-generations", "4",
            "--boundary-codec", "rpq:lrq", "--kl-coef", "0", "--log-dir", "/tmp/rpq_never_used"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("[cegrpo] error: --boundary-codec rpq:lrq exceeds --boundary-keep-ratio 0.05: forward")
    passes2 = argv[:-5] + ["rpq/passes=2:lrq", "--kl-coef", "0", "--log-dir", "/tmp/rpq_never_used"]
    assert main(passes2) == 2
    assert capsys.readouterr().err.startswith("[cegrpo] error: --boundary-codec rpq/passes=2:lrq exceeds")
    for ok in (passes2 + ["--recompute-old-log-prob"], argv[:-5] + ["rpq/passes=1:lrq", "--kl-coef", "0"]):
        with pytest.raises(AssertionError, match="start-up passed"):
            main(ok)
