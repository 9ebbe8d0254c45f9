"""The anchor's signs across data-parallel replicas (issue 14, ``anchor/dp_fanout.py``), on 2 real
gloo processes: the follower receives the leader's signs bit for bit (new, unchanged, cleared,
anchor lost), the fan-out's bytes are the header and the packed signs, and
``anchor/sign_dev_across_dp`` is 0 for equal signs, 1 for a flipped coordinate, 0.5 where a
replica holds none."""

import os

import torch

from distributed_util import REPO, run_ranks

WORKER = os.path.join(REPO, "tests", "anchor", "dp_fanout_worker.py")


def test_followers_hold_the_leaders_signs_and_the_deviation_sees_a_flip(tmp_path):
    run_ranks([WORKER, str(tmp_path)], 2, timeout=600)
    lead, follow = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    keep, new, cleared = lead["consts"]
    assert follow["codes"] == [(True, new), (True, keep), (False, cleared)]
    got = follow["received"]
    assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(got[0], lead["signs"]))
    assert got[1] is None and got[2] is None
    # three 16-byte headers, one packed copy of 22 signs (3 bytes) to the one follower
    assert lead["sent"] == 3 * 16 + 3
    for out in (lead, follow):
        assert (out["dev_same"], out["dev_flip"], out["dev_none"]) == (0.0, 1.0, 0.5)
