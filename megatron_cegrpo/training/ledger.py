"""The whole-step byte ledger: every transfer of an iteration that would cross a host (issue 12 item 1).

In the seeds' deployment every pipeline stage sits on its own host (the driver and its
sampler beside stage 0, the anchor on a host of its own). One iteration moves:

====================  ==================================  ============================================
part                  bytes actually sent (metered)       dense-everything reference (fp32)
====================  ==================================  ============================================
boundaries            ``comm/fwd_bytes + comm/bwd_bytes``  ``comm/dense_equiv_bytes`` (the pipeline
                      (the byte meter, sending side)       dtype's dense tensors, both directions)
rollout batch         ``comm/batch_bytes``                 the same (token ids, masks, advantages,
                      (driver -> every other stage,        sampler log-probs: no codec either way)
                      ``pipeline/broadcast.py``)
tied embedding        ``comm/embd_sync_bytes``             ``comm/embd_sync_dense_bytes``: the dense
                                                           gradient all-reduce in the parameters'
                                                           dtype (fp32 here), both ways, per
                                                           optimizer step
sampler weight sync   ``sync/bytes``                       ``sync/dense_fp32_bytes``: an fp32 copy
                      (stages 1.. -> the driver)           of every stage but the driver's own
anchor in + out       ``anchor/bytes_in + bytes_out``      the same messages with fp32 weight
                                                           shipments (``anchor/bytes_ship_fp32`` in
                                                           place of ``anchor/bytes_ship``)
====================  ==================================  ============================================

``comm/total_bytes`` is the sum of the first column, ``comm/total_dense_bytes`` of the
second (every transfer dense, weights and gradients in fp32, the anchor's sign(M) return
as it is: 1 bit a parameter is its protocol, not a compression of something denser), and
``comm/total_ratio`` their quotient. Not counted: the scalar collectives (the grad-norm
all-reduce, the loss statistics and metrics objects), a few hundred bytes.

``comm/total_wire_bytes`` (the byte meter) is something else: the *cumulative* boundary
bytes since the run started, kept for checkpoints.

Over the whole run (:class:`RunLedger`, on the driver, checkpointed): ``comm/run_total_bytes`` and
``comm/run_total_dense_bytes`` are the sums of the two columns over every iteration so far, the
first included, and ``comm/run_total_ratio`` their quotient: the number the product is judged by
(one iteration's ratio swings between a fire's and a plain step's). ``summary.json`` carries
the three under ``"comm"`` and the run's last log line prints them.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

__all__ = ["LEDGER_PARTS", "whole_step_ledger", "boundary_bytes", "RunLedger"]

#: (part, keys summed for the bytes sent, keys summed for the dense reference, keys subtracted from it)
LEDGER_PARTS: Tuple[Tuple[str, Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]], ...] = (
    ("boundary", ("comm/fwd_bytes", "comm/bwd_bytes"), ("comm/dense_equiv_bytes",), ()),
    ("batch", ("comm/batch_bytes",), ("comm/batch_bytes",), ()),
    ("embd_sync", ("comm/embd_sync_bytes",), ("comm/embd_sync_dense_bytes",), ()),
    ("sampler_sync", ("sync/bytes",), ("sync/dense_fp32_bytes",), ()),
    ("anchor", ("anchor/bytes_in", "anchor/bytes_out"),
     ("anchor/bytes_in", "anchor/bytes_out", "anchor/bytes_ship_fp32"), ("anchor/bytes_ship",)),
)


def boundary_bytes(m: Dict) -> int:
    """The boundaries' bytes of one iteration's metrics ``m`` (the ledger's first part; 0 when absent)."""
    return sum(int(m.get(k, 0)) for k in LEDGER_PARTS[0][1])


def whole_step_ledger(m: Dict) -> Dict[str, float]:
    """``comm/total_bytes``, ``comm/total_dense_bytes`` and ``comm/total_ratio`` of one iteration.

    Args:
        m: the iteration's reduced metrics (bytes as ints; a missing key counts 0: no
            anchor, an untied model, PP = 1), and ``batch/response_tokens`` (the batch's response
            tokens, ``Driver.batch_metrics``).
    Returns:
        the three keys (the ratio is 0.0 when nothing would cross a host), and, where the batch
        has response tokens, ``comm/boundary_bytes_per_response_token`` (the boundaries' bytes)
        and ``comm/total_bytes_per_response_token`` (every part's): bytes per token the batch
        trains on (issue 32 item 4), the measure that compares codecs at the same wire cost
        whatever the prompts' share of the positions (``--shared-prefix`` sends each prompt once
        per group) and the responses' lengths.
    Raises:
        ValueError: a negative byte count (a metering bug).
    """
    def total(keys) -> int:
        vals = [int(m.get(k, 0)) for k in keys]
        if any(v < 0 for v in vals):
            raise ValueError(f"negative byte count among {keys}: {vals}")
        return sum(vals)

    sent = dense = 0
    for _, actual, ref, minus in LEDGER_PARTS:
        sent += total(actual)
        dense += total(ref) - total(minus)
    out = {"comm/total_bytes": sent, "comm/total_dense_bytes": dense,
           "comm/total_ratio": sent / dense if dense else 0.0}
    tokens = int(m.get("batch/response_tokens", 0))
    if tokens > 0:  # the wire cost of what the batch teaches: comparable across prompt sharing and lengths
        out["comm/boundary_bytes_per_response_token"] = boundary_bytes(m) / tokens
        out["comm/total_bytes_per_response_token"] = sent / tokens
    return out


class RunLedger:
    """The whole-step ledger summed over the run (module docstring), a stateful object of the
    driver's checkpoint: a resumed run goes on from the totals at its checkpoint."""

    def __init__(self):
        self.bytes = 0
        self.dense_bytes = 0
        self.iterations = 0

    def add(self, m: Dict) -> Dict[str, float]:
        """Add one iteration's ``comm/total_bytes`` and ``comm/total_dense_bytes`` (from
        :func:`whole_step_ledger`) and return the run's totals so far: ``comm/run_total_bytes``,
        ``comm/run_total_dense_bytes`` (ints, bytes) and ``comm/run_total_ratio`` (0.0 while
        nothing would have crossed a host)."""
        self.bytes += int(m["comm/total_bytes"])
        self.dense_bytes += int(m["comm/total_dense_bytes"])
        self.iterations += 1
        return self.totals()

    def step(self, m: Dict) -> Dict[str, float]:
        """One iteration's :func:`whole_step_ledger` of the reduced metrics ``m`` and, added to the
        run's, the ``comm/run_total_*`` keys (:meth:`add`). Raises ValueError like the ledger."""
        out = whole_step_ledger(m)
        out.update(self.add(out))
        return out

    def totals(self) -> Dict[str, float]:
        """The three ``comm/run_total_*`` keys of the iterations added so far."""
        return {"comm/run_total_bytes": self.bytes, "comm/run_total_dense_bytes": self.dense_bytes,
                "comm/run_total_ratio": self.bytes / self.dense_bytes if self.dense_bytes else 0.0}

    def describe(self) -> str:
        """One line for the run's end: the totals in MB and their ratio."""
        return (f"bytes over the run ({self.iterations} iterations): {self.bytes / 1e6:.1f} MB sent, "
                f"{self.dense_bytes / 1e6:.1f} MB dense-everything, comm/run_total_ratio "
                f"{self.totals()['comm/run_total_ratio']:.4f}")

    def state_dict(self) -> Dict[str, int]:
        return {"bytes": self.bytes, "dense_bytes": self.dense_bytes, "iterations": self.iterations}

    def load_state_dict(self, state: Optional[Dict[str, int]]) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint from before the run ledger) starts at 0."""
        state = state or {}
        self.bytes, self.dense_bytes = int(state.get("bytes", 0)), int(state.get("dense_bytes", 0))
        self.iterations = int(state.get("iterations", 0))
