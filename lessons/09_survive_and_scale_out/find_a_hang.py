"""Find out why a distributed job hangs: three tools, each tried on a bug that hangs a job.

    torchrun --standalone --nproc-per-node=2 \
        lessons/09_survive_and_scale_out/find_a_hang.py --bug order      # waits, then a timeout
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ... find_a_hang.py --bug order     # names both calls
    torchrun ... find_a_hang.py --bug straggler --monitored                    # names the rank
    torchrun ... find_a_hang.py --bug straggler --dump-after 3                 # every rank's stack

The bugs, each a real one in small:
  order      rank 0 all-reduces, then broadcasts; the others broadcast first
  shapes     rank 0 all-reduces 4 numbers, the others 5 (a model built differently on one rank)
  skipped    only rank 0 all-reduces (a metric logged on rank 0: lesson 04, lab 5)
  straggler  the last rank never arrives (stuck reading its data)
Each waits until the process group's timeout (--timeout), or worse, goes on with wrong numbers.

The tools:
  TORCH_DISTRIBUTED_DEBUG=DETAIL  before each collective the ranks compare what they are about
      to call (the op, the shapes, the dtypes); the first difference raises on every rank,
      naming both calls. It costs a collective per collective: for debugging only.
  --monitored   dist.monitored_barrier (gloo only) before the step's first collective: rank 0
      waits at most --monitor-timeout seconds for every rank and names the first that did not
      come (wait_all_ranks=True would name them all).
  --dump-after  faulthandler prints the stack of every thread of every rank after that many
      seconds. At any time, kill -USR2 <pid> does the same (each rank prints its pid first;
      not SIGUSR1, which slurm/train.sbatch passes on as the time-limit warning).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

BUGS = ("none", "order", "shapes", "skipped", "straggler")


def load_batch(rank: int, bug: str, stuck_for: float = 3600.0) -> torch.Tensor:
    """Where a rank gets its data; the straggler's last rank is stuck in it."""
    if bug == "straggler" and rank == dist.get_world_size() - 1:
        time.sleep(stuck_for)  # a stuck read from a network file system, say
    return torch.ones(5 if bug == "shapes" and rank != 0 else 4)


def suspect(rank: int, bug: str, check_in=None, group=None, stuck_for: float = 3600.0):
    """One training step's communication, with the bug in it; ``check_in()`` (if given) runs
    where every rank should have arrived, just before the first collective."""
    tensor = load_batch(rank, bug, stuck_for)
    if check_in is not None:
        check_in()
    if bug == "order" and rank != 0:
        dist.broadcast(tensor, src=0, group=group)
        dist.all_reduce(tensor, group=group)
    elif bug == "skipped":
        if rank == 0:  # only rank 0 logs the metric, and all-reduces it to do so
            dist.all_reduce(tensor, group=group)
    else:
        dist.all_reduce(tensor, group=group)
        dist.broadcast(tensor, src=0, group=group)
    dist.barrier(group=group)  # the end of the step
    return tensor


def monitored(timeout: float, group=None):
    """A check-in: every rank reports to rank 0, which names the ranks that do not within
    ``timeout`` seconds (``wait_all_ranks``: all of them, not just the first)."""
    return lambda: dist.monitored_barrier(
        group=group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", choices=BUGS, default="none")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="seconds before a stuck collective raises (the group's timeout)")
    parser.add_argument("--monitored", action="store_true", help="monitored_barrier first")
    parser.add_argument("--monitor-timeout", type=float, default=5.0)
    parser.add_argument("--dump-after", type=float, help="print every rank's stacks after this")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print(f"{Path(__file__).name}: error: start it with torchrun --standalone "
              "--nproc-per-node=2 (a hang needs at least two ranks)", file=sys.stderr)
        return 2
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # kill -USR2 <pid>: the stacks
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    print(f"rank {rank}: pid {os.getpid()}, bug {args.bug!r}, debug "
          f"{os.environ.get('TORCH_DISTRIBUTED_DEBUG', 'OFF')}", flush=True)
    if args.dump_after:  # a watchdog: print the stacks if we are still here by then
        faulthandler.dump_traceback_later(args.dump_after, exit=False)
    try:
        check_in = monitored(args.monitor_timeout) if args.monitored else None
        result = suspect(rank, args.bug, check_in)
    except RuntimeError as err:  # what torch said, on this rank
        print(f"rank {rank}: {type(err).__name__}: {str(err).strip()}", flush=True)
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"rank {rank}: the step completed: {result.tolist()}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
