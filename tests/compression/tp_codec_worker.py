"""One rank of ``test_tp_codec_determinism.py``: a stage's TP rank running the stateful codecs.

``python tp_codec_worker.py OUT THREADS`` (RANK, WORLD_SIZE, MASTER_* from ``distributed_util.run_ranks``;
world = the TP size). Every rank builds the same boundary tensors from one seed (what the TP ranks
of a stage hold with sequence parallelism off), runs each codec of :data:`SPECS` through two GRPO
iterations as both ends of one boundary would (old-logprob, reference and update passes of 2
micro-batches; the update pass also sends the gradient back; a fast-owned ``lowrank`` basis is
handed from the sender to the receiver whole), and writes ``OUT/rank<r>.json``: per codec and
message the sha256 of every payload, basis and decoded tensor, the payload's bytes and this rank's
piece of it (``tp_payload_piece``), and whether the all-gather of the ranks' pieces over gloo
(megatron-core's ``gather_split_1d_tensor``) rebuilt the payload bit for bit.
"""

import hashlib
import json
import os
import sys

import torch

from megatron_cegrpo.bootstrap import bootstrap

bootstrap(cpu_compat=True)

import torch.distributed as dist  # noqa: E402
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor  # noqa: E402

from megatron_cegrpo.compression import BoundaryContext, build_codec  # noqa: E402
from megatron_cegrpo.pipeline.communicator import tp_payload_piece, tp_payload_whole  # noqa: E402
from tp_codec_specs import B, D, OPTIONS, PASSES, S, SEED, SPECS  # noqa: E402  (this script's folder)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def activations(step: int, mb: int, pas: str) -> torch.Tensor:
    """[S, B, D] fp32: low-rank structure, noise and one large-norm (attention-sink) token per sequence;
    the reference pass's weights differ slightly (a perturbed copy), the update pass equals old."""
    g = torch.Generator().manual_seed(SEED + 100 * step + mb)
    x = torch.randn(S, B, 6, generator=g) @ torch.randn(6, D, generator=g) + 0.1 * torch.randn(S, B, D, generator=g)
    x[0] *= 40.0
    if pas == "ref":
        x = x + 1e-3 * torch.randn(S, B, D, generator=torch.Generator().manual_seed(SEED + 7 + step))
    return x


def record(payload: torch.Tensor, rank: int, world: int) -> dict:
    """Hash, bytes and this rank's piece of one payload; the pieces all-gathered over gloo and rejoined
    (compared as bytes: a byte-string payload viewed as fp32 may hold NaN patterns)."""
    piece = tp_payload_piece(payload, world, rank)
    whole = tp_payload_whole(gather_split_1d_tensor(piece, tp_group=dist.group.WORLD), tuple(payload.shape))
    return {"sha": sha(payload), "bytes": payload.numel() * payload.element_size(),
            "piece_bytes": piece.numel() * piece.element_size(), "rejoined": bool(torch.equal(whole.contiguous().view(torch.uint8), payload.contiguous().view(torch.uint8)))}


def run_codec(spec: str, keep: float, rank: int, world: int) -> list:
    send = build_codec(spec, keep, warn=False, **OPTIONS)  # stage i's codec (the sending end)
    recv = build_codec(spec, keep, warn=False, **OPTIONS)  # stage i + 1's codec (the receiving end)
    out = []
    for step in (1, 2):
        for pas in PASSES:
            for mb in (0, 1):
                ctx = BoundaryContext(seed=SEED, boundary=0, step=step, sample_ids=torch.tensor([2 * mb, 2 * mb + 1]))
                x = activations(step, mb, pas)
                msg = {"step": step, "pass": pas, "mb": mb, "dir": "fwd"}
                first = recv.wire_shape("fwd", x.shape, ctx, x.dtype, "recv")
                payload = send.encode_forward(x, ctx)
                msg.update(record(payload, rank, world), wire_shape=list(first))
                basis = send.basis_to_send(ctx)
                buf = recv.basis_to_receive(ctx, x.shape, x.dtype)
                assert (basis is None) == (buf is None), spec
                if basis is not None:
                    msg["basis"] = record(basis, rank, world)
                    recv.accept_basis(ctx, basis.clone())
                msg["sent_decode_sha"] = sha(send.decode_sent_forward(payload, ctx, x.shape))
                msg["decoded_sha"] = sha(recv.decode_forward(payload, ctx, x.shape))
                out.append(msg)
                if pas == "upd":  # the update pass sends the gradient of the decoded input back
                    g = torch.randn(S, B, D, generator=torch.Generator().manual_seed(SEED + 50 + 10 * step + mb))
                    bpay = recv.encode_backward(g, ctx)
                    bmsg = {"step": step, "pass": pas, "mb": mb, "dir": "bwd", **record(bpay, rank, world),
                            "decoded_sha": sha(send.decode_backward(bpay, ctx, g.shape))}
                    out.append(bmsg)
    state = send.state_dict().get("fwd", {})
    if "bases" in state:  # lowrank: the warm-started Q each end holds after the run
        out.append({"dir": "state", "sha": sha(torch.cat([q.reshape(-1) for q, _ in state["bases"].values()])),
                    "recv_sha": sha(torch.cat([q.reshape(-1) for q, _ in recv.state_dict()["fwd"]["bases"].values()]))})
    return out


def main() -> None:
    out_dir, threads = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"rank": rank, "world": world, "threads": torch.get_num_threads(),
           "codecs": {spec: run_codec(spec, keep, rank, world) for spec, keep in SPECS}}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
