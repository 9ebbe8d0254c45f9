"""The gradient-fidelity probe's arithmetic (training/fidelity.py) against a direct computation:
the sums of one stage, their reduction over stages (tied copy left out by the caller), the
mean over optimizer steps, and the metric reducer wiring."""

import math

import torch

from megatron_cegrpo.training.fidelity import SUM_KEYS, GradFidelityProbe, fidelity_metrics, gradient_sums
from megatron_cegrpo.training.reduce import StageMetricsReducer


def _grads(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def test_gradient_sums_match_a_direct_computation():
    shapes = [(3, 4), (5,), (2, 2, 2)]
    gc, gd = _grads(0, shapes), _grads(1, shapes)
    gd[1][2] = 0.0  # a zero dense coordinate is not counted in the sign agreement
    gc[0][0, 0] = 0.0
    s = gradient_sums(zip(gc, gd))
    c, d = torch.cat([x.flatten() for x in gc]).double(), torch.cat([x.flatten() for x in gd]).double()
    assert math.isclose(s["dot"], float(c @ d), rel_tol=1e-12)
    assert math.isclose(s["sq_codec"], float(c @ c), rel_tol=1e-12)
    assert math.isclose(s["sq_dense"], float(d @ d), rel_tol=1e-12)
    nz = d != 0
    assert s["sign_total"] == float(nz.sum()) == c.numel() - 1
    assert s["sign_agree"] == float(((c > 0) == (d > 0))[nz & (c != 0)].sum())  # sign(0)=0 never agrees
    # a zero codec coordinate against a negative dense one does not agree either (0 is not negative)
    assert gradient_sums([(torch.zeros(1), -torch.ones(1))])["sign_agree"] == 0.0
    assert gradient_sums([(-torch.ones(1), -torch.ones(1))])["sign_agree"] == 1.0
    # None gradients count as zeros
    s2 = gradient_sums([(None, gd[0]), (gc[1], None)])
    assert s2["dot"] == 0.0 and math.isclose(s2["sq_dense"], float(gd[0].double().square().sum()))


def test_metrics_over_stages_and_steps():
    # two stages, two optimizer steps: cosines from the concatenated gradients, then step mean
    shapes = {0: [(4, 3), (7,)], 1: [(6,), (2, 5)]}
    steps, per_stage = [], {0: [], 1: []}
    for step in range(2):
        gc = {i: _grads(10 * step + i, shapes[i]) for i in shapes}
        gd = {i: _grads(100 + 10 * step + i, shapes[i]) for i in shapes}
        for i in shapes:
            per_stage[i].append(gradient_sums(zip(gc[i], gd[i])))
        c = torch.cat([x.flatten() for i in shapes for x in gc[i]]).double()
        d = torch.cat([x.flatten() for i in shapes for x in gd[i]]).double()
        c0 = torch.cat([x.flatten() for x in gc[0]]).double()
        d0 = torch.cat([x.flatten() for x in gd[0]]).double()
        c1 = torch.cat([x.flatten() for x in gc[1]]).double()
        d1 = torch.cat([x.flatten() for x in gd[1]]).double()
        steps.append({"fidelity/cos": float(torch.nn.functional.cosine_similarity(c, d, dim=0)),
                      "fidelity/cos/stage_0": float(torch.nn.functional.cosine_similarity(c0, d0, dim=0)),
                      "fidelity/cos/stage_1": float(torch.nn.functional.cosine_similarity(c1, d1, dim=0)),
                      "fidelity/norm_ratio": float(c.norm() / d.norm()),
                      "fidelity/sign_agreement": float((c.sign() == d.sign()).double().mean())})
    red = StageMetricsReducer()
    GradFidelityProbe.declare_metrics(red)
    gathered = [{f"_fidelity/{k}": [s[k] for s in per_stage[i]] for k in SUM_KEYS} for i in (0, 1)]
    out = red.reduce(gathered)
    assert not any(k.startswith("_") for k in out)
    for k in steps[0]:
        assert math.isclose(out[k], (steps[0][k] + steps[1][k]) / 2, rel_tol=1e-9), k
    assert out["fidelity/cos/stage_0"] != out["fidelity/cos/stage_1"]  # each stage its own
    # an iteration without the probe reports nothing
    assert red.reduce([{}, {}]) == {}


def test_identical_gradients_give_one_and_a_zero_gradient_is_undefined():
    g = _grads(3, [(5, 5)])
    m = fidelity_metrics({f"_fidelity/{k}": [[v] for v in [gradient_sums(zip(g, g))[k]]] for k in SUM_KEYS})
    assert m["fidelity/cos"] == 1.0 and m["fidelity/norm_ratio"] == 1.0 and m["fidelity/sign_agreement"] == 1.0
    z = gradient_sums([(torch.zeros(3), torch.ones(3))])
    assert fidelity_metrics({f"_fidelity/{k}": [[z[k]]] for k in SUM_KEYS}) == {}
