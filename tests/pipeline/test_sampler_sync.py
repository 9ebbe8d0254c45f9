"""Sampler weight sync over real gloo processes (issue 12 item 3; tests/pipeline/sync_worker.py).

tiny-llama on 3 pipeline ranks (the driver and two stages that send), six steps: after every
step the bf16 sampler's weights hash equal to the trainer's weights rounded to bf16 and the
fp32 gather equals every stage's parameters exactly; the metered bytes equal what the ranks
handed to ``dist.send``; a corrupted payload, a replayed delta, a dropped delta and a driver
copy gone bad are each detected, logged and answered by a full resync.
"""

import json
import os

from distributed_util import run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sync_worker.py")
PP = 3


def test_bf16_delta_sync_is_exact_metered_and_recovers_from_faults(tmp_path):
    outs = run_ranks([WORKER, "--out", str(tmp_path)], PP)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(PP)]
    steps = ranks[0]["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    for i, s in enumerate(steps):
        m, f = s["metrics"], s["fp32_metrics"]
        # every HF tensor of the sampler is bf16 and hash-equal to the trainer's weights rounded
        assert s["hashes_equal"] and s["fp32_exact"] and s["keys"] > 10, s
        # metered bytes = the bytes every rank gave dist.send in that sync (both directions)
        assert m["sync/bytes"] == sum(r["sent"][i] for r in ranks)
        assert f["sync/bytes"] == sum(r["sent_fp32"][i] for r in ranks) == m["sync/dense_fp32_bytes"]
        assert m["sync/dense_bytes"] * 2 == m["sync/dense_fp32_bytes"] == f["sync/dense_bytes"]
        assert ranks[0]["sent_fp32"][i] == 0  # the driver's own stage never crosses a host
    by_step = {s["step"]: s["metrics"] for s in steps}
    # a clean delta carries far less than a dense bf16 copy; an unchanged step only headers and acks
    assert by_step[1]["sync/full_resyncs"] == 0 and 0 < by_step[1]["sync/bytes"] < 0.3 * by_step[1]["sync/dense_bytes"]
    assert by_step[1]["sync/changed_entries"] > 0
    # header: 10 int64; empty delta: an 8-byte length and two empty zlib streams of 8 bytes; ack: 1 byte
    header, ack, empty_delta = 80, 1, 24
    assert ranks[1]["sent"][1] == ranks[2]["sent"][1] == header + empty_delta
    assert by_step[2]["sync/changed_entries"] == 0 and by_step[2]["sync/local_changed_frac"] == 0.0
    assert by_step[2]["sync/bytes"] == (PP - 1) * (header + empty_delta + ack)
    # each injected fault: one full resync of the last stage (its full copy crossed), one line
    for t in (3, 4, 5, 6):
        assert by_step[t]["sync/full_resyncs"] == 1, t
        assert by_step[t]["sync/bytes"] > ranks[2]["sent_fp32"][0] // 2 + 2 * header
    lines = ranks[0]["lines"]
    assert len(lines) == 5
    for line, reason in zip(lines, ("payload checksum mismatch", "sequence number 3, expected 4",
                                    "sequence number 6, expected 5", "state digest mismatch after applying")):
        assert line.startswith("sampler weight sync: stage 2's update") and reason in line and "full resync" in line
    assert sum("[cegrpo] warning: sampler weight sync" in line for line in outs[0].splitlines()) == 5
    # step 7: the delta and then the full copy arrive corrupted: the driver refuses the weights and
    # both ends raise instead of running the sampler on weights nobody can vouch for
    assert "stage 2's full copy was rejected (payload checksum mismatch)" in ranks[0]["error"]
    assert "the driver rejected stage 2's full copy" in ranks[2]["error"] and "error" not in ranks[1]
