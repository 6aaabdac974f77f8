"""Grades task5_1, memory_per_rank: the bytes per rank of DDP and ZeRO stages 1 to 3, against the
ZeRO paper's figure, the running example, padding, any setup (generated) and bad input.

    pytest lessons/05_sharded_data_parallel -m task5_1
"""

from __future__ import annotations

import pytest

from harness.sweep import st, sweep

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task5_1": {
        "stage 0 keeps everything whole on every rank":
            ["test_memory_per_rank", "test_memory_per_rank_for_any_setup",
             "test_memory_per_rank_reproduces_the_zero_papers_figure"],
        "stage 1 shards the optimizer state across the world_size ranks":
            ["test_memory_per_rank", "test_memory_per_rank_for_any_setup",
             "test_memory_per_rank_reproduces_the_zero_papers_figure"],
        "stage 2 the gradients as well":
            ["test_memory_per_rank", "test_memory_per_rank_for_any_setup",
             "test_memory_per_rank_reproduces_the_zero_papers_figure"],
        "stage 3 the parameters as well":
            ["test_memory_per_rank", "test_memory_per_rank_for_any_setup",
             "test_memory_per_rank_reproduces_the_zero_papers_figure"],
        "a sharded quantity takes ceil(num_params / world_size) elements":
            ["test_memory_per_rank", "test_memory_per_rank_for_any_setup"],
        "each parameter in param_bytes, its gradient in grad_bytes, optimizer_bytes of state":
            ["test_memory_per_rank", "test_memory_per_rank_for_any_setup",
             "test_memory_per_rank_reproduces_the_zero_papers_figure"],
        "returns parameters, gradients, optimizer_state and total":
            ["test_memory_per_rank", "test_memory_per_rank_for_any_setup",
             "test_memory_per_rank_reproduces_the_zero_papers_figure"],
        "whole numbers of bytes": ["test_memory_per_rank_counts_whole_bytes"],
        "a stage other than 0-3 raises ValueError":
            ["test_memory_per_rank_rejects_what_is_not_a_setup"],
        "world_size < 1 raises ValueError": ["test_memory_per_rank_rejects_what_is_not_a_setup"],
        "num_params < 0 raises ValueError": ["test_memory_per_rank_rejects_what_is_not_a_setup"],
    },
}


GB = 10**9
# The ZeRO paper's own example (Rajbhandari et al. 2020, figure 1): 7.5 billion parameters on
# 64 GPUs, mixed precision (2 + 2 bytes, K = 12): 120, 31.4, 16.6 and 1.9 GB per GPU.
PAPER = dict(num_params=7_500_000_000, world_size=64, param_bytes=2, grad_bytes=2,
             optimizer_bytes=12)
PAPER_TOTALS_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
TINY_GPT = 55_808  # the lesson script's model (lessons/gpt, size "tiny")
FORMULA_CASES = [
    # (arguments, stage, expected {parameters, gradients, optimizer_state})
    (dict(num_params=TINY_GPT, world_size=2), 0, (4 * TINY_GPT, 4 * TINY_GPT, 8 * TINY_GPT)),
    (dict(num_params=TINY_GPT, world_size=2), 1, (4 * TINY_GPT, 4 * TINY_GPT, 4 * TINY_GPT)),
    (dict(num_params=TINY_GPT, world_size=2), 2, (4 * TINY_GPT, 2 * TINY_GPT, 4 * TINY_GPT)),
    (dict(num_params=TINY_GPT, world_size=2), 3, (2 * TINY_GPT, 2 * TINY_GPT, 4 * TINY_GPT)),
    # 55,808 / 3 = 18,602.67: the busiest rank holds 18,603 (padding)
    (dict(num_params=TINY_GPT, world_size=3), 2, (4 * TINY_GPT, 4 * 18_603, 8 * 18_603)),
    (dict(num_params=TINY_GPT, world_size=3), 3, (4 * 18_603, 4 * 18_603, 8 * 18_603)),
    (dict(num_params=10, world_size=4), 3, (4 * 3, 4 * 3, 8 * 3)),
    (dict(num_params=3, world_size=4), 1, (12, 12, 8)),  # more ranks than parameters
    (dict(num_params=1000, world_size=1), 3, (4000, 4000, 8000)),  # one rank: nothing shared
    (dict(num_params=1000, world_size=8, param_bytes=2, grad_bytes=2, optimizer_bytes=12), 2,
     (2000, 250, 1500)),
]


