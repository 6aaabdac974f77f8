"""Under torchrun --max-restarts=1: does a key set in the first attempt survive into the second?

The first attempt joins a gloo group, sets a key in the store under the group (the store where
gloo leaves each rank's address) and exits with an error; the agent restarts the group. The
second attempt reads the store without joining a gloo group, so it cannot trip over the
addresses the dead ranks left (that race is real, but a probe that meets it can wait minutes),
prints whether the key is still there, and exits cleanly.
"""

import datetime
import os

import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=30)
KEY = "set-by-the-first-attempt"

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):  # the group's keys are prefixed names in it
        store = store.underlying_store
    store.set(KEY, "yes")
    dist.barrier()
    raise SystemExit(1)  # a failure: the agent stops the group and starts it again

store, rank, world_size = next(dist.rendezvous("env://", timeout=TIMEOUT))
print(f"rank {rank}: key of the first attempt still there: {store.check([KEY])}",
      flush=True)
store.set(f"done-{rank}", "yes")
if rank == 0:  # rank 0 may host the store: it leaves last
    store.wait([f"done-{r}" for r in range(world_size)], TIMEOUT)
