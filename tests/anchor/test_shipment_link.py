"""The checked anchor shipment link in two gloo processes (issue 30): the stage side as
``AnchorClient`` sends it (``ShipmentEncoder.header`` + payload bytes, ``TAG_PARAMS_HDR`` /
``TAG_PARAMS``), the anchor side ``anchor.worker.receive_shipment``. The mirrors at both ends are
bit-identical after every accepted shipment; a corrupt, a missing and a reordered shipment are each
refused (theta(s) would not enter the ring), a delta after a refusal too, until the keyframe that the
resync sends; the bytes counted are the header plus the payload sent."""

import ast

import pytest

from distributed_util import run_ranks

WORKER = r'''
import sys
import torch, torch.distributed as dist
from megatron_cegrpo.anchor.shipment import HEADER_LEN, ShipmentDecoder, ShipmentEncoder, mirror_digest, shipment_nbytes
from megatron_cegrpo.anchor.transport import TAG_PARAMS, TAG_PARAMS_HDR
from megatron_cegrpo.anchor.worker import receive_shipment

dist.init_process_group("gloo")
mode, n = sys.argv[1], 5000
g = torch.Generator().manual_seed(0)
theta = [torch.randn(n, generator=g)]
for _ in range(14):
    theta.append(theta[-1] - 1e-3 * (1 + torch.randn(n, generator=g)))
PLAN = ["ok", "ok", "corrupt", "ok", "resync", "ok", "drop", "ok", "resync", "swap", "resync", "ok"]
if dist.get_rank() == 0:
    enc, sent, k = ShipmentEncoder(mode), [], 0

    def encode():
        global k
        payload = enc.encode(theta[k])
        k += 1
        held = enc.mirror if mode != "fp32" else theta[k - 1]
        return enc.header(payload), payload.view(torch.uint8).clone(), mirror_digest(held)

    def send(msg, corrupt=False):
        header, data, digest = msg
        if corrupt:
            data[len(data) // 2] ^= 1
        dist.send(header, 1, tag=TAG_PARAMS_HDR)
        dist.send(data, 1, tag=TAG_PARAMS)
        sent.append(digest)

    for what in PLAN:
        if what == "resync":
            enc.resync()  # bit 3 of the anchor's answer
        if what == "swap":
            a, b = encode(), encode()
            send(b)
            send(a)
        elif what == "drop":
            encode()
        else:
            send(encode(), corrupt=what == "corrupt")
    print("SENT", sent)
else:
    dec, out = ShipmentDecoder(mode, n), []
    sizes = {shipment_nbytes(n, mode, True) + 8 * HEADER_LEN: "keyframe",
             shipment_nbytes(n, mode, False) + 8 * HEADER_LEN: "delta"}
    for i in range(sum(2 if w == "swap" else 0 if w == "drop" else 1 for w in PLAN)):
        flat, nbytes = receive_shipment(dec, 0, None, f"shipment {i}")
        out.append((mirror_digest(flat) if flat is not None else None, sizes[nbytes]))
    print("GOT", out)
dist.destroy_process_group()
'''


def _line(out, tag):
    return ast.literal_eval(next(x for x in out.splitlines() if x.startswith(tag)).split(" ", 1)[1])


@pytest.mark.parametrize("mode", ["int4-delta", "bf16-delta"])
def test_refused_shipments_and_the_keyframe_that_restores_the_mirror(tmp_path, mode):
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    outs = run_ranks([str(script), mode], 2, timeout=180)
    sent, got = _line(outs[0], "SENT"), _line(outs[1], "GOT")
    assert len(sent) == len(got) == 12
    # (accepted, kind) per message in the order it arrived: keyframe, delta, corrupt delta (CRC),
    # a delta with the mirror gone, the resync's keyframe, delta, [dropped], a delta out of sequence,
    # keyframe, the swapped pair (both out of sequence), keyframe, delta
    want = [(True, "keyframe"), (True, "delta"), (False, "delta"), (False, "delta"), (True, "keyframe"),
            (True, "delta"), (False, "delta"), (True, "keyframe"), (False, "delta"), (False, "delta"),
            (True, "keyframe"), (True, "delta")]
    assert [(d is not None, kind) for d, kind in got] == want
    for (digest, _), stage in zip(got, sent):
        if digest is not None:
            assert digest == stage  # the anchor's mirror is the stage's, bit for bit
    assert "fails its CRC-32" in outs[1] and "missing or reordered" in outs[1] and "a keyframe is due" in outs[1]
