"""The anchor-owned lowrank basis (anchor/basis.py): the dtype it travels in."""

import torch

from megatron_cegrpo.anchor.basis import AnchorBasis
from megatron_cegrpo.compression.lowrank import initial_basis


def test_bases_load_in_the_pipeline_dtype():
    """A --bf16 checkpoint written before 2026-12-05 holds fp32 bases (the anchor built them in its
    fp32 parameters' dtype); loaded into a bf16 pipeline they become bf16, the stages' receive
    dtype, with the values rounded once."""
    basis = AnchorBasis(torch.nn.ModuleList(), [14], seed=1234, d=16, r=2, dtype=torch.bfloat16)
    assert basis.q[0].dtype == torch.bfloat16
    old = {"q": {0: initial_basis(7, 0, 16, 2)}, "num_refreshes": 3}
    basis.load_state_dict(old)
    assert basis.q[0].dtype == torch.bfloat16 and basis.num_refreshes == 3
    assert torch.equal(basis.q[0], old["q"][0].to(torch.bfloat16))
    assert all(q.dtype == torch.bfloat16 for q in basis.for_stage(0, 2))


def test_each_stage_gets_the_bases_of_the_boundaries_it_touches():
    """3 stages, boundaries 0 (stage 0 -> 1) and 1 (stage 1 -> 2): the middle stage gets both, in
    boundary order, the end stages one each; each the run seed's basis of that boundary."""
    basis = AnchorBasis(torch.nn.ModuleList(), [1, 3], seed=5, d=8, r=2, dtype=torch.float32)
    q0, q1 = initial_basis(5, 0, 8, 2), initial_basis(5, 1, 8, 2)
    assert not torch.equal(q0, q1)
    got = [basis.for_stage(s, 3) for s in range(3)]
    assert [len(g) for g in got] == [1, 2, 1]
    assert torch.equal(got[0][0], q0) and torch.equal(got[1][0], q0)
    assert torch.equal(got[1][1], q1) and torch.equal(got[2][0], q1)
    assert basis.for_stage(0, 1) == []  # one stage: no boundary


def _orth(m):
    """Reduced QR with diag(R) >= 0, written out here."""
    q, r = torch.linalg.qr(m.double())
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0).double()


def test_capture_then_refresh_is_one_power_step_over_every_micro_batch():
    """Q_b <- orth(sum over the captured micro-batches of X^T (X Q_b)), X the output of boundary b's
    last layer, [s * mbs, d]; forwards outside capture() do not count."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
    basis = AnchorBasis(layers, [1, 2], seed=5, d=8, r=3, dtype=torch.float32)
    assert basis.refresh() is False and basis.num_refreshes == 0  # nothing captured
    start = {b: basis.q[b].clone() for b in (0, 1)}
    seen = {0: [], 1: []}

    def forward(x, keep):
        h = x
        with torch.no_grad():
            for j, layer in enumerate(layers):
                h = layer(h)
                if keep and j in (1, 2):
                    seen[j - 1].append(h.reshape(-1, 8))

    with basis.capture():
        for _ in range(2):  # two micro-batches [s=3, mbs=2, d=8]
            forward(torch.randn(3, 2, 8), keep=True)
    forward(torch.randn(3, 2, 8), keep=False)  # after the block: the hooks are gone
    assert basis.refresh() is True and basis.num_refreshes == 1
    for b in (0, 1):
        x = torch.cat(seen[b]).double()
        want = _orth(x.t() @ (x @ start[b].double()))
        assert basis.q[b].dtype == torch.float32
        torch.testing.assert_close(basis.q[b].double(), want, rtol=0, atol=1e-5)
    assert not torch.allclose(basis.q[0], start[0], atol=1e-2)  # the basis moved
    assert basis.refresh() is False and basis.num_refreshes == 1  # consumed
