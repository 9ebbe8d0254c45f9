"""pipeline/broadcast.dumps: the rollout batch's wire bytes depend on its values only."""

import pickle

import torch

from megatron_cegrpo.pipeline.broadcast import dumps, loads


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 50_000, (4, 9), generator=g),
            "attention_mask": torch.ones(4, 9, dtype=torch.bool),
            "advantages": torch.randn(4, generator=g),
            "old_log_probs": torch.randn(4, 8, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 3),
            "strided": torch.arange(12).reshape(3, 4).t(),  # not contiguous
            "lengths": [3, 9, 1, 9], "name": "step 1"}


def test_round_trip_keeps_every_value_dtype_and_shape():
    b = _batch()
    got = loads(dumps(b))
    assert got.keys() == b.keys()
    for k, v in b.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
        else:
            assert got[k] == v


def test_the_bytes_do_not_depend_on_where_the_tensors_live():
    a = dumps(_batch())
    keep = [torch.empty(1 << s) for s in range(4, 22)]  # move the allocator along
    b = dumps({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in _batch().items()})
    assert a == b and len(keep) == 18
    # torch's own pickle names each storage by its address: its bytes differ for the same values
    t = torch.arange(5)
    assert pickle.dumps(t) != pickle.dumps(t.clone())


def test_the_payload_is_the_raw_bytes_plus_a_small_header():
    x = torch.randn(1000)
    assert 4000 < len(dumps(x)) < 4000 + 200 < len(pickle.dumps(x))
