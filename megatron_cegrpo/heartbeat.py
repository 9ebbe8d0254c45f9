"""Heartbeat watchdog (issue 35, items 2 and 3): a hung rank or a dropped link ends in a restart.

The groups whose waits last as long as the schedule makes them (the pipeline's rollout group, the
anchor group: ``initialize.PEER_LIFETIME_TIMEOUT``) notice a dead peer at once by its closed
connection, but a peer that is alive and makes no progress (stopped, swapping, stuck in the kernel)
or a link that drops without closing its connections (a cable, a route, a host's network) closes
nothing: every rank would wait for the peer's life, 30 days.

So every rank (the pipeline stages, the driver and the anchor) runs two threads next to its work:

- the *beat* thread writes a counter, this rank's pid and its last progress mark (phase and
  iteration, :func:`mark`) under ``cegrpo/heartbeat/<start>/<rank>`` in the run's c10d store
  (``MASTER_ADDR:MASTER_PORT``, a connection of its own) every ``interval`` seconds, then reads
  every rank's record;
- the *watch* thread, every ``interval``, names the ranks whose counter has not moved for
  ``timeout_s`` seconds of this rank's clock (its clock only: hosts' clocks need not agree), and
  notices when this rank itself has not reached the store for ``timeout_s`` (its link is down).

Either way the rank prints one line and ends its worker with :data:`EXIT_NO_HEARTBEAT`; the rank
that reports a peer is the lowest rank that still beats (the others end quietly, a few beats later,
so that the reporter prints before the agents stop it), a rank cut off from the store reports
itself (its local rank 0). Under torchrun ``--max-restarts`` the agent then restarts every
rank from the newest complete checkpoint (``restart.py``), as for a killed rank; without it the run
stops and the line says how to get restarts.

A process's threads stop together (SIGSTOP, a frozen host) and a cut link stops its beats, so the
bound holds whatever the rank's work is doing: a legitimately long phase (evaluation, a checkpoint
save, the anchor's replay at a fire, the first iteration's start-up) keeps beating and never trips
it. A link that comes back within ``timeout_s`` is ridden out: TCP resends what was lost and the
beats resume. Not covered: a rank whose main thread is stuck while its threads run (a deadlock
inside this process): it keeps beating, and its peers wait as before.

A rank that finishes posts ``done`` and is never named. A store that refuses connections (rank 0's
process, which hosts it under DeepSpeed and torchrun's c10d rendezvous, has ended) stops the
threads quietly when rank 0 had posted ``done`` (the run is ending); otherwise rank 0 died or its
watchdog ended it, and this rank, no longer reaching the store, ends after ``timeout_s`` like a rank
cut off from it (a launcher's agent usually ends it first).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Mapping, Optional

__all__ = ["Heartbeat", "heartbeat_timeout_s", "start_heartbeat", "mark", "stop_heartbeat", "EXIT_NO_HEARTBEAT",
           "DEFAULT_TIMEOUT_MINUTES"]

#: Exit status of a worker the watchdog ended (EX_TEMPFAIL): its supervisor passes it on without a
#: line of its own (the watchdog printed one), and torchrun's agent restarts every rank.
EXIT_NO_HEARTBEAT = 75
#: ``--heartbeat-timeout-minutes`` when it is not given, under torchrun ``--max-restarts`` (without
#: restarts the watchdog is off unless asked for: a stopped run needs a person either way).
DEFAULT_TIMEOUT_MINUTES = 1.0
#: The store's blocking operations wait this long (a link that is down makes them wait; the watch
#: thread, not this timeout, bounds how long the rank waits for it).
_STORE_OP_TIMEOUT = timedelta(days=1)

_ACTIVE: Optional["Heartbeat"] = None


def heartbeat_timeout_s(minutes: Optional[float], env: Mapping[str, str] = os.environ) -> Optional[float]:
    """Seconds without a beat after which a rank is named (``--heartbeat-timeout-minutes``), or None
    when the watchdog is off: ``minutes`` 0, or None (not given) outside torchrun ``--max-restarts``;
    not given under it: :data:`DEFAULT_TIMEOUT_MINUTES`."""
    from megatron_cegrpo.restart import elastic_restarts

    if minutes is None:
        return DEFAULT_TIMEOUT_MINUTES * 60.0 if elastic_restarts(env) is not None else None
    return float(minutes) * 60.0 if minutes > 0 else None


class Heartbeat:
    """The two threads of one rank (module docstring). ``store``: a c10d store (keys under
    ``prefix``); ``roles``: rank -> what it is, for the line; ``stop_line``: what happens next,
    appended to the line; ``on_fire(status)``: ends the worker (default ``os._exit``)."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, *, prefix: str = "cegrpo/heartbeat/",
                 interval_s: Optional[float] = None, roles: Optional[Dict[int, str]] = None, stop_line: str = "",
                 on_fire: Optional[Callable[[int], None]] = None, local_rank: int = 0):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, float(timeout_s)
        self.prefix, self.roles, self.stop_line, self.local_rank = prefix, roles or {}, stop_line, local_rank
        self.interval_s = interval_s if interval_s is not None else min(5.0, max(0.2, self.timeout_s / 6))
        self._on_fire = on_fire or (lambda status: os._exit(status))
        self._beats = 0
        self._mark = {"phase": "start-up", "iteration": 0}
        self._stop = threading.Event()
        self._finished = threading.Event()  # stop() was called: this rank's work ended
        self._seen: Dict[int, tuple] = {}  # rank -> (its counter, this clock when it last moved, its record)
        self._contact = time.monotonic()  # the last time this rank reached the store
        self._started = time.monotonic()
        self._threads: List[threading.Thread] = []
        self.fired: Optional[str] = None  # the line, once the watchdog fired

    def mark(self, phase: str, iteration: int) -> None:
        """This rank's progress: the phase it entered and the iteration it belongs to (shown in the
        line that names a rank; a mark is no beat: beats come from the thread)."""
        self._mark = {"phase": phase, "iteration": int(iteration)}

    def start(self) -> "Heartbeat":
        """Post the first record and start both threads (daemons)."""
        self._post()
        for target, name in ((self._beat_loop, "cegrpo-heartbeat-beat"), (self._watch_loop, "cegrpo-heartbeat-watch")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, done: bool = True) -> None:
        """Stop both threads; ``done``: post that this rank finished (its peers never name it)."""
        self._stop.set()
        self._finished.set()
        if done:
            try:
                self._post(done=True)
            except Exception:  # the store is gone (rank 0 ended first): nobody is left to read it
                pass

    # ------------------------------------------------------------------ the threads
    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def _post(self, done: bool = False) -> None:
        self._beats += 1
        rec = dict(self._mark, n=self._beats, pid=os.getpid(), done=done)
        self.store.set(self._key(self.rank), json.dumps(rec))
        self._contact = time.monotonic()

    def _read(self) -> None:
        now = time.monotonic()
        for r in range(self.world_size):
            if r == self.rank or not self.store.check([self._key(r)]):
                continue
            rec = json.loads(self.store.get(self._key(r)))
            old = self._seen.get(r)
            if old is None or old[0] != rec["n"]:
                self._seen[r] = (rec["n"], now, rec)
        self._contact = now

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._post()
                self._read()
            except Exception:  # connection refused or reset: the store's host (rank 0) ended
                if self._seen.get(0, (None, None, {}))[2].get("done"):
                    self._stop.set()  # it finished: the run is ending, nothing is left to watch
                # else it died: no contact from now on, and the watchdog ends this rank after
                # timeout_s (check); stopping here left the rank running with no one to end it

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            line = self.check(time.monotonic())
            if line is None or self._stop.is_set():
                continue
            # a quiet rank gives the reporting one time to print first: the first exit makes the
            # agents stop every other rank, the reporter too
            if line == "" and self._finished.wait(2 * self.interval_s + 1.0):
                return
            self.fired = line
            if line:
                print(line, flush=True)
            sys.stdout.flush()
            self._on_fire(EXIT_NO_HEARTBEAT)
            return

    # ------------------------------------------------------------------ the decision
    def stale(self, now: float, after_s: Optional[float] = None) -> List[int]:
        """The peers whose counter has not moved for ``after_s`` (default ``timeout_s``; a peer never
        seen counts from this watchdog's start), finished ranks left out."""
        after_s = self.timeout_s if after_s is None else after_s
        out = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            n, since, rec = self._seen.get(r, (None, self._started, {}))
            if not rec.get("done") and now - since > after_s:
                out.append(r)
        return out

    def check(self, now: float) -> Optional[str]:
        """None while every rank beats; else the line to print ("" for a rank that ends quietly)."""
        role = self.roles.get
        if now - self._contact > self.timeout_s:  # this rank's own link (or the store's host) is down
            if self.local_rank != 0:
                return ""
            return (f"[cegrpo] rank {self.rank} ({role(self.rank, 'rank')}) reached no peer's heartbeat for "
                    f"{now - self._contact:.0f} s (--heartbeat-timeout-minutes {self.timeout_s / 60:g}): its link "
                    f"to the run's store (MASTER_ADDR) or that host is down; it stops{self.stop_line}")
        if now - self._contact > 2 * self.interval_s:  # not reaching the store now: no peer can be judged
            return None
        stale = self.stale(now)
        if not stale:
            return None
        fresh = [r for r in range(self.world_size) if r not in stale]
        if self.rank != min(fresh):
            return ""
        stale = self.stale(now, self.timeout_s / 2)  # also the ranks that fell silent with it (one host's)
        named = "; ".join(self._describe(r, now) for r in stale)
        return (f"[cegrpo] {named}: hung, or its host or the link to it is down (--heartbeat-timeout-minutes "
                f"{self.timeout_s / 60:g}); rank {self.rank} stops{self.stop_line}")

    def _describe(self, r: int, now: float) -> str:
        n, since, rec = self._seen.get(r, (None, self._started, {}))
        where = (f", last at iteration {rec['iteration']} ({rec['phase']}), pid {rec['pid']}" if rec else
                 ", none since the watchdog started")
        return f"rank {r} ({self.roles.get(r, 'rank')}) sent no heartbeat for {now - since:.0f} s{where}"


