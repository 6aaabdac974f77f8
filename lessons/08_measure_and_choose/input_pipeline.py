"""When the step waits for data: a slow input pipeline, found in a trace and fixed.

    torchrun --standalone --nproc-per-node=2 lessons/08_measure_and_choose/input_pipeline.py

Every sample here costs ``--decode-ms`` of waiting before it can be used, as reading and
decoding an image or a document from disk does. With ``num_workers=0`` the training loop loads
each batch itself, between two steps: every step waits batch size x decode time, on every
rank, and more ranks do not shorten it. With ``--workers N``, N worker processes per rank load
the next batches while the step computes. The script profiles three DDP steps of the running
example each way (read_trace.py's loop), reads each trace with read_step (task8_5) and prints
the step and its wait for data, before and after.

On GPUs, add ``pin_memory=True`` too: batches then come in page-locked memory, which is what
lets ``.to(device, non_blocking=True)`` copy them while the GPU computes. This script runs on
the CPU, where there is nothing to copy.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this lesson's read_trace
from gpt import GPT, GPTConfig, run  # noqa: E402
from read_trace import profiled_steps, read_step  # noqa: E402


class SlowToLoad(Dataset):
    """``dataset``, each sample ready only after ``seconds``: a stand-in for reading and
    decoding it (time spent waiting, as on a disk or a network, not computing)."""

    def __init__(self, dataset, seconds: float):
        self.dataset, self.seconds = dataset, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return self.dataset[index]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-ms", type=run.positive_float, default=4.0,
                        help="what loading one sample costs")
    parser.add_argument("--workers", type=run.positive_int, default=2,
                        help="DataLoader worker processes per rank, for the fix")
    parser.add_argument("--width", type=int, default=128, help="n_embd of the running example")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--result", type=Path, help="write the readings as JSON here")
    args = parser.parse_args(argv)
    try:
        rank, world, _ = run.setup("gloo", __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    if world < 2:
        dist.destroy_process_group()
        return run.refuse(__file__, "start 2 ranks or more: torchrun --standalone "
                                    "--nproc-per-node=2")
    dataset, train_set, _ = run.windows("tiny")
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size, n_embd=args.width,
                             n_layer=args.blocks)
    slow = SlowToLoad(train_set, args.decode_ms / 1e3)
    folder = Path(tempfile.mkdtemp(prefix="input-pipeline-"))
    readings = {}
    for workers in (0, args.workers):
        loader = DataLoader(slow, args.batch_size, num_workers=workers,
                            sampler=DistributedSampler(slow, shuffle=True, seed=0))
        path = folder / f"workers-{workers}.json"
        profiled_steps(GPT(config, seed=0), loader, 25, path)  # DDP's default buckets
        gc.collect()  # free now what only reference cycles hold: it may hold the group
        dist.barrier()  # rank 0 has written the trace
        if rank == 0:
            events = json.loads(path.read_text())["traceEvents"]
            readings[workers] = [read_step(events, number) for number in (2, 3, 4)]
    if rank == 0:
        print(f"gloo, {world} ranks; batch {args.batch_size} per rank, {args.decode_ms:g} ms to "
              f"load a sample: {args.batch_size * args.decode_ms:g} ms of loading per batch")
        print(f"{'num_workers':>11} {'step ms':>8} {'data ms':>8}  share of the step")
        for workers, steps in readings.items():
            for reading in steps:
                print(f"{workers:>11} {reading['step_us'] / 1e3:8.1f} "
                      f"{reading['data_us'] / 1e3:8.1f}  "
                      f"{reading['data_us'] / reading['step_us']:6.0%}")
        before, after = (sorted(r["step_us"] for r in readings[w])[1] for w in readings)
        print(f"median step: {before / 1e3:.1f} ms with num_workers=0, {after / 1e3:.1f} ms with "
              f"num_workers={args.workers} ({before / after:.1f}x faster)")
        if args.result:
            run.write_result({"readings": {str(w): r for w, r in readings.items()},
                              "decode_ms": args.decode_ms, "batch_size": args.batch_size},
                             args.result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
