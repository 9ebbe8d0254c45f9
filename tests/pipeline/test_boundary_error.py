"""codec/error_persistence (pipeline/boundary_error.py) against a direct computation."""

import math

import torch

from megatron_cegrpo.compression import BoundaryContext, build_codec
from megatron_cegrpo.pipeline.boundary_error import BoundaryErrorTracker, declare_error_persistence
from megatron_cegrpo.training.reduce import StageMetricsReducer


def _iteration(tracker, codec, step, xs, boundary):
    """Forward sends of one iteration: x [s, b, d] per micro-batch, decoded as the receiver does."""
    errs = []
    for j, x in enumerate(xs):
        ctx = BoundaryContext(seed=5, boundary=boundary, step=step, sample_ids=torch.arange(x.shape[1]) + 10 * j)
        x_hat = codec.decode_forward(codec.encode_forward(x, ctx), ctx, tuple(x.shape))
        tracker.add(boundary, x, x_hat)
        errs.append((codec.forward_map(x, ctx) - x).double().reshape(-1, x.shape[-1]))
    return torch.cat(errs).mean(0)  # the mean over every token of every micro-batch


def test_error_persistence_equals_the_cosine_of_successive_mean_errors():
    codec = build_codec("mask", 0.25)
    g = torch.Generator().manual_seed(0)
    red = StageMetricsReducer()
    declare_error_persistence(red)
    trackers = [BoundaryErrorTracker(), BoundaryErrorTracker()]  # the senders of boundaries 0 and 1
    prev = None
    for step in range(3):
        means = []
        for b, tr in enumerate(trackers):
            xs = [torch.randn(6, 2, 16, generator=g) + 0.5 for _ in range(3)]  # a shared offset: persistent
            means.append(_iteration(tr, codec, step, xs, b))
        sums = [tr.end_iteration() for tr in trackers]
        out = red.reduce(sums + [{}])
        if prev is None:
            assert out == {} and sums == [{}, {}]  # undefined on the first iteration
        else:
            # the raw sums are of the mean errors (a tracker that kept the token sums gave the same
            # cosines: every boundary sends as many tokens)
            for b in (0, 1):
                raw = {k.rsplit("/", 1)[1]: v for k, v in sums[b].items()}
                want = {"dot": means[b] @ prev[b], "sq_cur": means[b] @ means[b], "sq_prev": prev[b] @ prev[b]}
                assert raw.keys() == want.keys()
                for k in want:
                    assert math.isclose(raw[k], float(want[k]), rel_tol=1e-9), (b, k)
            for b in (0, 1):
                direct = float(torch.nn.functional.cosine_similarity(means[b], prev[b], dim=0))
                assert math.isclose(out[f"codec/error_persistence/boundary_{b}"], direct, rel_tol=1e-9)
            cat_now, cat_prev = torch.cat(means), torch.cat(prev)
            direct = float(torch.nn.functional.cosine_similarity(cat_now, cat_prev, dim=0))
            assert math.isclose(out["codec/error_persistence"], direct, rel_tol=1e-9)
        prev = means


def test_dense_codec_has_no_persistence_and_state_round_trips():
    tr = BoundaryErrorTracker()
    x = torch.randn(4, 2, 8)
    for _ in range(2):
        tr.add(0, x, x.clone())
        sums = tr.end_iteration()
    red = StageMetricsReducer()
    declare_error_persistence(red)
    assert sums["_errpersist/boundary_0/sq_cur"] == 0.0 and red.reduce([sums]) == {}
    a, b = BoundaryErrorTracker(), BoundaryErrorTracker()
    y = torch.randn(4, 2, 8)
    a.add(0, x, y)
    a.end_iteration()
    b.load_state_dict(a.state_dict())
    a.add(0, y, x)
    b.add(0, y, x)
    assert a.end_iteration() == b.end_iteration()
