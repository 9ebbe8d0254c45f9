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