def _stop_line(argv: List[str], env: Mapping[str, str]) -> str:
    """What follows the watchdog's line: torchrun's restart (``supervisor.restart_line``), or that
    the run stops and how restarts are had."""
    from megatron_cegrpo.restart import how_to_restart
    from megatron_cegrpo.supervisor import restart_line

    line = restart_line(argv, env)
    return f"; {line}" if line else f"; the run stops\n{how_to_restart(env)}"


def start_heartbeat(ctx, timeout_s: float, argv: Optional[List[str]] = None) -> Heartbeat:
    """Start this rank's watchdog on the run's store (a new client of ``MASTER_ADDR:MASTER_PORT``)
    under a prefix rank 0 draws for this start and broadcasts (a restarted run's keys never meet a
    dead start's). A collective of every rank of the default group, right after
    ``initialize_distributed``. Returns the watchdog; :func:`mark` and :func:`stop_heartbeat` reach it."""
    import torch.distributed as dist

    from megatron_cegrpo.supervisor import rank_role

    global _ACTIVE
    token = [f"{time.time_ns()}-{os.getpid()}" if ctx.rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=ctx.world_size,
                          is_master=False, timeout=_STORE_OP_TIMEOUT)
    argv = list(sys.argv[1:]) if argv is None else argv
    roles = {r: rank_role(argv, r, ctx.world_size) for r in range(ctx.world_size)}
    _ACTIVE = Heartbeat(store, ctx.rank, ctx.world_size, timeout_s, prefix=f"cegrpo/heartbeat/{token[0]}/",
                        roles=roles, stop_line=_stop_line(argv, os.environ), local_rank=ctx.local_rank).start()
    return _ACTIVE


def mark(phase: str, iteration: int) -> int:
    """Record this rank's progress on its watchdog (nothing without one); returns ``iteration``."""
    if _ACTIVE is not None:
        _ACTIVE.mark(phase, iteration)
    return iteration


def stop_heartbeat(done: bool = True) -> None:
    """Stop this rank's watchdog (nothing without one); ``done``: this rank finished its work."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.stop(done=done)
        _ACTIVE = None
