"""What the test files of lesson 08 share: the lesson's constants (its collectives, byte units,
the benchmark's message sizes, the scripts and compare_methods.py's smallest run), the check
that a function refuses its arguments, the ring's formulas written from the text (the factor a
rank sends per payload byte, the alpha-beta time, the relative least-squares fit and noisy
points to fit), and the README's decision table, row by row.
"""

from __future__ import annotations

import re

import torch

from harness.exercises import LESSONS_DIR

LESSON = "08_measure_and_choose"
README = LESSONS_DIR / LESSON / "README.md"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
MiB = 1024 * 1024
GB = 10**9
SIZES = [2**k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB

BENCH = f"lessons/{LESSON}/bench_collectives.py"
METHODS = f"lessons/{LESSON}/compare_methods.py"
# compare_methods.py's smallest run: 4 blocks, for interleaved 1F1B's 2 chunks on each of 2 ranks
TINY = dict(width=32, blocks=4, context=16, batch_size=8)


def assert_refuses(function, arguments, why: str) -> ValueError:
    """``function(*arguments)`` must raise ValueError; the failure says what it returned."""
    try:
        got = function(*arguments)
    except ValueError as error:
        return error
    shown = ", ".join(repr(a) for a in arguments)
    raise AssertionError(f"{function.__name__}({shown}) returned {got!r:.80}; expected "
                         f"ValueError: {why}")


# What a rank of a ring sends per byte of payload (the text's table).
def ring_factor(op: str, world: int) -> float:
    return {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}.get(op, (world - 1) / world)


def ring_seconds(n: float, world: int, alpha: float, beta: float) -> float:
    """The text's model, written here from the formula: t = 2(W-1) alpha + 2(W-1)/W n beta."""
    return 2 * (world - 1) * alpha + 2 * (world - 1) / world * n * beta


def relative_least_squares(sizes, seconds, world: int) -> tuple[float, float]:
    """The oracle: minimise the sum of ((a + b n - t) / t)^2 through its normal equations."""
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    w = 1 / t**2
    sw, sn, snn = w.sum(), (w * n).sum(), (w * n * n).sum()
    st_, snt = (w * t).sum(), (w * n * t).sum()
    b = (sw * snt - sn * st_) / (sw * snn - sn * sn)
    a = (st_ - b * sn) / sw
    steps = 2 * (world - 1)
    return float(a) / steps, float(b) * world / steps


def noisy_times(sizes, world: int, alpha: float, beta: float, spread: float, seed: int):
    noise = torch.Generator().manual_seed(seed)
    jitter = 1 + spread * (2 * torch.rand(len(sizes), generator=noise, dtype=torch.float64) - 1)
    return [ring_seconds(n, world, alpha, beta) * float(j) for n, j in zip(sizes, jitter,
                                                                           strict=True)]


def readme_cases() -> list[dict]:
    """The decision table of the README, row by row: the cases the text promises."""
    text = README.read_text()
    table = text.split("<!-- choose_method cases -->", 1)[1].split("\n\n", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in table.strip().splitlines()[2:]]
    cases = []
    for cells in rows:
        number = [float(re.match(r"[\d.]+", cell).group(0)) for cell in cells[1:4]]
        cases.append({"case": cells[0], "model_bytes": int(number[0] * GB),
                      "activation_bytes": int(number[1] * GB), "gpu_memory": int(number[2] * GB),
                      "num_gpus": int(cells[4]), "gpus_per_node": int(cells[5]), "link": cells[6],
                      "moe": {"yes": True, "no": False}[cells[7]], "method": cells[8].strip("`")})
    return cases
