"""AnchorMemory: M <- a M + (1 - a) G in fp32, sign(M) with 0 -> +1."""

import math

import pytest
import torch

from megatron_cegrpo.anchor import AnchorMemory, unpack_sign_list


def test_two_updates_hand_values_and_is_set():
    mem = AnchorMemory({"w": (2, 2), "b": (3,)})  # decay 0.25
    assert not mem.is_set and mem.norm() == 0.0
    with pytest.raises(RuntimeError, match=r"sign\(M\) requested before the first update"):
        mem.signs()
    g1 = {"w": torch.tensor([[4.0, -8.0], [0.0, 2.0]]), "b": torch.tensor([1.0, -1.0, 0.0])}
    mem.update(g1)
    assert mem.is_set and mem.num_updates == 1
    # first update starts from zeros: M1 = 0.75 G1
    assert torch.equal(mem.tensor("w"), torch.tensor([[3.0, -6.0], [0.0, 1.5]]))
    assert torch.equal(mem.tensor("b"), torch.tensor([0.75, -0.75, 0.0]))
    g2 = {"w": torch.tensor([[-4.0, 8.0], [0.0, -1.0]]), "b": torch.tensor([0.0, 1.0, -4.0], dtype=torch.bfloat16)}
    mem.update(g2)
    # M2 = 0.25 M1 + 0.75 G2
    w2 = torch.tensor([[0.75 - 3.0, -1.5 + 6.0], [0.0, 0.375 - 0.75]])
    b2 = torch.tensor([0.1875, -0.1875 + 0.75, -3.0])
    assert torch.equal(mem.tensor("w"), w2)
    assert torch.equal(mem.tensor("b"), b2)
    assert mem.tensor("b").dtype == torch.float32
    assert math.isclose(mem.norm(), math.sqrt(float((w2**2).sum() + (b2**2).sum())), rel_tol=1e-12)
    s = mem.signs()
    assert s["w"].tolist() == [[-1.0, 1.0], [1.0, -1.0]]  # the zero entry is +1
    assert s["b"].tolist() == [1.0, 1.0, -1.0]
    assert list(mem.signs(["b"])) == ["b"]
    packed, sizes = mem.packed_signs()
    assert sizes == [4, 3]
    unpacked = unpack_sign_list(packed, [(2, 2), (3,)])
    assert torch.equal(unpacked[0], s["w"]) and torch.equal(unpacked[1], s["b"])


def test_custom_decay_and_errors():
    mem = AnchorMemory([("x", (2,))], decay=0.5)
    mem.update({"x": torch.tensor([2.0, -2.0])})
    mem.update({"x": torch.tensor([2.0, 6.0])})
    assert torch.equal(mem.tensor("x"), torch.tensor([1.5, 2.5]))  # 0.5*[1,-1] + 0.5*[2,6]
    with pytest.raises(ValueError, match=r"gradient 'x' has shape \(3,\), M has \(2,\)"):
        mem.update({"x": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"anchor gradient names differ from M: missing=\[\], extra=\['y'\]"):
        mem.update({"x": torch.zeros(2), "y": torch.zeros(1)})
    assert mem.num_updates == 2  # failed updates change nothing
    with pytest.raises(KeyError, match=r"unknown parameter names: \['y'\]"):
        mem.signs(["y"])
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"anchor EMA decay must be in \[0, 1\)"):
            AnchorMemory([("x", (2,))], decay=bad)


def test_state_round_trip(tmp_path):
    mem = AnchorMemory({"w": (2, 3), "b": (4,)})
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        mem.update({"w": torch.randn(2, 3, generator=g), "b": torch.randn(4, generator=g)})
    path = tmp_path / "mem.pt"
    torch.save(mem.state_dict(), path)
    state = torch.load(path, weights_only=True)
    other = AnchorMemory({"w": (2, 3), "b": (4,)})
    other.load_state_dict(state)
    assert other.is_set and other.num_updates == 3
    for n in ("w", "b"):
        assert torch.equal(other.tensor(n), mem.tensor(n))
    with pytest.raises(ValueError, match="anchor memory state has decay=0.25, this memory has 0.5"):
        AnchorMemory({"w": (2, 3), "b": (4,)}, decay=0.5).load_state_dict(state)
    with pytest.raises(ValueError, match=r"anchor memory state: 'b' has shape \(4,\), M has \(5,\)"):
        AnchorMemory({"w": (2, 3), "b": (5,)}).load_state_dict(state)


def test_informative_tensors_and_zero_fraction():
    """Zero-M issue: a tensor whose M is exactly 0 is uninformative; m_zero_frac counts exact zeros."""
    mem = AnchorMemory([("a", (2, 3)), ("b", (4,))], decay=0.25)
    assert mem.informative() == [False, False] and mem.zero_fraction() == 1.0
    mem.update({"a": torch.zeros(2, 3), "b": torch.zeros(4)})  # a replay whose advantages are all 0
    assert mem.is_set and mem.informative() == [False, False] and mem.zero_fraction() == 1.0
    mem.update({"a": torch.tensor([[1.0, 0.0, -2.0], [0.0, 0.0, 0.0]]), "b": torch.zeros(4)})
    assert mem.informative() == [True, False] and mem.informative(["b", "a"]) == [False, True]
    assert mem.zero_fraction() == 8 / 10
    mem.update({"a": torch.zeros(2, 3), "b": torch.zeros(4)})  # the EMA keeps the old direction
    assert mem.informative() == [True, False] and mem.zero_fraction() == 8 / 10
