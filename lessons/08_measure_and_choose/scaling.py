"""Scaling on this machine: DDP on 2 ranks against one process, at the same global batch.

    torchrun --standalone --nproc-per-node=2 lessons/08_measure_and_choose/scaling.py
    torchrun ... scaling.py --gradient-as-bucket-view --bucket-cap-mb 4

Rank 0 first trains alone (one thread, the whole batch) while rank 1 waits; then both train
with DDP, each on half the batch, one thread each. The speed-up is the single process's step
time over DDP's. Its gap to 2x splits in two:

- computation: DDP's step under ``no_sync`` (no gradient communication) against half the single
  step. Half a batch is not always half the time, and two ranks share the machine's memory
  bandwidth and caches;
- communication: DDP's step with synchronisation against the same step under ``no_sync``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this lesson's scripts
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ddp_costs import bf16_allreduce, measure  # noqa: E402
from gpt import GPT, GPTConfig, run  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def single_step_seconds(model, batches, steps: int) -> float:
    """The median step time of one process training on the whole batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 2):
        inputs, targets = batches[i % len(batches)]
        began = time.perf_counter()
        model(inputs, targets)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if i >= 2:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step, in all")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    parser.add_argument("--bf16-hook", action="store_true", help="compress gradients to bf16")
    parser.add_argument("--result", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core per rank; the single process gets one core too
    try:
        rank, world, device = run.setup("gloo", __file__)
    except ValueError as err:  # a partial launcher environment, nccl without a GPU per rank
        return run.refuse(__file__, err)
    if world != 2 or args.batch_size % 2:
        if rank == 0:
            print("error: run on exactly 2 ranks (torchrun --nproc-per-node=2), with an even "
                  "--batch-size", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    config = GPTConfig(vocab_size=65, block_size=args.context, n_layer=args.blocks, n_head=4,
                       n_embd=args.width)
    generator = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 65, (2, args.batch_size, args.context),
                                   generator=generator)) for _ in range(4)]
    single = None
    if rank == 0:  # alone: rank 1 waits in the barrier below
        single = single_step_seconds(GPT(config, seed=0), batches, args.steps)
    dist.barrier()

    keywords = {"gradient_as_bucket_view": args.gradient_as_bucket_view}
    if args.bucket_cap_mb is not None:
        keywords["bucket_cap_mb"] = args.bucket_cap_mb
    model = DDP(GPT(config, seed=0), **keywords)
    if args.bf16_hook:
        model.register_comm_hook(None, bf16_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    half = args.batch_size // 2
    mine = [(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half])
            for x, y in batches]
    measured = measure(model, optimizer, mine, args.steps, device)
    if rank == 0:
        ddp, no_sync = measured["step_s"], measured["step_no_sync_s"]
        speedup = single / ddp
        compute_loss = no_sync - single / 2  # what halving the batch did not save
        comm_loss = ddp - no_sync
        print(f"{config.n_layer} blocks x {config.n_embd} wide, context {config.block_size}, "
              f"global batch {args.batch_size}; DDP {keywords}, bf16 hook {args.bf16_hook}")
        print(f"one process, 1 thread:   {single * 1e3:7.1f} ms per step")
        print(f"DDP, 2 ranks x 1 thread: {ddp * 1e3:7.1f} ms per step "
              f"({no_sync * 1e3:.1f} ms without communication)")
        print(f"speed-up {speedup:.2f}x; of the ideal {single / 2 * 1e3:.1f} ms, DDP lost "
              f"{compute_loss * 1e3:.1f} ms to computation and {comm_loss * 1e3:.1f} ms to "
              f"communication")
        print(f"target 1.7x: {'met' if speedup >= 1.7 else 'missed'}")
        if args.result:
            args.result.write_text(json.dumps({
                "single_s": single, "ddp_s": ddp, "ddp_no_sync_s": no_sync,
                "speedup": speedup, "compute_loss_s": compute_loss, "comm_loss_s": comm_loss}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
