"""Lesson 03: sharding, hand-written and real DDP, and the script under real launchers.

The equalities this lesson rests on are checked against a single process:
W ranks with per-rank batch b, averaging gradients, take exactly the steps of one process with
batch W*b, provided every global batch is the same set of samples.
"""

from __future__ import annotations

import copy
import datetime
import re

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, SIZES, CharDataset, GPTConfig, load_text, parameter_digest, train_val_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from harness.compare import assert_close, assert_parameters_close, full_fp32
from harness.exercises import load_exercise, load_lesson_module, raise_if_untouched
from harness.hardware import needs_gpus
from harness.launch import run_script, start_script
from harness.ranks import group_params, run_on_ranks
from harness.sweep import st, sweep

LESSON = "03_ddp"
SCRIPT = f"lessons/{LESSON}/train_ddp.py"
GROUPS = group_params(world_sizes=(2, 3))

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task3_1": {
        "the same permutation on every rank: a torch.Generator seeded with seed + epoch": [
            "test_shard_indices_equal_distributed_sampler",
            "test_shard_indices_equal_distributed_sampler_for_any_split"],
        "the tail padded by repeating indices from the start": [
            "test_shard_indices_equal_distributed_sampler",
            "test_shard_indices_equal_distributed_sampler_for_any_split"],
        "or cut, with drop_last": ["test_shard_indices_equal_distributed_sampler"],
        "then every num_replicas-th index starting at rank": [
            "test_shard_indices_equal_distributed_sampler"],
        "DistributedSampler's defaults: shuffle, seed 0, epoch 0, no drop_last": [
            "test_shard_indices_defaults_are_distributed_samplers"],
    },
    "task3_2": {
        "read RANK, LOCAL_RANK, WORLD_SIZE": [
            "test_setup_sets_the_device_before_joining_with_a_timeout"],
        "LOCAL_WORLD_SIZE, default: WORLD_SIZE": [
            "test_setup_local_world_size_defaults_to_world_size"],
        "none of the five launcher variables set: RuntimeError saying to launch with torchrun": [
            "test_setup_rejects_bad_environments"],
        "only some set: RuntimeError naming the missing ones": [
            "test_setup_rejects_bad_environments"],
        "backend auto: nccl when CUDA has at least LOCAL_WORLD_SIZE GPUs, else gloo": [
            "test_setup_sets_the_device_before_joining_with_a_timeout",
            "test_setup_auto_uses_gloo_with_fewer_gpus_than_local_ranks",
            "test_setup_auto_uses_gloo_without_a_gpu",
            "test_setup_uses_nccl_on_a_one_gpu_machine"],
        "nccl with no GPU, or fewer than LOCAL_WORLD_SIZE: RuntimeError, before touching CUDA": [
            "test_setup_refuses_nccl_without_enough_gpus",
            "test_setup_rejects_bad_environments"],
        "with nccl, torch.cuda.set_device(local_rank) before init_process_group": [
            "test_setup_sets_the_device_before_joining_with_a_timeout"],
        "the device is cuda:<local_rank> with nccl, the CPU with gloo": [
            "test_setup_sets_the_device_before_joining_with_a_timeout",
            "test_setup_auto_uses_gloo_with_fewer_gpus_than_local_ranks"],
        "init_process_group(backend, init_method='env://', ...)": [
            "test_setup_sets_the_device_before_joining_with_a_timeout"],
        "a timeout under a minute": [
            "test_setup_sets_the_device_before_joining_with_a_timeout"],
    },
    "task3_3": {
        "replace every gradient by its mean over all ranks, in place": [
            "test_average_gradients_equal_one_process_on_the_whole_batch"],
        "parameters without a gradient are skipped": [
            "test_average_gradients_skips_parameters_without_a_gradient"],
    },
    "task3_4": {
        "forward, loss: loss_fn(model(inputs), targets)": [
            "test_train_one_epoch_weighs_each_batch_by_its_size"],
        "sum loss * batch size and the sample count on each rank": [
            "test_train_one_epoch_weighs_each_batch_by_its_size"],
        "tell the sampler the epoch first": [
            "test_train_one_epoch_equals_one_process_on_global_batches"],
        "zero the gradients, forward, loss, backward, step": [
            "test_train_one_epoch_equals_one_process_on_global_batches"],
        "return the mean loss per sample over the whole epoch and all ranks": [
            "test_train_one_epoch_equals_one_process_on_global_batches"],
        "move each batch to the model's device": [
            "test_train_one_epoch_weighs_each_batch_by_its_size"],
    },
    "task3_5": {
        "gradients equal DDP's for several steps": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward"],
        "the first all-reduce starts before backward has produced the last gradient": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward"],
        "all-reduce asynchronously, waited on only in wait()": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward"],
        "wait() divides by the world size and copies the results into each param.grad": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward"],
        "wait() resets for the next step": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward",
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
        "buckets in reverse order, each up to bucket_size elements (default 2**20)": [
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
        "a parameter larger than bucket_size gets a bucket of its own": [
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
        "one all-reduce per bucket, once every parameter of it is ready": [
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
        "remove() removes the hooks": [
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
    },
}


@pytest.fixture
def ex():
    return load_exercise(LESSON)


# ----------------------------------------------------------------------------- shared pieces


def make_model(seed: int = 0) -> nn.Module:
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    torch.random.set_rng_state(generator_state)
    return model


def make_data(samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=generator), torch.randn(samples, 3,
                                                                      generator=generator)


def single_process_gradients(inputs, targets) -> dict[str, torch.Tensor]:
    model = make_model()
    nn.functional.mse_loss(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def with_diagnosis(error: AssertionError, why: str) -> AssertionError:
    """``error`` with ``why`` appended to its first line (the line a summary shows)."""
    first, _, rest = str(error).partition("\n")
    return AssertionError(f"{first}: {why}" + (f"\n{rest}" if rest else ""))


def my_share(ctx, inputs, targets):
    """This rank's contiguous share of the global batch."""
    per_rank = len(inputs) // ctx.world_size
    part = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    return inputs[part].to(ctx.device), targets[part].to(ctx.device)


# ----------------------------------------------------------------------------- task3_1 sharding

SWEEP_LENGTHS = (1, 2, 3, 5, 7, 10, 16, 33)
SWEEP_WORLDS = (1, 2, 3, 4)


def sampler_indices(length, world, rank, shuffle=True, seed=0, epoch=0, drop_last=False):
    sampler = DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.task3_1
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in-order"])
@pytest.mark.parametrize("drop_last", [False, True], ids=["pad", "drop_last"])
def test_shard_indices_equal_distributed_sampler(ex, shuffle, drop_last):
    for length in SWEEP_LENGTHS:
        for world in SWEEP_WORLDS:
            for seed, epoch in ((0, 0), (0, 1), (7, 3)):
                for rank in range(world):
                    call = (f"shard_indices(dataset_len={length}, num_replicas={world}, "
                            f"rank={rank}, shuffle={shuffle}, seed={seed}, epoch={epoch}, "
                            f"drop_last={drop_last})")
                    got = ex.shard_indices(length, world, rank, shuffle=shuffle, seed=seed,
                                           epoch=epoch, drop_last=drop_last)
                    want = sampler_indices(length, world, rank, shuffle, seed, epoch, drop_last)
                    assert isinstance(got, list), f"{call} returned {type(got).__name__}, not list"
                    if [int(i) for i in got] != want:
                        why = shard_diagnosis(ex, length, world, shuffle, seed, epoch, drop_last)
                        raise AssertionError(f"{call} = {got}, but DistributedSampler yields "
                                             f"{want}" + (f". {why}" if why else ""))


@pytest.mark.task3_1
@sweep(length=st.integers(0, 500), world=st.integers(1, 64), shuffle=st.booleans(),
       drop_last=st.booleans(), seed=st.integers(0, 2**31 - 1), epoch=st.integers(0, 1000),
       data=st.data(), max_examples=60)
def test_shard_indices_equal_distributed_sampler_for_any_split(ex, length, world, shuffle,
                                                             drop_last, seed, epoch, data):
    """Beyond the grid above: longer datasets, more replicas, any seed and epoch."""
    rank = data.draw(st.integers(0, world - 1), label="rank")
    got = ex.shard_indices(length, world, rank, shuffle=shuffle, seed=seed, epoch=epoch,
                           drop_last=drop_last)
    want = sampler_indices(length, world, rank, shuffle, seed, epoch, drop_last)
    assert [int(i) for i in got] == want, (
        f"shard_indices(dataset_len={length}, num_replicas={world}, rank={rank}, "
        f"shuffle={shuffle}, seed={seed}, epoch={epoch}, drop_last={drop_last}) = {got[:12]}"
        f"{' ...' if len(got) > 12 else ''}, but DistributedSampler yields {want[:12]}"
        f"{' ...' if len(want) > 12 else ''}")


@pytest.mark.task3_1
@pytest.mark.parametrize("length, world", [(10, 3), (5, 4)])
def test_shard_indices_defaults_are_distributed_samplers(ex, length, world):
    """Called without the keywords, shard_indices is DistributedSampler(dataset, world, rank)."""
    for rank in range(world):
        got = ex.shard_indices(length, world, rank)
        want = list(DistributedSampler(range(length), num_replicas=world, rank=rank))
        assert [int(i) for i in got] == want, (
            f"shard_indices({length}, {world}, {rank}) = {got}, but DistributedSampler("
            f"dataset, {world}, {rank}) yields {want}: keep its defaults, shuffle=True, seed=0, "
            f"epoch=0, drop_last=False")


def interleaved(shards: list[list[int]]) -> list[int]:
    """The one order the shards were cut from: shard r holds positions r, r + W, r + 2W, ..."""
    return [shards[i % len(shards)][i // len(shards)] for i in range(sum(map(len, shards)))]


def shard_diagnosis(ex, length, world, shuffle, seed, epoch, drop_last) -> str:
    """One line naming the likely mistake, from every rank's answer for this call; or ""."""
    def answers(at_epoch):
        return [[int(i) for i in ex.shard_indices(length, world, rank, shuffle=shuffle,
                                                   seed=seed, epoch=at_epoch,
                                                   drop_last=drop_last)]
                for rank in range(world)]

    def expected(at_epoch):
        return [sampler_indices(length, world, rank, shuffle, seed, at_epoch, drop_last)
                for rank in range(world)]

    try:
        got, want = answers(epoch), expected(epoch)
        if shuffle and epoch != 0 and answers(0) == expected(0):
            return (f"epoch 0 matches but epoch {epoch} does not: is the order seeded with "
                    f"seed + epoch?")
    except Exception:  # noqa: BLE001 - no diagnosis; the comparison above says what differs
        return ""
    lengths, per_rank = [len(s) for s in got], len(want[0])
    if lengths != [per_rank] * world:
        if drop_last:
            return (f"the ranks got {lengths} indices: with drop_last every rank gets "
                    f"N // W = {per_rank}, the tail that does not divide is cut")
        if sum(lengths) == length:
            return (f"the ranks got {lengths} indices, {length} in all: no padding. Every rank "
                    f"must get ceil(N / W) = {per_rank}: pad the order by repeating indices "
                    f"from its start")
        return f"the ranks got {lengths} indices; every rank must get {per_rank}"
    full_got, full_want = interleaved(got), interleaved(want)
    if [i for shard in got for i in shard] == full_want:
        return (f"each rank got a contiguous block of the order; DistributedSampler gives rank "
                f"r every W-th index, starting at r: order[r::W], here order[r::{world}]")
    kept = min(length, len(full_want))
    if full_got[:kept] == full_want[:kept]:
        return (f"the first {kept} indices of the order match but the padding differs: "
                f"DistributedSampler pads with the order's first indices, repeated from the "
                f"start")
    if not shuffle:
        return "with shuffle=False the order is 0, 1, 2, ... before padding"
    if sorted(set(full_got)) == list(range(length)):
        return ("the permutation differs from DistributedSampler's: torch.randperm(N, "
                "generator=g) with g = torch.Generator() seeded with seed + epoch")
    return ""


@pytest.mark.parametrize("length,world", [(10, 3), (2, 4), (7, 2), (12, 4)])
def test_distributed_sampler_shards_have_equal_length_and_cover_the_data(length, world):
    shards = [sampler_indices(length, world, r) for r in range(world)]
    per_rank = -(-length // world)  # ceil
    assert all(len(s) == per_rank for s in shards), "every rank gets the same number"
    everything = sorted(i for s in shards for i in s)
    assert set(everything) == set(range(length)), "every sample is seen"
    padding = per_rank * world - length
    assert len(everything) - length == padding, "exactly enough repeats to even the shards"


@pytest.mark.parametrize("length,world", [(10, 3), (7, 2), (12, 4)])
def test_distributed_sampler_with_drop_last_is_disjoint(length, world):
    shards = [sampler_indices(length, world, r, drop_last=True) for r in range(world)]
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)), "no sample twice"
    assert len(flat) == (length // world) * world, "the tail that does not divide is dropped"


def test_distributed_sampler_order_changes_with_epoch_and_agrees_across_ranks():
    epoch0 = [sampler_indices(20, 2, r, epoch=0) for r in range(2)]
    epoch1 = [sampler_indices(20, 2, r, epoch=1) for r in range(2)]
    assert epoch0 != epoch1, "set_epoch must reshuffle"
    # Same permutation on every rank: interleaving the shards rebuilds one permutation.
    for shards in (epoch0, epoch1):
        rebuilt = [shards[i % 2][i // 2] for i in range(20)]
        assert sorted(rebuilt) == list(range(20))
    assert sampler_indices(20, 2, 0, epoch=1) == sampler_indices(20, 2, 0, epoch=1)


# ----------------------------------------------------------------------------- task3_2 init


# On a CPU-only machine torchrun never exercises the NCCL path, and on one machine RANK equals
# LOCAL_RANK. So the test below also runs setup in this process with CUDA and the
# process group faked: process 3 of a job of 2 machines x 2 GPUs (its LOCAL_RANK is 1), and
# records what it asks for and in which order. Nothing real is initialised. These checks
# come before the torchrun ones: a mistake they catch is reported in a second, not after a launch.
SECOND_MACHINE = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never contacted
MAX_INIT_TIMEOUT = 60.0  # seconds: "a timeout under a minute"


def _device_index(device) -> int | str:
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.index is not None:
        return device.index
    return repr(device)


def init_with_fakes(ex, monkeypatch, env: dict, gpus: int, backend: str,
                    calls: list | None = None):
    """Call ``ex.setup(backend)`` with ``gpus`` fake GPUs and a fake process group;
    return (what it returned, the calls it made in order). The calls also go into ``calls``
    when given, so that they can be read after setup raised."""
    calls = [] if calls is None else calls
    state = {"initialized": False, "device": 0, "backend": None}

    def set_device(device):
        calls.append(("set_device", _device_index(device)))
        state["device"] = _device_index(device)

    def init_process_group(backend=None, init_method=None, timeout=None, **kwargs):
        calls.append(("init_process_group", backend, timeout,
                      {"init_method": init_method, **kwargs}))
        state["initialized"], state["backend"] = True, backend

    fakes = {
        (torch.cuda, "is_available"): lambda: gpus > 0,
        (torch.cuda, "device_count"): lambda: gpus,
        (torch.cuda, "set_device"): set_device,
        (torch.cuda, "current_device"): lambda: state["device"],
        (dist, "init_process_group"): init_process_group,
        (dist, "is_initialized"): lambda: state["initialized"],
        (dist, "get_rank"): lambda group=None: int(env["RANK"]),
        (dist, "get_world_size"): lambda group=None: int(env["WORLD_SIZE"]),
        (dist, "get_backend"): lambda group=None: state["backend"],
        (dist, "barrier"): lambda *args, **kwargs: calls.append(("barrier",)),
    }
    for (owner, name), fake in fakes.items():
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, fake)
        for attribute, value in list(vars(ex).items()):  # `from ... import name` too
            if value is real:
                monkeypatch.setattr(ex, attribute, fake)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "init_process_group",
                        init_process_group)
    for name in (*ex.LAUNCHER_VARIABLES, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        return ex.setup(backend), calls
    finally:
        monkeypatch.undo()


@pytest.mark.task3_2
@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_setup_sets_the_device_before_joining_with_a_timeout(ex, monkeypatch, backend):
    where = (f"setup({backend!r}) as process RANK=3, LOCAL_RANK=1 of 2 machines x 2 GPUs "
             f"(CUDA faked)")
    try:
        info, calls = init_with_fakes(ex, monkeypatch, SECOND_MACHINE, 2, backend)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(f"{where} raised {type(error).__name__}: {error}") from None
    expected = {"rank": 3, "local_rank": 1, "world_size": 4, "local_world_size": 2,
                "backend": "nccl", "device": torch.device("cuda", 1)}
    for field, value in expected.items():
        got = getattr(info, field)
        assert got == value, (
            f"{where}: {field} is {got!r}, expected {value!r}"
            + (": the GPU index is LOCAL_RANK, not RANK" if field in ("local_rank", "device")
               else ""))
    devices = [call[1] for call in calls if call[0] == "set_device"]
    inits = [i for i, call in enumerate(calls) if call[0] == "init_process_group"]
    assert len(inits) == 1, f"{where}: init_process_group was called {len(inits)} times, not once"
    assert devices, (f"{where}: torch.cuda.set_device was never called: call "
                     f"torch.cuda.set_device(local_rank) before init_process_group")
    assert devices == [1], (
        f"{where}: torch.cuda.set_device({devices[0]}) was called: the GPU index is LOCAL_RANK "
        f"(1), not RANK (3)")
    first_set = next(i for i, call in enumerate(calls) if call[0] == "set_device")
    assert first_set < inits[0], (
        f"{where}: torch.cuda.set_device(1) was called after init_process_group: set the device "
        f"first, so that everything the process group sets up for this process (NCCL's "
        f"communicator, a barrier) uses its own GPU, not cuda:0")
    _, used_backend, timeout, options = calls[inits[0]]
    assert used_backend == "nccl", f"{where}: init_process_group got backend {used_backend!r}"
    assert options["init_method"] in (None, "env://"), (
        f"{where}: init_process_group got init_method={options['init_method']!r}: torchrun "
        f"describes the rendezvous in the environment, so pass init_method='env://'")
    assert timeout is not None, (
        f"{where}: init_process_group was called without timeout=: a missing peer then hangs "
        f"for the default timeout (10 minutes with NCCL, 30 with gloo) instead of failing; pass "
        f"timeout=datetime.timedelta(seconds=30)")
    assert isinstance(timeout, datetime.timedelta), (
        f"{where}: timeout={timeout!r}: pass a datetime.timedelta")
    assert 0 < timeout.total_seconds() <= MAX_INIT_TIMEOUT, (
        f"{where}: timeout={timeout}: keep it under a minute, so that a missing peer becomes an "
        f"error quickly")


@pytest.mark.task3_2
def test_setup_auto_uses_gloo_with_fewer_gpus_than_local_ranks(ex, monkeypatch):
    where = "setup('auto') with 2 processes on this machine and 1 GPU (CUDA faked)"
    try:
        info, calls = init_with_fakes(ex, monkeypatch, SECOND_MACHINE, 1, "auto")
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(
            f"{where} raised {type(error).__name__}: {error}. 'auto' should choose gloo here: "
            f"compare torch.cuda.device_count() with LOCAL_WORLD_SIZE") from None
    assert (info.backend, info.device) == ("gloo", torch.device("cpu")), (
        f"{where} returned backend {info.backend!r} on {info.device}: 'auto' should choose gloo "
        f"on the CPU: compare torch.cuda.device_count() with LOCAL_WORLD_SIZE")
    assert not [call for call in calls if call[0] == "set_device"], (
        f"{where}: gloo on the CPU should not call torch.cuda.set_device")
    inits = [call for call in calls if call[0] == "init_process_group"]
    assert inits and inits[0][1] == "gloo", f"{where}: init_process_group calls: {inits}"


def init_failure(ex, monkeypatch, env, gpus, backend, where):
    """Run init_with_fakes; a learner's unexpected error becomes the finding."""
    try:
        return init_with_fakes(ex, monkeypatch, env, gpus, backend)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(f"{where} raised {type(error).__name__}: {error}") from None


@pytest.mark.task3_2
def test_setup_auto_uses_gloo_without_a_gpu(ex, monkeypatch):
    env = {**SECOND_MACHINE, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1"}
    where = "setup('auto') as the only process on a machine without a GPU (CUDA faked)"
    info, calls = init_failure(ex, monkeypatch, env, 0, "auto", where)
    assert (info.backend, info.device) == ("gloo", torch.device("cpu")), (
        f"{where} returned backend {info.backend!r} on {info.device}: with no GPU, 'auto' is "
        f"gloo on the CPU (count 0 GPUs when torch.cuda.is_available() is False)")
    assert not [call for call in calls if call[0] == "set_device"], (
        f"{where}: gloo on the CPU should not call torch.cuda.set_device")


@pytest.mark.task3_2
@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_setup_uses_nccl_on_a_one_gpu_machine(ex, monkeypatch, backend):
    env = {**SECOND_MACHINE, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1"}
    where = f"setup({backend!r}) as the only process on a machine with 1 GPU (CUDA faked)"
    info, calls = init_failure(ex, monkeypatch, env, 1, backend, where)
    assert (info.backend, info.device) == ("nccl", torch.device("cuda", 0)), (
        f"{where} returned backend {info.backend!r} on {info.device}: one GPU is enough for one "
        f"local process: nccl on cuda:0")
    assert [call[1] for call in calls if call[0] == "set_device"] == [0], (
        f"{where}: expected torch.cuda.set_device(0) before init_process_group; calls: {calls}")


@pytest.mark.task3_2
def test_setup_local_world_size_defaults_to_world_size(ex, monkeypatch):
    env = {name: value for name, value in SECOND_MACHINE.items() if name != "LOCAL_WORLD_SIZE"}
    where = ("setup('auto') as RANK=3 of WORLD_SIZE=4 with LOCAL_WORLD_SIZE unset and 2 "
             "GPUs (CUDA faked)")
    info, calls = init_failure(ex, monkeypatch, env, 2, "auto", where)
    assert info.local_world_size == 4, (
        f"{where}: local_world_size is {info.local_world_size!r}, expected 4: without "
        f"LOCAL_WORLD_SIZE, take WORLD_SIZE (all the processes on one machine)")
    assert (info.backend, info.device) == ("gloo", torch.device("cpu")), (
        f"{where} returned backend {info.backend!r} on {info.device}: 4 local processes and 2 "
        f"GPUs: 'auto' is gloo (LOCAL_WORLD_SIZE defaults to WORLD_SIZE)")


@pytest.mark.task3_2
@pytest.mark.parametrize("gpus", [0, 1], ids=["no GPU", "1 GPU for 2 local ranks"])
def test_setup_refuses_nccl_without_enough_gpus(ex, monkeypatch, gpus):
    where = (f"setup('nccl') with 2 processes on this machine and {gpus} GPU(s) "
             f"(CUDA faked)")
    calls = []
    try:
        got, _ = init_with_fakes(ex, monkeypatch, SECOND_MACHINE, gpus, "nccl", calls)
    except NotImplementedError:
        raise
    except RuntimeError as error:
        message = str(error)
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        pytest.fail(f"{where} raised {type(error).__name__}: {error}; expected a RuntimeError "
                    f"saying nccl needs one GPU per local rank")
    else:
        pytest.fail(f"{where} returned {got!r} after the calls {calls}; expected a RuntimeError, "
                    f"before anything touches CUDA: nccl needs one GPU per local rank")
    assert "GPU" in message, (
        f"{where}: the RuntimeError should say what is missing (GPUs): {message}")
    touched = [call[0] for call in calls if call[0] in ("set_device", "init_process_group")]
    assert not touched, (
        f"{where}: the RuntimeError came after {' and '.join(touched)}: check the GPUs first and "
        f"raise before anything touches CUDA (on a machine without enough GPUs, "
        f"torch.cuda.set_device itself fails, with a less helpful error)")


CHECK_INIT = "lessons/03_ddp/check_setup.py"  # runs setup under torchrun


@pytest.fixture(scope="module")
def init_checks():
    """Both launches of the init check, started together (not at all for the untouched stub)."""
    raise_if_untouched(load_exercise(LESSON).setup)
    return {"torchrun": start_script(CHECK_INIT, launcher="torchrun", nproc=2),
            "bad environments": start_script(CHECK_INIT, "--bad-environments", timeout=60)}


@pytest.mark.slow
@pytest.mark.task3_2
def test_setup_under_torchrun(init_checks):
    run = init_checks["torchrun"].result()
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    for rank, info in enumerate(run.data["ranks"]):
        expected = {"rank": rank, "local_rank": rank, "world_size": 2, "local_world_size": 2,
                    "backend": backend,
                    "device": f"cuda:{rank}" if backend == "nccl" else "cpu"}
        for field, value in expected.items():
            assert info[field] == value, f"rank {rank}: {field} is {info[field]!r}, not {value!r}"
        assert info["backend_in_use"] == backend, f"rank {rank}: the group uses the wrong backend"
        assert info["all_reduce"] == 3.0, f"rank {rank}: the group does not work"
        if backend == "nccl":
            assert info["current_cuda_device"] == rank, f"rank {rank}: set_device was not called"


@pytest.mark.slow
@pytest.mark.task3_2
def test_setup_rejects_bad_environments(init_checks):
    run = init_checks["bad environments"].result()
    expectations = {
        "no launcher": ["torchrun"],
        "only RANK and WORLD_SIZE": ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"],
        "nccl without a GPU": ["GPU"],
        "nccl with 2 local ranks and 1 GPU": ["GPU"],
    }
    for case, words in expectations.items():
        outcome = run.data[case]
        assert outcome.get("error") == "RuntimeError", (
            f"{case}: expected a RuntimeError naming {words}, got {outcome}"
        )
        missing = [w for w in words if w not in outcome["message"]]
        assert not missing, f"{case}: the error should mention {missing}: {outcome['message']!r}"
    ok = run.data["auto on this machine, world of one"]
    assert "returned" in ok, f"a complete environment must work, got {ok}"
    assert ok["returned"]["world_size"] == "1" and ok["group"], ok
    if not torch.cuda.is_available():
        assert ok["returned"]["backend"] == "gloo" and ok["returned"]["device"] == "cpu", ok


# ----------------------------------------------------------------------------- task3_3 gradients


def hand_averaged_gradients(ctx, inputs, targets):
    with full_fp32():  # compared with a CPU run: no TF32
        model = make_model().to(ctx.device)
        x, y = my_share(ctx, inputs, targets)
        nn.functional.mse_loss(model(x), y).backward()
        local = {name: p.grad.clone() for name, p in model.named_parameters()}
        load_exercise(LESSON).average_gradients(model)
        return {"averaged": {name: p.grad for name, p in model.named_parameters()}, "local": local}


def averaging_diagnosis(got: dict, local: dict) -> str:
    """The mistake a wrong scale cannot show (harness.compare names those): no averaging."""
    if any(got.get(name) is None for name in local):
        return ""
    if all(torch.allclose(got[name].double(), local[name].double(), rtol=1e-5, atol=1e-7)
           for name in local):
        return ("each rank kept its own gradient: nothing was all-reduced into param.grad "
                "(all-reduce param.grad itself, in place, or copy the result back into it)")
    return ""


def ddp_gradients(ctx, inputs, targets):
    with full_fp32():  # compared with a CPU run: no TF32
        model = make_model(seed=ctx.rank)  # different on purpose: DDP broadcasts rank 0's weights
        model = DDP(model.to(ctx.device),
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        x, y = my_share(ctx, inputs, targets)
        nn.functional.mse_loss(model(x), y).backward()
        return {name: p.grad for name, p in model.module.named_parameters()}


@pytest.mark.task3_3
@pytest.mark.parametrize("group", GROUPS)
def test_average_gradients_equal_one_process_on_the_whole_batch(group):
    world, backend, device = group
    inputs, targets = make_data(4 * world)
    expected = single_process_gradients(inputs, targets)
    results = run_on_ranks(hand_averaged_gradients, inputs, targets, world_size=world,
                           backend=backend, device=device)
    for rank, result in enumerate(results):
        try:
            assert_parameters_close(result["averaged"], expected, rank=rank,
                                    what="averaged gradient")
        except AssertionError as error:
            why = averaging_diagnosis(result["averaged"], result["local"])
            if not why:
                raise
            raise with_diagnosis(error, why) from None


def averaged_with_an_unused_parameter(ctx):
    """average_gradients on a model one of whose parameters backward never reached."""
    model = make_model()
    unused = nn.Parameter(torch.ones(3))
    model.register_parameter("unused", unused)
    x, y = make_data(4, seed=ctx.rank)
    nn.functional.mse_loss(model(x), y).backward()
    try:
        load_exercise(LESSON).average_gradients(model)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        return {"error": f"{type(error).__name__}: {error}", "grad": None}
    return {"error": None, "grad": unused.grad}


@pytest.mark.task3_3
def test_average_gradients_skips_parameters_without_a_gradient():
    results = run_on_ranks(averaged_with_an_unused_parameter, world_size=2)
    for rank, result in enumerate(results):
        assert result["error"] is None, (
            f"rank {rank}: average_gradients raised {result['error']} on a model with a "
            f"parameter that backward never reached (its .grad is None): skip it")
        assert result["grad"] is None, (
            f"rank {rank}: the unused parameter's .grad became {result['grad']}: leave a "
            f"parameter without a gradient as it is (None)")


@pytest.mark.parametrize("group", GROUPS)
def test_ddp_gradients_equal_one_process_on_the_whole_batch(group):
    world, backend, device = group
    inputs, targets = make_data(4 * world)
    expected = single_process_gradients(inputs, targets)
    results = run_on_ranks(ddp_gradients, inputs, targets, world_size=world, backend=backend,
                           device=device)
    for rank, grads in enumerate(results):
        assert_parameters_close(grads, expected, rank=rank, what="DDP gradient")


# ----------------------------------------------------------------------------- task3_4 epochs

EPOCHS, SAMPLES, PER_RANK_BATCH, LR = 2, 36, 3, 0.1


def train_epochs(ctx, use_exercise: bool):
    """Train EPOCHS epochs of DDP on this rank's DistributedSampler shard."""
    with full_fp32():  # compared with a CPU run: no TF32
        inputs, targets = make_data(SAMPLES)
        dataset = TensorDataset(inputs, targets)
        sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
        loader = DataLoader(dataset, batch_size=PER_RANK_BATCH, sampler=sampler)
        model = DDP(make_model().to(ctx.device),
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses, sampler_epochs = [], []
        for epoch in range(EPOCHS):
            if use_exercise:
                losses.append(load_exercise(LESSON).train_one_epoch(
                    model, loader, optimizer, nn.functional.mse_loss, epoch))
                sampler_epochs.append(sampler.epoch)
                continue
            sampler.set_epoch(epoch)  # the lesson's claim, with the plain loop
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)).backward()
                optimizer.step()
        return {"parameters": dict(model.module.named_parameters()), "losses": losses,
                "sampler_epochs": sampler_epochs}


def one_process_on_global_batches(world: int):
    """One process, batch world*b, visiting each epoch's permutation in DistributedSampler's
    order: rank r takes perm[r::W], so global step k covers perm[k*W*b:(k+1)*W*b]."""
    inputs, targets = make_data(SAMPLES)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for epoch in range(EPOCHS):
        perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0 + epoch))
        total = 0.0
        for start in range(0, SAMPLES, world * PER_RANK_BATCH):
            batch = perm[start:start + world * PER_RANK_BATCH]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        losses.append(total / SAMPLES)
    return dict(model.named_parameters()), losses


@pytest.mark.task3_4
@pytest.mark.parametrize("group", GROUPS)
def test_train_one_epoch_equals_one_process_on_global_batches(group):
    world, backend, device = group
    expected_params, expected_losses = one_process_on_global_batches(world)
    results = run_on_ranks(train_epochs, True, world_size=world, backend=backend, device=device)
    for rank, result in enumerate(results):
        assert isinstance(result["losses"][0], float), (
            f"rank {rank}: train_one_epoch must return a Python float, "
            f"got {type(result['losses'][0]).__name__}"
        )
        for epoch, seen in enumerate(result["sampler_epochs"]):
            assert seen == epoch, (
                f"rank {rank}: after train_one_epoch(..., epoch={epoch}) the sampler's epoch is "
                f"still {seen}: call loader.sampler.set_epoch(epoch) before the loop, or every "
                f"epoch reads the same order")
    for rank, result in enumerate(results[1:], start=1):
        try:
            assert_parameters_close(result["parameters"], results[0]["parameters"], rank=rank,
                                    what=f"parameter after {EPOCHS} epochs, vs rank 0's")
        except AssertionError as error:
            raise with_diagnosis(
                error, "the ranks' parameters differ from each other: their gradients were not "
                "averaged. Run the forward through the DDP model, model(inputs), not "
                "model.module(inputs)") from None
    for rank, result in enumerate(results):
        assert_parameters_close(result["parameters"], expected_params, rank=rank,
                                what=f"parameter after {EPOCHS} epochs")
    for epoch in range(EPOCHS):
        returned = [result["losses"][epoch] for result in results]
        assert max(returned) - min(returned) <= 1e-9 * max(1.0, abs(returned[0])), (
            f"the ranks returned different losses for epoch {epoch}: {returned}: each returned "
            f"its own shard's mean. all_reduce the loss sum and the sample count, then divide")
    for rank, result in enumerate(results):
        for epoch, (got, want) in enumerate(zip(result["losses"], expected_losses, strict=True)):
            assert_close(torch.tensor(got), torch.tensor(want), rank=rank,
                         what=f"mean loss of epoch {epoch} (all samples, all ranks)")


def frozen_epoch(ctx, samples: int, batch_size: int):
    """One epoch of train_one_epoch with lr=0 (the model stays as it is), recording the order
    of the arguments loss_fn receives."""
    with full_fp32():  # compared with a CPU run: no TF32
        inputs, targets = make_data(samples)
        dataset = TensorDataset(inputs, targets)
        sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        model = DDP(make_model().to(ctx.device),
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        swapped = []

        def loss_fn(outputs, batch_targets):
            swapped.append(not outputs.requires_grad and batch_targets.requires_grad)
            return nn.functional.mse_loss(outputs, batch_targets)

        yielded, moved = [], []

        class RecordedLoader:
            """The loader, noting each batch it yields."""
            sampler = loader.sampler

            def __iter__(self):
                for batch in loader:
                    yielded.extend(batch)
                    yield batch

            def __len__(self):
                return len(loader)

        real_to = torch.Tensor.to

        def recording_to(self, *args, **kwargs):
            moved.append(self)
            return real_to(self, *args, **kwargs)

        torch.Tensor.to = recording_to
        try:
            loss = load_exercise(LESSON).train_one_epoch(model, RecordedLoader(), optimizer,
                                                         loss_fn, 0)
        finally:
            torch.Tensor.to = real_to
        unmoved = sum(not any(t is m for m in moved) for t in yielded)
        return {"loss": loss, "swapped": swapped, "unmoved": unmoved, "yielded": len(yielded)}


@pytest.mark.task3_4
def test_train_one_epoch_weighs_each_batch_by_its_size():
    samples, batch_size = 10, 3  # 5 samples per rank: batches of 3 and 2
    results = run_on_ranks(frozen_epoch, samples, batch_size, world_size=2)
    inputs, targets = make_data(samples)
    with torch.no_grad():
        expected = nn.functional.mse_loss(make_model()(inputs), targets).item()
    for rank, result in enumerate(results):
        assert result["unmoved"] == 0, (
            f"rank {rank}: {result['unmoved']} of the {result['yielded']} tensors the loader "
            f"yielded were never moved with .to(device): move each batch to the model's device "
            f"(on a GPU the data comes on the CPU)")
        assert not any(result["swapped"]), (
            f"rank {rank}: loss_fn got (targets, outputs): call loss_fn(model(inputs), targets), "
            f"outputs first")
        assert_close(torch.tensor(result["loss"]), torch.tensor(expected), rank=rank,
                     what="mean loss per sample of an epoch with lr=0 (10 samples on 2 ranks in "
                          "batches of 3 and 2: weigh each batch's mean loss by its size)")


@pytest.mark.parametrize("group", GROUPS)
def test_ddp_trajectory_equals_one_process_on_global_batches(group):
    world, backend, device = group
    expected_params, _ = one_process_on_global_batches(world)
    results = run_on_ranks(train_epochs, False, world_size=world, backend=backend,
                           device=device)
    for rank, result in enumerate(results):
        assert_parameters_close(result["parameters"], expected_params, rank=rank,
                                what=f"DDP parameter after {EPOCHS} epochs")


# ----------------------------------------------------------------------------- task3_5 overlap


class RecordedWork:
    """The work object of an asynchronous all-reduce, noting in ``events`` when it is waited on."""

    def __init__(self, work, number: int, events: list):
        self._work, self._number, self._events = work, number, events

    def wait(self, *args, **kwargs):
        self._events.append(("wait", self._number))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def bucketed_vs_ddp(ctx, steps: int):
    """Train ``steps`` steps with the learner's GradientBuckets next to DDP, recording in order
    the gradients backward produces, each dist.all_reduce (and its async_op), and each wait."""
    with full_fp32():  # compared with a CPU run: no TF32
        events: list = []
        real_all_reduce = dist.all_reduce
        started = [0]

        def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            started[0] += 1
            number = started[0]
            events.append(("all_reduce", number, bool(async_op)))
            work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
            return RecordedWork(work, number, events) if async_op else work

        exercise = load_exercise(LESSON)
        ours = make_model().to(ctx.device)
        reference = DDP(copy.deepcopy(ours),
                        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        layer_numel = sum(p.numel() for p in ours[2].parameters())  # one bucket per hidden layer
        buckets = exercise.GradientBuckets(ours, bucket_size=layer_numel)
        for name, param in ours.named_parameters():  # after theirs: runs once their hook has run
            param.register_post_accumulate_grad_hook(lambda p, name=name: events.append(name))
        first_layer = {"0.weight", "0.bias"}
        results = []
        patched = [(dist, "all_reduce")] + [(exercise, attribute) for attribute, value
                                            in vars(exercise).items() if value is real_all_reduce]
        for owner, attribute in patched:
            setattr(owner, attribute, recording_all_reduce)
        try:
            for step in range(steps):
                x, y = make_data(8, seed=100 + 10 * step + ctx.rank)
                x, y = x.to(ctx.device), y.to(ctx.device)
                events.clear()
                ours.zero_grad()
                nn.functional.mse_loss(ours(x), y).backward()
                during_backward = list(events)
                buckets.wait()
                reference.zero_grad()
                nn.functional.mse_loss(reference(x), y).backward()
                results.append({
                    "ours": {n: p.grad.clone() for n, p in ours.named_parameters()},
                    "ddp": {n: p.grad.clone() for n, p in reference.module.named_parameters()},
                    "events": during_backward,
                    "first_layer_at": min(i for i, e in enumerate(during_backward)
                                          if e in first_layer),
                })
        finally:
            for owner, attribute in patched:
                setattr(owner, attribute, real_all_reduce)
            buckets.remove()
        return results


def overlap_problem(result: dict) -> str:
    """What keeps the recorded all-reduces of one step from overlapping backward; or ""."""
    during = result["events"]
    calls = [e for e in during if isinstance(e, tuple) and e[0] == "all_reduce"]
    blocking = [e for e in calls if not e[2]]
    if blocking:
        return (f"{len(blocking)} of the {len(calls)} dist.all_reduce calls during backward ran "
                f"without async_op=True: a blocking all-reduce holds backward until the bucket "
                f"is averaged, so nothing overlaps. Start it with async_op=True, keep the work "
                f"object, and wait on it in wait()")
    waited = [e for e in during if isinstance(e, tuple) and e[0] == "wait"]
    if waited:
        return (f"work.wait() was called during backward, on {len(waited)} of the {len(calls)} "
                f"all-reduces started there: waiting right after starting blocks like a "
                f"blocking all-reduce. Call work.wait() only in wait()")
    started = [e for e in during[: result["first_layer_at"]]
               if isinstance(e, tuple) and e[0] == "all_reduce"]
    if not started:
        return (f"no dist.all_reduce started before backward reached the first layer (events: "
                f"{during}). Start each bucket's all-reduce (async_op=True) from the hooks as "
                f"soon as its gradients are ready")
    return ""


@pytest.mark.task3_5
@pytest.mark.parametrize("group", GROUPS)
def test_gradient_buckets_equal_ddp_and_overlap_backward(group):
    world, backend, device = group
    results = run_on_ranks(bucketed_vs_ddp, 3, world_size=world, backend=backend, device=device)
    for rank, steps in enumerate(results):
        for step, result in enumerate(steps):
            assert_parameters_close(result["ours"], result["ddp"], rank=rank,
                                    what=f"step {step}: bucketed gradient vs DDP's")
            problem = overlap_problem(result)
            assert not problem, f"rank {rank}, step {step}: {problem}"


class Leaves(nn.Module):
    """Parameters of the given sizes; parameter i's gradient is i + 1 everywhere, so a flat
    bucket's values tell which parameters it holds."""

    def __init__(self, sizes, frozen=()):
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.zeros(n), requires_grad=i not in frozen)
            for i, n in enumerate(sizes))

    def loss(self):
        return sum((i + 1) * p.sum() for i, p in enumerate(self.weights) if p.requires_grad)


def bucket_calls(ctx, sizes, frozen, bucket_size, steps=2):
    """For each step, the all-reduces started during backward (which parameters each holds,
    and its work number) and the works waited on in wait(); then what backward starts after
    remove()."""
    exercise = load_exercise(LESSON)
    model = Leaves(sizes, frozen)
    events: list = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        number = len([e for e in events if e[0] == "all_reduce"]) + 1
        held = sorted({int(v) - 1 for v in tensor.detach().unique().tolist()})
        events.append(("all_reduce", number, held))
        work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        return RecordedWork(work, number, events) if async_op else work

    patched = [(dist, "all_reduce")] + [(exercise, attribute) for attribute, value
                                        in vars(exercise).items() if value is real_all_reduce]
    for owner, attribute in patched:
        setattr(owner, attribute, recording_all_reduce)
    try:
        kwargs = {} if bucket_size is None else {"bucket_size": bucket_size}
        buckets = exercise.GradientBuckets(model, **kwargs)
        results = []
        for _ in range(steps):
            events.clear()
            model.zero_grad()
            model.loss().backward()
            during = list(events)
            buckets.wait()
            results.append({"started": [e for e in during if e[0] == "all_reduce"],
                            "waited": [e[1] for e in events[len(during):] if e[0] == "wait"]})
        buckets.remove()
        events.clear()
        model.zero_grad()
        model.loss().backward()
        after_remove = list(events)
    finally:
        for owner, attribute in patched:
            setattr(owner, attribute, real_all_reduce)
    return {"steps": results, "after_remove": after_remove}


BUCKET_CASES = [  # sizes, frozen, bucket_size, the buckets (parameter indices) expected
    pytest.param([300_000, 600_000, 7, 300_000, 10], (2,), None, [[1, 3, 4], [0]],
                 id="default 2**20 elements, from the last parameter, one frozen"),
    pytest.param([50, 200, 30, 30], (), 100, [[2, 3], [1], [0]],
                 id="100: a parameter of 200 gets a bucket of its own"),
    pytest.param([60, 40], (), 100, [[0, 1]], id="100: 40 + 60 fill one bucket exactly"),
    pytest.param([60, 40, 100], (), 100, [[2], [0, 1]],
                 id="100: a full bucket, then 40 + 60 fill the next one exactly"),
]


@pytest.mark.task3_5
@pytest.mark.parametrize(("sizes", "frozen", "bucket_size", "expected"), BUCKET_CASES)
def test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order(sizes, frozen,
                                                                     bucket_size, expected):
    results = run_on_ranks(bucket_calls, sizes, frozen, bucket_size, world_size=2)
    made = f"GradientBuckets(parameters of sizes {sizes}" + (
        f", bucket_size={bucket_size})" if bucket_size is not None else ")") + (
        f", parameter(s) {list(frozen)} frozen" if frozen else "")
    for rank, result in enumerate(results):
        for step, calls in enumerate(result["steps"]):
            got = sorted(held for _, _, held in calls["started"])
            assert got == sorted(expected), (
                f"rank {rank}, step {step}: {made} all-reduced buckets holding parameters "
                f"{[held for _, _, held in calls['started']]}; expected one all-reduce per bucket, "
                f"buckets {expected}: walk the parameters that require grad from the last to the "
                f"first, start a new bucket when the next one would take it over bucket_size "
                f"elements (a larger parameter gets a bucket of its own), default 2**20")
            numbers = sorted(number for _, number, _ in calls["started"])
            assert sorted(calls["waited"]) == numbers, (
                f"rank {rank}, step {step}: wait() waited on all-reduces {calls['waited']}, "
                f"expected this step's {numbers}, each once: clear what is pending at the end "
                f"of wait(), ready for the next step")
        assert not result["after_remove"], (
            f"rank {rank}: after remove(), backward still started all-reduces "
            f"{result['after_remove']}: remove every hook's handle")


# ----------------------------------------------------------------------------- the script

# The script is lesson 00's train.py plus DDP. Its runs are compared through what they write:
# the --result JSON (rank 0's) and the --checkpoint file, a plain GPT state_dict.

# One epoch over the first 320 windows (of 1010): 20 steps of a global batch of 16, about 0.5 s
# of training per run; the rest of each launch is starting processes and importing torch.
TRAIN_ONE_EPOCH = ("--epochs", "1", "--train-windows", "320")
# Two runs that take the same steps agree to fp32 rounding, which AdamW then amplifies where a
# gradient is rounding noise: the key projections' biases get none at all in exact arithmetic
# (a bias added to every key shifts a query's scores equally, and softmax ignores that: they
# change no output), yet AdamW steps on the noise. Measured between 2 ranks x 8 and 1 process
# x 16 after one epoch: up to 9e-5 on those biases, 3e-5 elsewhere. One process reading the
# same windows in another order ends up to 0.1 and more away.
SAME_STEPS = {"rtol": 1e-3, "atol": 2e-4}
# CUDA kernels add in another order than the CPU's: the losses then agree to 1e-4, not 1e-6.
CUDA_VS_CPU = {"rtol": 1e-4, "atol": 1e-5}


def trained(checkpoint) -> dict[str, torch.Tensor]:
    """A checkpoint written by the script: a plain state_dict, loaded without unpickling code."""
    return torch.load(checkpoint, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """The training script under every launcher, all started at once (most of each launch is
    importing torch, which overlaps well), each with a global batch of 16 and its own
    checkpoint folder. Yields (launches, checkpoint paths), both keyed by launcher.

    The one-process run is the reference, on the CPU (gloo) on every machine: left to choose,
    it would take a GPU wherever there is one, while 2 ranks with fewer than 2 GPUs take the
    CPU. The 2-rank runs choose for themselves, as a learner's would."""
    folder = tmp_path_factory.mktemp("checkpoints")
    checkpoints = {name: folder / name / "model.pt"
                   for name in ("python", "torchrun", "launch", "spawn")}

    def save_to(name):
        return ("--checkpoint", str(checkpoints[name]))

    runs = {
        "python": start_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "16", "--backend",
                               "gloo", *save_to("python")),
        "torchrun": start_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "8",
                                 *save_to("torchrun"), launcher="torchrun", nproc=2),
        # python -m torch.distributed.launch, which passes --local-rank=N
        "launch": start_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "8",
                               *save_to("launch"), launcher="launch", nproc=2),
        "spawn": start_script(f"lessons/{LESSON}/train_spawn.py", "--nprocs", "2",
                              *TRAIN_ONE_EPOCH, "--batch-size", "8", *save_to("spawn")),
    }
    yield runs, checkpoints
    for run in runs.values():
        run.stop()


def assert_same_training(run, single, what: str) -> None:
    """``run`` took the steps of the one-process run ``single``: the same loss per epoch, on
    the training windows (as reported) and on the validation windows (of the trained model)."""
    __tracebackhide__ = True
    tolerances = CUDA_VS_CPU if run.data["device"] != single.data["device"] else {}
    try:
        assert_close(torch.tensor(run.data["val_loss"]), torch.tensor(single.data["val_loss"]),
                     f"{what}: val_loss per epoch", **tolerances)
    except AssertionError as error:
        raise with_diagnosis(
            error, "the trained models differ, so the ranks did not take the one process's "
            "steps: each rank must read its own share of every global batch (a "
            "DistributedSampler, seeded alike on every rank) and train through the DDP "
            "wrapper") from None
    try:
        assert_close(torch.tensor(run.data["train_loss"]),
                     torch.tensor(single.data["train_loss"]), f"{what}: train_loss per epoch",
                     **tolerances)
    except AssertionError as error:
        raise with_diagnosis(
            error, "the models agree but the reported training loss does not: it must be the "
            "mean over every rank's windows (all-reduce the loss sum and the sample count), "
            "not rank 0's own") from None


@pytest.mark.slow
def test_script_under_torchrun_equals_single_process(script_runs):
    runs, checkpoints = script_runs
    run, single = runs["torchrun"].result(), runs["python"].result()
    assert (single.data["world_size"], single.data["batch_size"], single.data["device"]) == (
        1, 16, "cpu"), single.data
    assert (run.data["world_size"], run.data["batch_size"]) == (2, 8), (
        "expected 2 ranks with 8 samples each (--batch-size is per process), got "
        f"world_size {run.data['world_size']}, batch_size {run.data['batch_size']}")
    assert run.data["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    # The sharp check: the epoch's mean loss over all 1010 windows, to fp32 rounding (on the
    # CPU; 2 ranks on 2 GPUs are compared with the CPU run to CUDA_VS_CPU).
    assert_same_training(run, single, "2 ranks x 8 vs 1 process x 16")
    assert_parameters_close(trained(checkpoints["torchrun"]), trained(checkpoints["python"]),
                            what="trained parameter, 2 ranks x 8 vs 1 process x 16",
                            **SAME_STEPS)


@pytest.mark.slow
def test_script_under_torchrun_prints_and_saves_on_rank_0_only(script_runs):
    runs, checkpoints = script_runs
    run = runs["torchrun"].result()
    assert any("epoch 1/1" in line for line in run.rank_lines(0)), run.output
    said = [line for line in run.rank_lines(1)
            if any(word in line for word in ("epoch", "sample", "checkpoint", "result"))]
    assert not said, f"rank 1 printed progress; only rank 0 should: {said}"
    saved = [line for line in run.output.splitlines() if "checkpoint saved" in line]
    assert len(saved) == 1 and saved[0].startswith("[default0]:"), (
        f"the checkpoint should be saved once, by rank 0: {saved}")
    # Exactly one file, complete (no .partial left), loadable into a plain GPT: no "module.".
    folder = checkpoints["torchrun"].parent
    assert sorted(p.name for p in folder.iterdir()) == ["model.pt"]
    vocab_size = CharDataset(SIZES["tiny"]["block_size"]).vocab_size
    model = GPT(GPTConfig.named("tiny", vocab_size=vocab_size))
    model.load_state_dict(trained(checkpoints["torchrun"]))  # strict: every name must match
    # The digest rank 0 reported is that of the weights in the file, to the bit.
    assert parameter_digest(model) == run.data["params_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch", "spawn"])
def test_older_launchers_train_the_same_model(script_runs, launcher):
    runs, checkpoints = script_runs
    run, single = runs[launcher].result(), runs["python"].result()
    assert (run.data["world_size"], run.data["batch_size"]) == (2, 8), run.data
    assert_same_training(run, single, f"{launcher}, 2 ranks x 8 vs 1 process x 16")
    assert_parameters_close(trained(checkpoints[launcher]), trained(checkpoints["python"]),
                            what=f"trained parameter under {launcher}", **SAME_STEPS)


@pytest.mark.slow
@needs_gpus(1, "nccl world 1 under torchrun")
def test_script_on_a_gpu_equals_the_cpu_run(script_runs, tmp_path):
    runs, checkpoints = script_runs
    single = runs["python"].result()
    checkpoint = tmp_path / "gpu.pt"
    run = run_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "16", "--checkpoint",
                     str(checkpoint), launcher="torchrun", nproc=1)
    assert run.data["backend"] == "nccl" and run.data["device"] == "cuda:0", run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(single.data[key]),
                     f"GPU vs CPU: {key} per epoch", **CUDA_VS_CPU)
    assert_parameters_close(trained(checkpoint), trained(checkpoints["python"]),
                            what="trained parameter, GPU vs CPU", **SAME_STEPS)


SHORT_TEXT = 2000  # characters: 56 training windows of 32, 28 per rank


def windows_read(ctx, epochs: int) -> list[int]:
    """Run the script's fit() on this pooled rank, on a short text; return the indices of the
    dataset's windows in the order this rank read them (training and validation)."""
    train = load_lesson_module(LESSON, "train_ddp")
    read: list[int] = []

    class Recorded(CharDataset):
        def __getitem__(self, i):
            read.append(int(i))
            return super().__getitem__(i)

    def recorded_windows(size: str, train_windows=None):  # gpt.run.windows, on the short text
        dataset = Recorded(SIZES[size]["block_size"], text=load_text()[:SHORT_TEXT])
        return (dataset, *train_val_split(dataset))

    real = train.run.windows  # gpt.run, the module the script calls it from
    train.run.windows = recorded_windows
    try:
        train.fit(ctx.device, epochs=epochs, batch_size=4, log=lambda *args, **kwargs: None)
    finally:
        train.run.windows = real
    return read


def per_epoch(read: list[int], n_train: int) -> list[list[int]]:
    """The training windows read in each epoch: the runs of indices below ``n_train``."""
    epochs, current = [], []
    for i in [*read, n_train]:  # validation windows (n_train and up) end an epoch
        if i < n_train:
            current.append(i)
        elif current:
            epochs.append(current)
            current = []
    return epochs


def test_script_reads_its_own_shard_in_a_new_order_every_epoch():
    """What the equality with one process cannot show: both runs share the script, so a script
    that forgets set_epoch repeats epoch 1's order in both. Read the order itself."""
    n_train = len(train_val_split(CharDataset(SIZES["tiny"]["block_size"],
                                              text=load_text()[:SHORT_TEXT]))[0])
    reads = run_on_ranks(windows_read, 2, world_size=2)
    epochs = [per_epoch(read, n_train) for read in reads]
    for rank, shards in enumerate(epochs):
        assert len(shards) == 2, f"rank {rank} read training windows in {len(shards)} epochs, not 2"
    for epoch in range(2):
        shards = [epochs[rank][epoch] for rank in range(2)]
        assert sorted(shards[0] + shards[1]) == list(range(n_train)), (
            f"epoch {epoch + 1}: the 2 ranks read {len(shards[0])} and {len(shards[1])} training "
            f"windows, not each its own half of the {n_train}: a DistributedSampler shards them")
    for rank in range(2):
        assert epochs[rank][0] != epochs[rank][1], (
            f"rank {rank} read the same windows in the same order in epochs 1 and 2: call "
            f"train_loader.sampler.set_epoch(epoch) before each epoch")


@pytest.fixture
def train_script(outside_launcher):
    """train_ddp.py, imported, to call its main() as plain python would run it."""
    return load_lesson_module(LESSON, "train_ddp")


def usage_error(train, argv: list[str], capsys) -> str:
    """Call the script's main(argv), which must refuse: return 2, say why in one line on
    stderr, and leave no process group behind. Returns that line."""
    __tracebackhide__ = True
    code = train.main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"main({argv}) returned {code!r}, not 2 (a usage error). stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(r"\S+\.py: error: ", lines[0]), (
        f"expected one line 'train.py: error: ...' on stderr, got {lines}")
    assert not dist.is_initialized(), (
        "main returned with a process group still initialised: check before joining one")
    return lines[0]


def test_script_explains_a_partial_launcher_environment(train_script, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = usage_error(train_script, [], capsys)
    assert all(name in message for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")), message
    assert "torchrun" in message, message


def test_script_explains_nccl_without_gpus(train_script, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = usage_error(train_script, ["--backend", "nccl"], capsys)
    assert "needs CUDA GPUs" in message and "0 GPU(s)" in message, message


def test_script_explains_more_ranks_than_gpus(train_script, monkeypatch, capsys):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never reached: fails before
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    message = usage_error(train_script, ["--backend", "nccl"], capsys)
    assert "4 processes on this machine, 2 GPU(s) visible" in message, message


def test_the_script_and_the_exercise_name_the_same_launcher_variables(ex):
    """One meaning of LAUNCHER_VARIABLES: what train_ddp.py checks (with gpt.run's setup) is what
    task3_2 checks."""
    assert load_lesson_module(LESSON, "train_ddp").run.LAUNCHER_VARIABLES == ex.LAUNCHER_VARIABLES
