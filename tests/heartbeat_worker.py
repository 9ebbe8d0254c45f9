"""One rank of ``test_heartbeat.py``: a gloo world whose ranks run the heartbeat watchdog.

``python heartbeat_worker.py TIMEOUT_S SECONDS [DONE_RANK]`` (RANK, WORLD_SIZE, MASTER_* set by the
test): init the default gloo group (its store is rank 0's TCPStore, as under DeepSpeed's launcher),
start the watchdog of a PP=2 + anchor layout, mark iteration 7, print ``ready``, then work (sleep)
for SECONDS and finish (``done`` posted, exit 0). ``DONE_RANK`` finishes at once instead.
"""

import os
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist

from megatron_cegrpo import heartbeat

timeout_s, seconds = float(sys.argv[1]), float(sys.argv[2])
done_rank = int(sys.argv[3]) if len(sys.argv) > 3 else -1
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
ctx = SimpleNamespace(rank=rank, world_size=world, local_rank=max(rank - 1, 0))  # host 0: rank 0; host 1: 1, 2
heartbeat.start_heartbeat(ctx, timeout_s, argv=["--pipeline-model-parallel-size", "2", "--anchor-ranks", "1"])
heartbeat.mark("iteration", 7)
print("ready", flush=True)
time.sleep(0 if rank == done_rank else seconds)
heartbeat.stop_heartbeat(done=True)
print("finished", flush=True)
os._exit(0)  # no destroy_process_group: its barrier would wait for the ranks the test stopped
