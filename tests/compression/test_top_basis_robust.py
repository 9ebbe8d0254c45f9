"""``top_basis`` on the inputs that crashed a study arm (issue 10/11: ``linalg.eigh`` failed to
converge on the Gram of a mostly-zero [512, 576] activation gradient) and on degenerate ones."""

import pytest
import torch

from megatron_cegrpo.compression.subspace import top_basis, warm_basis


def _x(n, d, rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, rank, generator=g) * torch.logspace(0, -1, rank)) @ torch.randn(rank, d, generator=g)


def _svd_ref(x, r):
    """The reference: full SVD in fp64, lam = sigma^2 / N."""
    _, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return vh[:r].float(), (s[:r] ** 2 / x.shape[0]).float()


def _subspace_err(v, v_ref):
    """Largest residual of v_ref's rows outside span(v) (0: same subspace)."""
    q = torch.linalg.qr(v.float().t()).Q
    return float((v_ref.t() - q @ (q.t() @ v_ref.t())).norm(dim=0).max())


@pytest.mark.parametrize("n_live", [5, 40])  # both Gram branches: N' = 5 < d = 24 <= N' = 40
def test_zero_rows_do_not_change_the_basis_and_lam_keeps_the_full_token_count(n_live):
    live = _x(n_live, 24, 5)
    x = torch.zeros(200, 24)
    x[torch.randperm(200, generator=torch.Generator().manual_seed(1))[:n_live]] = live
    v, lam = top_basis(x, 4)
    v_ref, lam_ref = _svd_ref(x, 4)
    assert _subspace_err(v, v_ref) < 2e-3
    torch.testing.assert_close(lam, lam_ref, rtol=1e-4, atol=0)
    v5, lam5 = top_basis(x, 8)  # rank 5: lam 5..7 is zero (to rounding); with N' < d so are the rows
    assert float(lam5[5:].abs().max()) < 1e-5 * float(lam5[0])
    if n_live < 24:
        assert float(v5[5:].float().abs().max()) == 0.0


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1e15, 1e25])  # the Gram would underflow / overflow fp32
def test_tiny_and_huge_inputs_give_the_same_basis_scaled_lam(scale):
    x = _x(64, 16, 6)
    v1, lam1 = top_basis(x, 6)
    v, lam = top_basis(x * scale, 6)
    assert _subspace_err(v, v1.float()) < 2e-3
    if 1e-30 < scale ** 2 < 1e30:  # lam itself is fp32
        torch.testing.assert_close(lam.double(), lam1.double() * scale ** 2, rtol=1e-4, atol=0)


def test_all_zero_input_gives_a_zero_basis():
    v, lam = top_basis(torch.zeros(512, 576), 16)
    assert v.shape == (16, 576) and v.dtype == torch.float16
    assert float(v.float().abs().max()) == 0.0 and float(lam.abs().max()) == 0.0


def test_non_finite_input_is_one_clear_error():
    x = _x(32, 16, 4)
    x[3, 2] = float("nan")
    x[7, 1] = float("inf")
    with pytest.raises(FloatingPointError, match=r"\[32, 16\] boundary tensor holds 2 NaN/inf"):
        top_basis(x, 4)
    with pytest.raises(FloatingPointError, match=r"warm_basis: the \[32, 16\] boundary tensor holds 2 NaN/inf"):
        warm_basis(x, torch.randn(4, 16), 4)


@pytest.mark.parametrize("n", [10, 48])  # both branches
def test_a_failing_eigh_falls_back_to_fp64_then_to_the_svd(monkeypatch, n):
    """LAPACK's non-convergence cannot be provoked on demand: torch.linalg.eigh is made to fail as
    it did in the study (fp32 only, then every dtype), and the basis must still be the SVD's."""
    x = _x(n, 24, 6)
    v_ref, lam_ref = _svd_ref(x, 6)
    real = torch.linalg.eigh
    calls = []

    def eigh_fails_in_fp32(a, *args, **kw):
        calls.append(a.dtype)
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge (error code: 262634)")
        return real(a, *args, **kw)

    monkeypatch.setattr(torch.linalg, "eigh", eigh_fails_in_fp32)
    v, lam = top_basis(x, 6)
    assert calls == [torch.float32, torch.float64]
    assert _subspace_err(v, v_ref) < 2e-3
    torch.testing.assert_close(lam, lam_ref, rtol=1e-4, atol=0)

    def eigh_always_fails(a, *args, **kw):
        calls.append(a.dtype)
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", eigh_always_fails)
    calls.clear()
    v, lam = top_basis(x, 6)
    assert calls == [torch.float32, torch.float64]  # then the SVD
    assert _subspace_err(v, v_ref) < 2e-3
    torch.testing.assert_close(lam, lam_ref, rtol=1e-4, atol=0)
    vw, lamw = warm_basis(x, v.float(), 6)  # warm_basis's r x r eigh takes the same way
    assert _subspace_err(vw, v_ref) < 2e-3
