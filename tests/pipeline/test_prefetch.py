"""CodecPrefetcher (pipeline/prefetch.py): the codec's per-crossing work on a background thread."""

import threading

import pytest
import torch

from megatron_cegrpo.compression import BoundaryCodec, BoundaryContext, MaskHalf, build_codec
from megatron_cegrpo.pipeline.prefetch import CodecPrefetcher

SHAPE = (5, 2, 64)


def _ctx(step, first_id=0, boundary=0):
    return BoundaryContext(seed=11, boundary=boundary, step=step, sample_ids=torch.tensor([first_id, first_id + 1]))


class _RecordingHalf(MaskHalf):
    """A mask half that records which thread ran each precompute and can be told to fail."""

    def __init__(self, fail_step=None):
        super().__init__(0.25)
        self.threads, self.order, self.fail_step = [], [], fail_step

    def precompute(self, ctx, shape, device="cpu"):
        self.threads.append(threading.current_thread().name)
        self.order.append((ctx.step, int(ctx.sample_ids[0]), ctx.boundary))
        if ctx.step == self.fail_step:
            raise RuntimeError("precompute failed on purpose")
        return super().precompute(ctx, shape, device)


def _Recording(fail_step=None):
    """A mask codec (one half for both directions, as ``--boundary-codec mask``) that records."""
    half = _RecordingHalf(fail_step)
    codec = BoundaryCodec(half, half, spec="mask")
    codec.threads, codec.order = half.threads, half.order
    return codec


def test_prefetch_runs_in_order_off_thread_and_feeds_the_codec():
    codec, pf = _Recording(), CodecPrefetcher("cpu")
    crossings = [(_ctx(3, 2 * m, boundary), SHAPE) for m in range(4) for boundary in (0, 1)]
    assert pf.submit(codec, crossings) == 8
    assert pf.submit(codec, crossings[:3]) == 0  # already queued
    for ctx, shape in crossings:
        assert pf.wait(codec, ctx, shape) is True
    assert codec.order == [(3, 2 * m, b) for m in range(4) for b in (0, 1)]
    assert all(t.startswith("cegrpo-codec-prefetch") for t in codec.threads)
    assert threading.current_thread().name not in codec.threads
    x = torch.randn(SHAPE)
    for ctx, _ in crossings:  # the crossings find their masks: nothing derived on demand
        codec.decode_forward(codec.encode_forward(x, ctx), ctx, SHAPE)
    assert codec.derivations == {"precomputed": 8, "on_demand": 0}
    assert pf.wait(codec, _ctx(3, 100), SHAPE) is False  # never announced
    pf.close()


def test_prefetch_new_step_forgets_old_and_errors_surface_on_wait():
    codec, pf = _Recording(fail_step=5), CodecPrefetcher("cpu")
    pf.submit(codec, [(_ctx(4), SHAPE)])
    pf.wait(codec, _ctx(4), SHAPE)
    pf.submit(codec, [(_ctx(5), SHAPE)])
    assert pf.wait(codec, _ctx(4), SHAPE) is False  # step 4's futures are gone
    with pytest.raises(RuntimeError, match="on purpose"):
        pf.wait(codec, _ctx(5), SHAPE)
    pf.close()
    assert pf.submit(codec, [(_ctx(6), SHAPE)]) == 1  # usable after close (a new thread)
    assert pf.wait(codec, _ctx(6), SHAPE)
    pf.close()


def test_prefetch_skips_codecs_without_precompute():
    pf = CodecPrefetcher("cpu")
    assert pf.submit(build_codec("dense"), [(_ctx(1), SHAPE)]) == 0
    assert pf.wait(build_codec("dense"), _ctx(1), SHAPE) is False
    assert pf._executor is None  # no thread started
