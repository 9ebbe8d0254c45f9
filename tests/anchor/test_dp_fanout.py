"""The anchor's signs across data-parallel replicas (issue 14, ``anchor/relay.py``'s DP hop), on 2 real
gloo processes: the follower receives the leader's signs bit for bit (new, unchanged, partial:
no sign for a tensor whose M is all 0, cleared, anchor lost), the fan-out's bytes are the header and the packed signs, and
``anchor/sign_dev_across_dp`` is 0 for equal signs, 1 for a flipped coordinate, 0.5 where a
replica holds none."""

import os

import torch

from distributed_util import REPO, run_ranks

WORKER = os.path.join(REPO, "tests", "anchor", "dp_fanout_worker.py")


def test_followers_hold_the_leaders_signs_and_the_deviation_sees_a_flip(tmp_path):
    run_ranks([WORKER, str(tmp_path)], 2, timeout=600)
    lead, follow = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    keep, new, cleared, partial = lead["consts"]
    assert follow["codes"] == [(True, new), (True, keep), (True, partial), (False, cleared)]
    got = follow["received"]
    assert len(got[0]) == len(lead["signs"]) > 0
    assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(got[0], lead["signs"]))
    assert got[1] is None and got[3] is None
    # no sign for the tensor whose M is all 0: the follower holds None there too (zero-M issue)
    assert torch.equal(got[2][0], lead["signs"][0]) and got[2][1] is None
    # four 16-byte headers, two packed copies of 22 signs (3 bytes) and one 1-byte bitmap of 2 tensors
    assert lead["sent"] == 4 * 16 + 3 + 1 + 3
    for out in (lead, follow):
        assert (out["dev_same"], out["dev_flip"], out["dev_none"], out["dev_partial"]) == (0.0, 1.0, 0.5, 0.5)