def formula_call(arguments: dict, stage: int) -> str:
    shown = ", ".join(f"{k}={v:_}" if isinstance(v, int) else f"{k}={v}"
                      for k, v in arguments.items())
    return f"memory_per_rank({shown}, stage={stage})"


def formula_diagnosis(arguments: dict, stage: int, key: str, got) -> str:
    psi, world = arguments["num_params"], arguments["world_size"]
    size = {"parameters": arguments.get("param_bytes", 4),
            "gradients": arguments.get("grad_bytes", 4),
            "optimizer_state": arguments.get("optimizer_bytes", 8)}.get(key)
    if size is None or not isinstance(got, (int, float)):
        return ""
    sharded_from = {"optimizer_state": 1, "gradients": 2, "parameters": 3}[key]
    if got == psi // world * size and psi % world:
        return (f"that is floor(num_params / world_size) elements: the busiest rank holds "
                f"ceil(num_params / world_size) = {-(-psi // world)}, padding included")
    if got == psi * size and stage >= sharded_from:
        return (f"{key.replace('_', ' ')} is whole, but stage {stage} shards it: stage 1 "
                f"shards the optimizer state, stage 2 the gradients too, stage 3 the "
                f"parameters too (each stage keeps what the one before it sharded)")
    if got != psi * size and stage < sharded_from:
        return (f"stage {stage} does not shard the {key.replace('_', ' ')}: every rank holds "
                f"all {psi:_} of them, {psi * size:_} bytes")
    return ""


@pytest.mark.task5_1
@pytest.mark.parametrize("arguments,stage,expected", FORMULA_CASES,
                         ids=[f"{c[0]['num_params']}-W{c[0]['world_size']}-stage{c[1]}"
                              for c in FORMULA_CASES])
def test_memory_per_rank(ex, arguments, stage, expected):
    """`memory_per_rank` gives each part's bytes and the total on the busiest rank in 10 fixed
    setups: the running example's 55,808 parameters at stages 0 to 3 on 2 ranks and padded on 3
    (18,603 a rank), 10 and 3 parameters on 4 ranks, one rank, and 2 + 2 bytes with K = 12 on 8."""
    got = ex.memory_per_rank(**arguments, stage=stage)
    call = formula_call(arguments, stage)
    assert isinstance(got, dict), f"{call} returned {type(got).__name__}, not a dict"
    want = dict(zip(("parameters", "gradients", "optimizer_state"), expected, strict=True))
    want["total"] = sum(expected)
    missing = sorted(set(want) - set(got))
    assert not missing, f"{call} has no {missing} in {sorted(got)}"
    for key, value in want.items():
        if got[key] != value:
            why = formula_diagnosis(arguments, stage, key, got[key])
            raise AssertionError(f"{call}[{key!r}] = {got[key]!r}, expected {value:_}"
                                 + (f": {why}" if why else ""))


@pytest.mark.task5_1
@sweep(num_params=st.integers(0, 10**12), world_size=st.integers(1, 4096),
       stage=st.integers(0, 3), param_bytes=st.sampled_from([1, 2, 4, 8]),
       grad_bytes=st.sampled_from([1, 2, 4]), optimizer_bytes=st.integers(0, 16),
       max_examples=80)
