"""Benchmark: one 2-rank gloo check through the reused pool vs fresh processes for it.

    python tests/bench_rank_pool.py [--checks 50] [--fresh 5]

Prints milliseconds per check. Fresh processes are started the way a per-test harness does it
(PyTorch's MultiProcessTestCase spawns; fork is shown too), each joining a new process group.
The target: the pool's amortised cost per check at least 20x below a fresh spawn.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness.ranks import RankPool  # noqa: E402


def gradient_check(ctx):
    """A typical check: a small model's gradient, all-reduced and compared across ranks."""
    gen = torch.Generator().manual_seed(ctx.rank)
    layer = torch.nn.Linear(32, 32)
    layer(torch.randn(16, 32, generator=gen)).sum().backward()
    grad = layer.weight.grad
    dist.all_reduce(grad)
    grad /= ctx.world_size
    return float(grad.sum())


def per_check_ms(run, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        run()
    return (time.perf_counter() - start) * 1000 / count


def fresh(start_method: str):
    def run():
        pool = RankPool(2, start_method=start_method)
        try:
            pool.run(gradient_check)
        finally:
            pool.close()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=50, help="checks through the pool")
    parser.add_argument("--fresh", type=int, default=5, help="checks with fresh processes")
    args = parser.parse_args()

    pool = RankPool(2)
    start = time.perf_counter()
    pool.start()
    startup_ms = (time.perf_counter() - start) * 1000
    pool.run(gradient_check)  # warm-up
    pooled_ms = per_check_ms(lambda: pool.run(gradient_check), args.checks)
    pool.close()
    amortised_ms = (startup_ms + pooled_ms * args.checks) / args.checks

    spawn_ms = per_check_ms(fresh("spawn"), args.fresh)
    fork_ms = per_check_ms(fresh("fork"), args.fresh)

    print(f"torch {torch.__version__}, 2 ranks, gloo/cpu, {torch.get_num_threads()} threads")
    print(f"pool start-up (once)                {startup_ms:8.1f} ms")
    print(f"pooled check                        {pooled_ms:8.1f} ms")
    print(f"pooled, start-up amortised over {args.checks:<3} {amortised_ms:8.1f} ms")
    print(f"fresh spawned processes per check   {spawn_ms:8.1f} ms")
    print(f"fresh forked processes per check    {fork_ms:8.1f} ms")
    ratio = spawn_ms / amortised_ms
    verdict = "meets" if ratio >= 20 else "MISSES"
    print(f"pool vs fresh spawn: {ratio:.0f}x cheaper ({verdict} the 20x target)")
    print(f"pool vs fresh fork:  {fork_ms / amortised_ms:.0f}x cheaper")


if __name__ == "__main__":
    main()
