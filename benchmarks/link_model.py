"""A link model on every pipeline boundary, applied on the receiving side.

``LinkCommunicator`` is the library's ``CompressedP2PCommunicator`` with one extra layer
inserted *under* it in the method resolution order::

    LinkCommunicator -> CompressedP2PCommunicator -> _WireLink -> P2PCommunicator

so ``CompressedP2PCommunicator._communicate`` encodes as usual and its ``super()._communicate``
call lands in :class:`_WireLink`, which sees exactly the payload tensors that go on the wire
(what the codec produced; nothing else is billed) and the payloads that arrive.

Link modes (switchable between steps, the same on every rank):

``off``      no delay: the real transfer only (loopback, or a veth with no qdisc).
``sim``      a modelled link of ``bandwidth_bps`` and ``latency_s`` per boundary and direction.
             A payload of B bytes starts when it may (see ``transfer``) and the link
             direction is free (messages on one direction serialize), occupies the link
             8B / bandwidth seconds and arrives ``latency_s`` later. The receiver sleeps
             until that arrival time ("sleep for what is left after the real transfer").
``latency``  bandwidth is real (a kernel ``tbf`` qdisc throttles the interface); only the
             one-way propagation delay is modelled on top of the real, throttled delivery.

``transfer`` says when a payload may start moving:

``rendezvous`` (default) when both ends are ready: max(t_send, t_post), t_post = when the
             receiver asked for it. This is what megatron's p2p does over gloo (and NCCL):
             a send does not move data before the matching receive is posted; the tbf runs
             show it (``--trace``: a 16 KiB payload sent a second before the receive was
             posted still needs its full 8B / rate after the post).
             ``latency`` mode then completes the receive ``latency_s`` after the real one.
``eager``    as soon as it is sent (an asynchronous NIC with unlimited buffering, the
             optimistic bound where the link overlaps the receiver's compute).
             ``latency`` mode then completes at t_send + latency + the real transfer time.

The sender never waits for the modelled link unless ``blocking_send`` is set, in which case
it waits until its payload has left the link (start + 8B / bandwidth).

t_send reaches the receiver through a small shared-memory file of monotonic timestamps
(``benchmarks/shared_clock.py``; ``CLOCK_MONOTONIC`` is one clock for every process on the
host, in any network namespace). That file is simulation metadata, not traffic: it is not
billed and does not exist on a real link. Sender and receiver index it by a
per-(boundary, direction) message counter; the 1F1B schedule delivers each direction in
FIFO order, so the counters agree.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from benchmarks.shared_clock import RING, create_timestamp_file, open_timestamp_file
from megatron_cegrpo.pipeline.communicator import CompressedP2PCommunicator

__all__ = ["LinkModel", "LinkCommunicator", "create_timestamp_file", "MODES", "TRANSFERS"]

MODES = ("off", "sim", "latency")
TRANSFERS = ("rendezvous", "eager")
FWD, BWD = 0, 1


class LinkModel:
    """Per-process link state: message counters, link-busy times, and the delays it imposed.

    Args:
        ts_path: the file made by :func:`create_timestamp_file` (shared by all ranks).
        num_boundaries: pp_size - 1.
        bandwidth_bps: modelled link rate in bit/s (``sim`` mode).
        latency_s: one-way propagation delay in seconds (``sim`` and ``latency`` modes).
        transfer: ``rendezvous`` or ``eager`` (module docstring).
        blocking_send: in ``sim`` mode, senders wait until their payload has left the link.
    """

    def __init__(self, ts_path: str, num_boundaries: int, bandwidth_bps: float, latency_s: float,
                 transfer: str = "rendezvous", blocking_send: bool = False):
        if bandwidth_bps <= 0 or latency_s < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.ts = open_timestamp_file(ts_path, num_boundaries)
        self.bandwidth_bps = float(bandwidth_bps)
        self.latency_s = float(latency_s)
        self.rendezvous = transfer == "rendezvous"
        self.blocking_send = bool(blocking_send)
        self.mode = "off"
        # set to a list to record (boundary, dir, bytes, t_send, t_post, t_done, arrival) per message
        self.trace: Optional[List[tuple]] = None
        self._send_seq: Dict[Tuple[int, int], int] = {}
        self._recv_seq: Dict[Tuple[int, int], int] = {}
        self._recv_free: Dict[Tuple[int, int], float] = {}  # receiver's view of when a link direction frees up
        self._send_free: Dict[Tuple[int, int], float] = {}  # sender's view (blocking_send only)
        self.reset_stats()

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"link mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._recv_free.clear()
        self._send_free.clear()

    def reset_stats(self) -> None:
        self.stats = {"recv_bytes": 0, "sent_bytes": 0, "recv_msgs": 0, "link_wait_s": 0.0}

    def _transfer_s(self, nbytes: int) -> float:
        return 8.0 * nbytes / self.bandwidth_bps

    # -- sender -------------------------------------------------------------
    def on_send(self, boundary: int, direction: int, nbytes: int, t_send: float) -> None:
        """Stamp a message with its send time (before it is handed to the transport)."""
        key = (boundary, direction)
        seq = self._send_seq.get(key, 0)
        self._send_seq[key] = seq + 1
        self.ts[boundary, direction, seq % RING] = t_send
        self.stats["sent_bytes"] += nbytes

    def send_release(self, boundary: int, direction: int, nbytes: int, t_send: float, t_done: float) -> float:
        """When a sender may continue: t_done, or (``blocking_send`` in ``sim``) when its payload left."""
        if self.mode != "sim" or not self.blocking_send:
            return t_done
        key = (boundary, direction)
        # rendezvous: the real send completed just after the receiver posted, so t_done stands in for t_post
        start = max(t_send, self._send_free.get(key, 0.0), t_done if self.rendezvous else t_send)
        self._send_free[key] = start + self._transfer_s(nbytes)
        return self._send_free[key]

    # -- receiver -----------------------------------------------------------
    def on_recv(self, boundary: int, direction: int, nbytes: int, t_post: float, t_done: float) -> float:
        """Modelled arrival time of a message whose real receive ran from t_post to t_done."""
        key = (boundary, direction)
        seq = self._recv_seq.get(key, 0)
        self._recv_seq[key] = seq + 1
        t_send = float(self.ts[boundary, direction, seq % RING])
        self.stats["recv_bytes"] += nbytes
        self.stats["recv_msgs"] += 1
        if self.mode == "sim":
            ready = max(t_send, t_post) if self.rendezvous else t_send
            start = max(ready, self._recv_free.get(key, 0.0))
            self._recv_free[key] = start + self._transfer_s(nbytes)
            arrival = self._recv_free[key] + self.latency_s
        elif self.mode == "latency":
            if self.rendezvous:
                arrival = t_done + self.latency_s
            else:
                real_transfer = max(0.0, t_done - max(t_send, t_post))
                arrival = max(t_done, t_send + self.latency_s + real_transfer)
        else:
            arrival = t_done
        if self.trace is not None:
            self.trace.append((boundary, direction, nbytes, t_send, t_post, t_done, arrival))
        return arrival

    def collective_delay(self, nbytes: int) -> float:
        """Extra seconds for a 2-rank all-reduce of ``nbytes`` (two latency-bound steps, B each way)."""
        if self.mode == "sim":
            return 2 * self.latency_s + self._transfer_s(nbytes)
        if self.mode == "latency":
            return 2 * self.latency_s
        return 0.0

    def wait_until(self, target: float) -> None:
        now = time.monotonic()
        if target > now:
            time.sleep(target - now)
            self.stats["link_wait_s"] += target - now


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _WireLink(P2PCommunicator):
    """Sits between the codec layer and megatron's transport; sees only wire payloads."""

    link: LinkModel  # set by LinkCommunicator

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs: bool = True):
        link = self.link
        sends = []
        if tensor_send_next is not None:  # forward activations on boundary pp_rank
            sends.append((self.pp_rank, FWD, _nbytes(tensor_send_next)))
        if tensor_send_prev is not None:  # gradients on boundary pp_rank - 1
            sends.append((self.pp_rank - 1, BWD, _nbytes(tensor_send_prev)))
        t_post = time.monotonic()
        for b, direction, n in sends:
            link.on_send(b, direction, n, t_post)
        recv_prev_t, recv_next_t, reqs = super()._communicate(
            tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev, recv_prev=recv_prev,
            recv_next=recv_next, tensor_shape=tensor_shape, wait_on_reqs=wait_on_reqs)
        t_done = time.monotonic()
        target = t_done
        for b, direction, n in sends:
            target = max(target, link.send_release(b, direction, n, t_post, t_done))
        if recv_prev:
            target = max(target, link.on_recv(self.pp_rank - 1, FWD, _nbytes(recv_prev_t), t_post, t_done))
        if recv_next:
            target = max(target, link.on_recv(self.pp_rank, BWD, _nbytes(recv_next_t), t_post, t_done))
        link.wait_until(target)
        return recv_prev_t, recv_next_t, reqs


class LinkCommunicator(CompressedP2PCommunicator, _WireLink):
    """``CompressedP2PCommunicator`` whose wire payloads pass through a :class:`LinkModel`.

    Args: those of ``CompressedP2PCommunicator`` plus ``link``, a :class:`LinkModel`
    (one per process, shared by every communicator of that process so that the message
    counters stay aligned with the peers).
    """

    def __init__(self, pp_group, config, codec, meter, seed: int, link: LinkModel):
        super().__init__(pp_group, config, codec, meter, seed)
        self.link = link
