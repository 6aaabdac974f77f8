"""Under torchrun --max-restarts=1: does a key set in the first attempt survive into the second?

The first attempt sets a key in the process group's store and exits with an error; the agent
restarts the group; the second prints whether the key is still there, and exits cleanly.
"""

import datetime
import os

import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
store = dist.distributed_c10d._get_default_store()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0:
    store.set("set-by-the-first-attempt", "yes")
    dist.barrier()
    raise SystemExit(1)  # a failure: the agent stops the group and starts it again
print(f"rank {dist.get_rank()}: key of the first attempt still there: "
      f"{store.check(['set-by-the-first-attempt'])}", flush=True)
dist.barrier()
dist.destroy_process_group()
