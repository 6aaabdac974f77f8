"""A tiny script for testing harness.launch: reports how it was launched."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lessons"))
from harness.exercises import solutions_mode  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--result")
parser.add_argument("--hang", action="store_true")
parser.add_argument("--fail", action="store_true")
parser.add_argument("--stub", action="store_true")
parser.add_argument("--local-rank", "--local_rank", type=int, default=None)
args = parser.parse_args()

rank = int(os.environ.get("RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
print(f"probe rank {rank} of {world_size} pid {os.getpid()} "
      f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
if args.fail:
    raise SystemExit("deliberate failure")
if args.stub and rank == 1:
    raise NotImplementedError("task9_2: the exercise a launched rank reached")
if args.hang:
    time.sleep(3600)
if rank == 0 and args.result:
    Path(args.result).write_text(json.dumps({
        "world_size": world_size,
        "solutions_mode": solutions_mode(),
        "local_rank_arg": args.local_rank,
    }))
