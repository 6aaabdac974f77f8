"""Lesson 04, task4_2: ``pick_device(env, gpu_count)``: the GPU index is LOCAL_RANK, never RANK
(lab 04's two machines), the CPU without GPUs, and a RuntimeError that explains a missing
LOCAL_RANK or more processes than GPUs. Plain calls, no ranks.

    pytest lessons/04_pitfalls -m task4_2
"""

from __future__ import annotations

import re

import pytest
import torch

from lesson04.common import lab, runtime_error_from

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task4_2": {
        "no GPU (gpu_count == 0): torch.device('cpu')": ["test_pick_device_uses_the_local_rank"],
        "otherwise cuda:<LOCAL_RANK>, never RANK": ["test_pick_device_uses_the_local_rank"],
        "raise RuntimeError if LOCAL_RANK is missing (say it is set by torchrun)":
            ["test_pick_device_explains_bad_environments"],
        "raise RuntimeError if LOCAL_RANK is not below gpu_count":
            ["test_pick_device_explains_bad_environments",
             "test_pick_device_names_the_local_rank_and_the_gpu_count"],
        "name both numbers: more processes than GPUs":
            ["test_pick_device_names_the_local_rank_and_the_gpu_count"],
    },
}


@pytest.mark.task4_2
def test_pick_device_uses_the_local_rank(ex):
    """Every process of an emulated job of 2 machines with 2 processes each gets `cuda:LOCAL_RANK`,
    never `cuda:RANK`, on machines with 2 and with 4 GPUs; without GPUs the device is the CPU, even
    with an empty environment. Plain calls, no ranks."""
    two_machines = lab("04_device_from_rank").TWO_MACHINES
    # Two GPUs per machine, as many as processes; then four, with two processes on each.
    for gpus, env in [(2, env) for env in two_machines] + [(4, env) for env in two_machines]:
        process = (f"RANK={env['RANK']} LOCAL_RANK={env['LOCAL_RANK']} on a machine with {gpus} "
                   f"GPUs")
        try:
            got = ex.pick_device(dict(env), gpu_count=gpus)
        except NotImplementedError:
            raise
        except RuntimeError as error:
            raise AssertionError(f"pick_device raised for {process}, a valid process of a 2 x 2 "
                                 f"job: {error}. The GPU index is LOCAL_RANK, never RANK") from None
        assert isinstance(got, torch.device), f"return a torch.device, not {type(got).__name__}"
        want = torch.device("cuda", int(env["LOCAL_RANK"]))
        assert got == want, (
            f"{process} got {got}, expected {want}: the GPU index is LOCAL_RANK, never RANK")
    assert ex.pick_device(dict(two_machines[3]), gpu_count=0) == torch.device("cpu"), (
        "without GPUs the device is the CPU")
    try:
        plain = ex.pick_device({}, gpu_count=0)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(
            f"pick_device({{}}, gpu_count=0), a plain `python script.py` without GPUs, raised "
            f"{type(error).__name__}: {error}. Without GPUs the device is the CPU whatever the "
            f"environment says: check gpu_count == 0 first") from None
    assert plain == torch.device("cpu"), (
        f"pick_device({{}}, gpu_count=0) returned {plain}: without GPUs the device is the CPU; "
        f"check gpu_count == 0 first")


@pytest.mark.task4_2
def test_pick_device_explains_bad_environments(ex):
    """A missing LOCAL_RANK raises a RuntimeError that names `LOCAL_RANK` and `torchrun`;
    LOCAL_RANK=2 on a machine with 2 GPUs raises one that says `GPU` and `2`."""
    missing = runtime_error_from(
        lambda: ex.pick_device({"RANK": "0", "WORLD_SIZE": "1"}, gpu_count=1),
        "LOCAL_RANK is missing from the environment")
    assert "LOCAL_RANK" in str(missing) and "torchrun" in str(missing), (
        f"a missing LOCAL_RANK should say so and mention torchrun: {missing}")
    too_many = runtime_error_from(
        lambda: ex.pick_device({"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3"}, gpu_count=2),
        "LOCAL_RANK=2 on a machine with 2 GPUs")
    assert "2" in str(too_many) and "GPU" in str(too_many), (
        f"LOCAL_RANK=2 with 2 GPUs should name both: {too_many}")


@pytest.mark.task4_2
def test_pick_device_names_the_local_rank_and_the_gpu_count(ex):
    """LOCAL_RANK=3 on a machine with 2 GPUs raises a RuntimeError that names both numbers, the
    local rank 3 and the GPU count 2."""
    too_many = runtime_error_from(
        lambda: ex.pick_device({"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"}, gpu_count=2),
        "LOCAL_RANK=3 on a machine with 2 GPUs")
    missing = [n for n in ("3", "2") if not re.search(rf"\b{n}\b", str(too_many))]
    assert not missing, (
        f"LOCAL_RANK=3 on a machine with 2 GPUs: the error should name both numbers, the "
        f"local rank (3) and the GPU count (2), but {' and '.join(missing)} is missing: "
        f"{too_many}")
