"""Where does each sample of a batch go under nn.DataParallel? Print it.

    python lessons/01_data_parallel/where_the_batch_goes.py
    python lessons/01_data_parallel/where_the_batch_goes.py --batch-size 5 --replicas 4

The model prints, every time it runs, the input it received and the output it produced; the
caller prints what it passed in and what came back. With several GPUs, DataParallel uses all of
them. With one GPU it lists that GPU several times (``device_ids=[0, 0]``), which really splits
the batch on one device. With no GPU, DataParallel is a pass-through (the module runs once on the
whole batch), so the script then also does the split by hand, on the CPU, to show what it would
have done.
"""

from __future__ import annotations

import argparse
import copy
import sys
import threading

import torch
from torch import nn

IN_FEATURES, OUT_FEATURES = 5, 2


def shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


class ReportingModel(nn.Module):
    """A linear layer that says where it runs and on what, every time it runs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN_FEATURES, OUT_FEATURES)
        self.label = None  # the by-hand split names its copies; otherwise the thread's name shows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        who = self.label or threading.current_thread().name
        # One write per line: the replicas run in threads and would otherwise interleave.
        sys.stdout.write(f"  in model on {x.device} ({who}): "
                         f"input {shape(x)} -> output {shape(y)}\n")
        return y


def chunk_sizes(batch_size: int, replicas: int) -> list[int]:
    # DataParallel's scatter cuts with Tensor.chunk: ceil(B / n) per chunk, the last one short.
    return [len(c) for c in torch.empty(batch_size).chunk(replicas)]


def hand_made_split(model: nn.Module, batch: torch.Tensor, replicas: int) -> torch.Tensor:
    """What DataParallel does with ``replicas`` devices, done on the CPU: scatter, replicate,
    run each replica on its chunk, gather. (Run one after another here, not in threads.)"""
    chunks = batch.chunk(replicas)
    copies = [copy.deepcopy(model) for _ in chunks]  # DataParallel replicates on every forward
    for i, replica in enumerate(copies):
        replica.label = f"replica {i}"
    outputs = [replica(chunk) for replica, chunk in zip(copies, chunks, strict=True)]
    return torch.cat(outputs)


def report_split(batch_size: int, replicas: int) -> None:
    sizes = chunk_sizes(batch_size, replicas)
    note = ""
    if len(sizes) < replicas:
        note = f"; only {len(sizes)} of the {replicas} replicas get a chunk, the rest sit idle"
    print(f"a batch of {batch_size} on {replicas} replicas: chunk sizes {sizes}{note}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=None,
                        help="devices to split across (default: every GPU; 2 on one GPU; "
                             "3 for the by-hand split on CPU)")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.replicas is not None and args.replicas < 1):
        parser.error("--batch-size and --replicas must be at least 1")

    torch.manual_seed(0)
    model = ReportingModel()
    batch = torch.randn(args.batch_size, IN_FEATURES)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, {gpus} CUDA GPU(s)")

    if gpus == 0:
        replicas = args.replicas or 3
        print("no CUDA GPU: nn.DataParallel is a pass-through here. It keeps no device_ids and "
              "calls the module once, with the whole batch:")
        wrapped = nn.DataParallel(model)
        output = wrapped(batch)
        print(f"outside: input {shape(batch)} -> output {shape(output)}  "
              f"(device_ids {wrapped.device_ids})")
        print()
        print(f"What DataParallel would do with {replicas} GPUs, done by hand on the CPU:")
        report_split(args.batch_size, replicas)
        output = hand_made_split(model, batch, replicas)
        print(f"outside: input {shape(batch)} -> gathered output {shape(output)} on "
              f"{output.device}")
        return 0

    # Several GPUs: all of them (or --replicas of them, wrapping around). One GPU: list it twice.
    replicas = args.replicas or (gpus if gpus > 1 else 2)
    device_ids = [i % gpus for i in range(replicas)]
    wrapped = nn.DataParallel(model.to("cuda:0"), device_ids=device_ids)
    print(f"nn.DataParallel with device_ids {device_ids}, output_device cuda:"
          f"{wrapped.output_device}")
    report_split(args.batch_size, replicas)
    batch = batch.to("cuda:0")
    output = wrapped(batch)
    print(f"outside: input {shape(batch)} -> gathered output {shape(output)} on {output.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
