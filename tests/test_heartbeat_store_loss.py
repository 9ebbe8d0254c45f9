"""The heartbeat watchdog when the store's host (rank 0) ends (``megatron_cegrpo/heartbeat.py``):
a finished rank 0 ends the watch quietly; a rank 0 that died leaves the others to their watchdog,
which ends them within the bound (before 2026-12-05 it stopped watching: a peer whose own check
had not fired yet went on with no one to end it, seen under load in test_heartbeat.py)."""

import json
import threading
import time

from megatron_cegrpo.heartbeat import EXIT_NO_HEARTBEAT, Heartbeat

TIMEOUT_S = 0.6


class _Store:
    """A c10d store's set/get/check on a dict; ``dead``: every call fails as a closed connection."""

    def __init__(self):
        self.kv, self.dead = {}, False

    def _alive(self):
        if self.dead:
            raise ConnectionResetError("Connection reset by peer")

    def set(self, k, v):
        self._alive()
        self.kv[k] = v

    def get(self, k):
        self._alive()
        return self.kv[k].encode()

    def check(self, keys):
        self._alive()
        return all(k in self.kv for k in keys)


def _rank2(store):
    fired = []
    hb = Heartbeat(store, rank=2, world_size=3, timeout_s=TIMEOUT_S, interval_s=0.05, local_rank=1,
                   on_fire=fired.append)
    return hb, fired


def _beat_peers(store, stop, done=False):
    n = 0
    while not stop.is_set():
        n += 1
        for r in (0, 1):
            store.kv[f"cegrpo/heartbeat/{r}"] = json.dumps({"phase": "iteration", "iteration": 7, "n": n,
                                                            "pid": 1, "done": done and r == 0})
        time.sleep(0.05)


def _run(done: bool):
    store = _Store()
    stop = threading.Event()
    peers = threading.Thread(target=_beat_peers, args=(store, stop, done), daemon=True)
    peers.start()
    hb, fired = _rank2(store)
    hb.start()
    time.sleep(0.3)  # a few beats seen
    stop.set()
    peers.join()
    store.dead = True  # rank 0 ended: its store with it
    t0 = time.monotonic()
    while not fired and time.monotonic() - t0 < 3.0:
        time.sleep(0.02)
    hb.stop(done=True)
    return fired, time.monotonic() - t0


def test_a_dead_store_host_ends_this_rank_within_the_bound():
    fired, took = _run(done=False)
    # the bound, then the quiet rank's 2 beats + 1 s for a reporting peer to print first
    assert fired == [EXIT_NO_HEARTBEAT] and TIMEOUT_S - 0.1 < took < TIMEOUT_S + 2 * 0.05 + 1.0 + 0.5, took


def test_a_finished_store_host_ends_the_watch_quietly():
    fired, _ = _run(done=True)
    assert fired == []
