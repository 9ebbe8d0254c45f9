#!/usr/bin/env python
"""Convert model checkpoints between Hugging Face, GGUF and megatron_cegrpo's megatron format.

    python tools/checkpoint/convert.py --loader {hf,gguf,megatron} --saver {megatron,hf} \\
        --load-dir X --save-dir Y [--target-pp-size N] \\
        [--target-decoder-first-pipeline-num-layers A] [--target-decoder-last-pipeline-num-layers B]

Megatron-LM style: ``megatron_cegrpo/conversion/loader_<name>.py`` reads the source into a
:class:`~megatron_cegrpo.conversion.plugin_common.ModelPayload` (HF config, tokenizer source,
full HF-named fp32 state dict) and ``megatron_cegrpo/conversion/saver_<name>.py`` writes it.  Megatron PP=a -> PP=b is ``--loader megatron
--saver megatron --target-pp-size b``.  See README.md next to this file.
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_cegrpo.bootstrap import bootstrap
from megatron_cegrpo.checkpointing import CheckpointError
from megatron_cegrpo.conversion import LOADERS, SAVERS, plugin


def build_parser(loader: str, saver: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loader", required=True, choices=LOADERS, help="source format")
    ap.add_argument("--saver", required=True, choices=SAVERS, help="target format")
    ap.add_argument("--load-dir", required=True, help="source (see the loader's help)")
    ap.add_argument("--save-dir", required=True, help="target directory (must not hold a model/checkpoint yet)")
    plugin("loader", loader).add_arguments(ap.add_argument_group(f"loader {loader}"))
    plugin("saver", saver).add_arguments(ap.add_argument_group(f"saver {saver}"))
    return ap


def main(argv=None) -> str:
    bootstrap()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--loader", choices=LOADERS)
    pre.add_argument("--saver", choices=SAVERS)
    known, _ = pre.parse_known_args(argv)
    if known.loader is None or known.saver is None:
        # full parser for the usage / error message (plugins of the defaults for --help)
        build_parser(known.loader or "hf", known.saver or "megatron").parse_args(argv)
        raise SystemExit(2)
    args = build_parser(known.loader, known.saver).parse_args(argv)

    saver = plugin("saver", args.saver)
    saver.preflight(args)  # cheap checks of the target before the (slow) load
    t0 = time.time()
    payload = plugin("loader", args.loader).load_checkpoint(args)
    n_params = sum(v.numel() for v in payload.state_dict.values())
    print(f"[convert] loaded {args.loader} {args.load_dir}: {payload.hf_config.model_type}, "
          f"{len(payload.state_dict)} tensors, {n_params / 1e6:.2f}M parameters, "
          f"tokenizer: {payload.tokenizer_source or 'none'} ({time.time() - t0:.1f}s)", flush=True)
    t1 = time.time()
    out = saver.save_checkpoint(payload, args)
    print(f"[convert] saved {args.saver} -> {out} ({time.time() - t1:.1f}s)", flush=True)
    return out


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # a one-line reason instead of a traceback for expected failures
        if isinstance(e, (CheckpointError, ValueError, FileNotFoundError, FileExistsError)):
            print(f"convert.py: error: {e}", file=sys.stderr)
            sys.exit(1)
        raise
