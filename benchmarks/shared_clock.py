"""The shared-memory file of send timestamps used by the receive-side link model.

Row ``[boundary, direction, seq % RING]`` holds the ``time.monotonic()`` at which message
``seq`` of that boundary and direction was handed to the transport. ``CLOCK_MONOTONIC`` is
one clock for all processes of a host (in any network namespace), so the receiver can
compute when the message would have arrived over the modelled link. Simulation metadata
only: never billed, never on a real wire. numpy only (importable without torch/megatron).
"""

from __future__ import annotations

import numpy as np

__all__ = ["RING", "create_timestamp_file", "open_timestamp_file"]

RING = 4096  # far more than the messages one direction can be ahead of its receiver


def _shape(num_boundaries: int):
    return (max(1, int(num_boundaries)), 2, RING)


def create_timestamp_file(path: str, num_boundaries: int) -> None:
    """Create the zeroed file (once per run, before the ranks start)."""
    np.zeros(_shape(num_boundaries), dtype=np.float64).tofile(path)


def open_timestamp_file(path: str, num_boundaries: int) -> np.memmap:
    return np.memmap(path, dtype=np.float64, mode="r+", shape=_shape(num_boundaries))