def test_memory_per_rank_for_any_setup(ex, num_params, world_size, stage, param_bytes,
                                       grad_bytes, optimizer_bytes):
    """`memory_per_rank` equals an oracle written from the text in generated setups (up to 10¹²
    parameters, 4,096 ranks, stages 0 to 3, generated byte sizes): each stage shards one more
    kind of state, a sharded kind taking ceil(num_params / world_size) elements."""
    arguments = dict(num_params=num_params, world_size=world_size, param_bytes=param_bytes,
                     grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    shard = -(-num_params // world_size)
    elements = {"parameters": shard if stage >= 3 else num_params,
                "gradients": shard if stage >= 2 else num_params,
                "optimizer_state": shard if stage >= 1 else num_params}
    sizes = {"parameters": param_bytes, "gradients": grad_bytes,
             "optimizer_state": optimizer_bytes}
    want = {key: elements[key] * sizes[key] for key in elements}
    want["total"] = sum(want.values())
    got = ex.memory_per_rank(**arguments, stage=stage)
    call = formula_call(arguments, stage)
    for key, value in want.items():
        got_value = got.get(key) if isinstance(got, dict) else None
        if got_value != value:
            why = formula_diagnosis(arguments, stage, key, got_value)
            raise AssertionError(f"{call}[{key!r}] = {got_value!r}, expected {value:_}"
                                 + (f": {why}" if why else ""))


@pytest.mark.task5_1
def test_memory_per_rank_reproduces_the_zero_papers_figure(ex):
    """The totals are the ZeRO paper's figure to 0.1 GB: 120, 31.4, 16.6 and 1.9 GB per GPU at
    stages 0 to 3, for 7.5 billion parameters on 64 GPUs in mixed precision (2 + 2 bytes, K =
    12)."""
    for stage, total_gb in PAPER_TOTALS_GB.items():
        got = ex.memory_per_rank(**PAPER, stage=stage)["total"] / GB
        assert round(got, 1) == total_gb, (
            f"{formula_call(PAPER, stage)}['total'] is {got:.2f} GB; the ZeRO paper's figure "
            f"gives {total_gb} GB for 7.5B parameters on 64 GPUs in mixed precision")


@pytest.mark.task5_1
@pytest.mark.parametrize("arguments", [dict(num_params=100, world_size=2, stage=4),
                                       dict(num_params=100, world_size=2, stage=-1),
                                       dict(num_params=100, world_size=0, stage=1),
                                       dict(num_params=-1, world_size=2, stage=1)],
                         ids=["stage-4", "stage-minus-1", "world-0", "negative-parameters"])
def test_memory_per_rank_rejects_what_is_not_a_setup(ex, arguments):
    """Stages 4 and -1, a world of 0 ranks and -1 parameters each raise ValueError, not another
    error or a result."""
    try:
        got = ex.memory_per_rank(**arguments)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"memory_per_rank({arguments}) raised {type(error).__name__}: "
                             f"{error}; check the arguments first and raise ValueError") from None
    raise AssertionError(f"memory_per_rank({arguments}) returned {got}: raise ValueError, "
                         f"there are stages 0 to 3, at least one rank and no fewer than 0 "
                         f"parameters")


@pytest.mark.task5_1
@pytest.mark.parametrize("arguments,stage,expected", FORMULA_CASES[1:2] + FORMULA_CASES[4:6],
                         ids=["divisible-stage1", "padded-stage2", "padded-stage3"])
def test_memory_per_rank_counts_whole_bytes(ex, arguments, stage, expected):
    """Every byte count is an int, in a divisible setup and two padded ones.

    Whole numbers: 446,464.0 equals 446,464, but a float in a table of bytes is a division that
    should have been a ceiling (or a // that lost its padding)."""
    got = ex.memory_per_rank(**arguments, stage=stage)
    call = formula_call(arguments, stage)
    assert isinstance(got, dict), f"{call} returned {type(got).__name__}, not a dict"
    floats = {key: value for key, value in got.items()
              if not isinstance(value, int) or isinstance(value, bool)}
    assert not floats, (
        f"{call} gives {floats}: bytes are whole numbers, ints. Count the elements of a shard "
        f"with integer arithmetic, ceil(num_params / world_size) = -(-num_params // "
        f"world_size), not with /")
