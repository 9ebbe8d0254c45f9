#!/usr/bin/env python
"""Build DeepSpeed's JIT ops for this machine now (``make venv`` runs it once).

    python tools/build_ops.py          # into $TORCH_EXTENSIONS_DIR (make: .venv/torch_extensions)

CPU: ``cpu_adam`` (DeepSpeedCPUAdam) and ``deepspeed_shm_comm``; CUDA: ``fused_adam``
(``megatron_cegrpo.optim.jit_ops``). Built ahead of time, no test or trainer rank pays for a
build or can be killed inside one (which would leave a lock that makes every later load wait).
Exit status 0 when every op loads, 2 with one line for a stale lock.
"""

import sys

from megatron_cegrpo.bootstrap import bootstrap


def main(argv=None) -> int:
    bootstrap()
    from megatron_cegrpo.errors import ConfigError, one_line
    from megatron_cegrpo.optim.jit_ops import build_ops

    try:
        build_ops()
    except ConfigError as e:
        print(f"[cegrpo] error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
