"""What a checkpoint costs the training loop: no saves, dcp.save and dcp.async_save, in one run.

    torchrun --standalone --nproc-per-node=2 lessons/09_survive_and_scale_out/bench_checkpoint.py

sharded_checkpoint.py's FSDP2 run (a wider running example: --n-embd), trained --steps steps
three times from the same start: without saving, saving every --save-every steps (not at the
last) with dcp.save, and with dcp.async_save (a gloo group of its own, one save written at a
time). For each it prints the mean step time over all steps (the saves included: what the job
pays) and the mean time the loop spent inside a save call (what training waited for), the
slowest rank's. A save's seconds the loop did not wait for are spent by a thread beside it,
which may slow the steps instead.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this lesson's scripts
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt import CharDataset, GPTConfig, run  # noqa: E402
from sharded_checkpoint import Checkpoints, build, train  # noqa: E402

MODES = {"no saves": None, "dcp.save": False, "dcp.async_save": True}


def measure(config, dataset, args, folder: Path, asynchronous: bool | None) -> dict:
    """One mode: the mean step time and the mean time spent in a save call, the slowest
    rank's of each (the job goes at its slowest rank's pace)."""
    model, optimizer = build(config)
    saves = None if asynchronous is None else Checkpoints(folder, keep=1,
                                                          asynchronous=asynchronous)
    train(model, optimizer, dataset, 0, 2, args.global_batch)  # warm-up: first steps are slow
    steps, in_save = [], []
    dist.barrier()
    for step in range(1, args.steps + 1):
        began = time.perf_counter()
        train(model, optimizer, dataset, step, step + 1, args.global_batch)
        if saves and step % args.save_every == 0 and step < args.steps:
            called = time.perf_counter()
            saves.save(model, optimizer, step)
            in_save.append(time.perf_counter() - called)
        steps.append(time.perf_counter() - began)
    if saves:
        called = time.perf_counter()
        saves.wait()  # a save still being written is paid for too
        steps[-1] += time.perf_counter() - called
    slowest = torch.tensor([statistics.mean(steps), statistics.mean(in_save or [0.0])],
                           dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"step": slowest[0].item(), "in_save": slowest[1].item(), "saves": len(in_save)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=run.positive_int, default=20)
    parser.add_argument("--save-every", type=run.positive_int, default=5)
    parser.add_argument("--global-batch", type=run.positive_int, default=8)
    parser.add_argument("--n-embd", type=run.positive_int, default=256,
                        help="the model's width (tiny has 32): bigger state, longer saves")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        rank, world, _ = run.setup("gloo", __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    dataset = CharDataset(32)
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size, n_embd=args.n_embd)
    log = run.rank_zero_log(rank)
    name = [tempfile.mkdtemp(prefix="bench-checkpoint-") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)  # one folder for every rank (rank 0 made it)
    results = {}
    for mode, asynchronous in MODES.items():
        folder = Path(name[0]) / mode.replace(" ", "-")
        results[mode] = measure(config, dataset, args, folder, asynchronous)
    parameters = sum(p.numel() for p in build(config, shard=False)[0].parameters())
    log(f"{world} ranks, {parameters / 1e6:.1f}M parameters ({parameters * 12 / 1e6:.0f} MB "
        f"of weights and AdamW state to save), {results['dcp.save']['saves']} saves in "
        f"{args.steps} steps (one every {args.save_every})")
    base = results["no saves"]["step"]
    log(f"{'':16}{'mean step':>12}{'vs no saves':>13}{'in the save call':>18}")
    for mode, got in results.items():
        waited = f"{got['in_save'] * 1e3:13.1f} ms" if got["saves"] else f"{'-':>16}"
        log(f"{mode:16}{got['step'] * 1e3:9.1f} ms{got['step'] / base:12.2f}x  {waited}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(name[0])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
