#!/usr/bin/env python
"""The codec frontier (issue 10 item 7): bytes ratio vs mismatch vs gradient cosine.

Reads the JSON rows that ``tools/codec_fidelity.py --out`` writes (one or more files; a
codec that appears twice keeps its last row), prints a markdown table (mean +- standard
error over batches, the number of batches) and, with ``--png``, draws two panels, mismatch
(nats/token, log scale) and cos(G, G_dense), each against the total wire-bytes ratio, one
point per codec with its error bars. ``docs/codecs.md`` is written from this output.

Usage::

    python tools/codec_frontier.py runs/fidelity/smollm2_pp2.json --png docs/codecs/frontier.png

Raises SystemExit (one line) for a file that is not a list of codec_fidelity rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

from megatron_cegrpo.bootstrap import bootstrap

#: (field, column title, format) of the table, in order
COLUMNS = (("bytes_ratio", "bytes ratio", "{:.4f}"), ("mismatch", "mismatch (nats/token)", "{:.2f}"),
           ("cos", "cos(G, G_dense)", "{:.3f}"), ("cos_stage0", "cos, stage 0", "{:.3f}"),
           ("sign_agreement", "sign agreement", "{:.3f}"), ("norm_ratio", "norm ratio", "{:.2f}"),
           ("error_persistence", "error persistence", "{:.3f}"))


def load_rows(paths: List[str]) -> List[Dict]:
    """The rows of ``paths`` in order, the last row of each codec kept.

    Raises:
        SystemExit: a file that is not a JSON list of dicts with a ``codec`` field.
    """
    rows: Dict[str, Dict] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, list) or not all(isinstance(r, dict) and "codec" in r for r in data):
            raise SystemExit(f"{path}: not a list of tools/codec_fidelity.py rows (each with a 'codec' field)")
        for r in data:
            rows[r["codec"]] = r
    return list(rows.values())


def cell(row: Dict, field: str, fmt: str) -> str:
    """``mean +- se`` of ``field``, ``-`` where the tool left it undefined (None or absent)."""
    v = row.get(field)
    if v is None:
        return "-"
    se = row.get(field + "_se")
    return fmt.format(v) + ("" if not se else " ± " + fmt.format(se))


def table(rows: List[Dict]) -> str:
    """The markdown table of ``rows`` (one line per codec)."""
    head = "| codec | batches | " + " | ".join(t for _, t, _ in COLUMNS) + " |"
    sep = "|---" * (len(COLUMNS) + 2) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append(f"| `{r['codec']}` | {r.get('n_batches', '-')} | "
                     + " | ".join(cell(r, f, fmt) for f, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def plot(rows: List[Dict], path: str) -> None:
    """Two panels against the bytes ratio: mismatch (log scale) and cos(G, G_dense)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, field, title in ((axes[0], "mismatch", "mismatch, nats/token (log)"),
                             (axes[1], "cos", "cos(G_codec, G_dense)")):
        for r in rows:
            if r.get(field) is None:
                continue
            y = max(r[field], 1e-3) if field == "mismatch" else r[field]
            ax.errorbar(r["bytes_ratio"], y, yerr=r.get(field + "_se") or 0, fmt="o", capsize=3)
            ax.annotate(r["codec"], (r["bytes_ratio"], y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if field == "mismatch":
            ax.set_yscale("log")
            ax.axhline(1.0, ls=":", c="grey")
        else:
            ax.axhline(0.5, ls=":", c="grey")
        ax.axvline(0.05, ls=":", c="grey")
        ax.set_xlabel("wire bytes / dense (both directions)")
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", help="tools/codec_fidelity.py --out files")
    ap.add_argument("--png", default=None, help="also draw the frontier here")
    args = ap.parse_args(argv)
    bootstrap()
    rows = load_rows(args.json)
    print(table(rows))
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
