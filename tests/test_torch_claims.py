"""What the lessons say about torch's defaults and behaviour, asked of torch itself.

One test per claim; each docstring names the sentence it guards. When a new torch changes one of
these, the test fails here instead of the text quietly becoming wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.metadata
import inspect
import io
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig
from torch import nn
from torch.distributed import constants, run
from torch.distributed.elastic.multiprocessing.tail_log import TailLog
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from harness.exercises import REPO_ROOT
from harness.launch import LAUNCHERS
from harness.memory import AllocationPeak
from harness.ranks import RankError, run_on_ranks
from lesson05.common import Tower, tower_step

# torch 2.13 renamed all_gather_into_tensor (the old name now warns); 2.11 and 2.12 have
# only the old one.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def torchrun_args(*flags: str):
    return run.get_args_parser().parse_args([*flags, "train.py"])


def test_distributed_sampler_pads_with_duplicates_by_default():
    """03 README, DistributedSampler: "`drop_last=False`, the default, is what pads" (and
    04 lab 3: 11 samples on 2 ranks become 12)."""
    assert inspect.signature(DistributedSampler).parameters["drop_last"].default is False
    shards = [list(DistributedSampler(range(10), num_replicas=3, rank=r, shuffle=False))
              for r in range(3)]
    seen = sorted(sum(shards, []))
    assert len(seen) == 12 and set(seen) == set(range(10)), f"no padding any more: {shards}"


def test_ddp_broadcasts_buffers_at_every_forward_by_default(monkeypatch):
    """03 README: "at the start of each forward, DDP broadcasts rank 0's buffers ... (but not
    after a forward under `no_grad` or `no_sync`)" (`broadcast_buffers=True`; torch 2.13 renames
    it `forward_sync_buffers`); 01 README's "the gradients travel, plus the buffers"."""
    parameters = inspect.signature(DDP).parameters
    assert parameters["broadcast_buffers"].default is True or "forward_sync_buffers" in parameters
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DDP(nn.BatchNorm1d(3))  # buffers: running mean and variance
        broadcasts = []
        original = dist._broadcast_coalesced
        monkeypatch.setattr(dist, "_broadcast_coalesced",
                            lambda *args: broadcasts.append(args) or original(*args))
        for _ in range(2):
            model(torch.randn(4, 3))
        assert len(broadcasts) == 2, f"{len(broadcasts)} buffer broadcasts in 2 forwards"
        for quiet in (torch.no_grad, model.no_sync):
            with quiet():
                model(torch.randn(4, 3))  # broadcasts: the forward before it trained
            model(torch.randn(4, 3))  # does not: the forward before it did not
        assert len(broadcasts) == 4, f"{len(broadcasts) - 2} broadcasts in 4 more forwards"
        del model
        gc.collect()  # a DDP left in reference cycles holds the group
    finally:
        dist.destroy_process_group()


def test_torchrun_restarts_nothing_by_default():
    """03 README and train_spawn.py: "`--max-restarts=N` (default 0)"."""
    assert torchrun_args().max_restarts == 0
    assert torchrun_args("--max-restarts=3").max_restarts == 3


def test_torchrun_tee_prefixes_lines_with_role_and_local_rank(tmp_path):
    """04 README, lab 15: "`torchrun --tee 3` prefixes every line with the role and the *local*
    rank, `[default0]:`"; the global rank needs `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE` (or, from
    torch 2.14, `--log-line-prefix-template`);
    `--local-ranks-filter 0` exists."""
    args = torchrun_args("--tee", "3", "--local-ranks-filter", "0")
    assert (args.tee, args.local_ranks_filter, args.role) == ("3", "0", "default")
    log = tmp_path / "stdout.log"
    log.write_text("hello\n")
    out = io.StringIO()
    TailLog(args.role, {1: str(log)}, out).start().stop()  # what --tee does for local rank 1
    assert out.getvalue() == "[default1]:hello\n"
    assert "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE" in inspect.getsource(run)
    # "torch 2.14 and newer also take it as `--log-line-prefix-template`"
    has_flag = "--log-line-prefix-template" in run.get_args_parser().format_help()
    assert has_flag == (torch.torch_version.TorchVersion(torch.__version__) >= "2.14"), has_flag


def test_nproc_per_node_gpu_counts_the_gpus_this_process_sees():
    """03 README and setup: "`--nproc-per-node=gpu` starts one process per GPU this process can
    see (`torch.cuda.device_count()`)"."""
    assert torchrun_args("--nproc-per-node=gpu").nproc_per_node == "gpu"
    if torch.cuda.is_available():
        assert run.determine_local_world_size("gpu") == torch.cuda.device_count()
    else:
        with pytest.raises(ValueError, match="Cuda is not available"):
            run.determine_local_world_size("gpu")


def older_than_2_14() -> bool:
    """Where torch changed between 2.11 and 2.14 the tests detect which behaviour they meet and
    allow the old one only here; releases in between may have either."""
    return torch.torch_version.TorchVersion(torch.__version__) < "2.14"


def test_default_process_group_timeouts():
    """04 README, lab 5: "by default 30 minutes with gloo, 10 with NCCL when the backend is
    `"nccl"`, named or taken from a CUDA `device_id`"; its watchdog: "by default 10 minutes when
    the backend is `"nccl"`, 30 with gloo or a combined `"cpu:gloo,cuda:nccl"`"."""
    from torch.distributed.distributed_c10d import _get_default_timeout

    assert constants.default_pg_timeout == timedelta(minutes=30)
    # None on builds without NCCL (the CPU wheels): there the NCCL default is not compiled in.
    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if nccl is not None:
        assert nccl == timedelta(minutes=10)
        assert _get_default_timeout("nccl") == nccl
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):  # a backend string that only contains nccl
        assert _get_default_timeout(backend) == timedelta(minutes=30), backend


def group_timeouts_on_rank(ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    def timeout(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=45)
    overridden = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"),
                                  backend_override={"dp": options, "ep": options})
    rows, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]], timeout=timedelta(seconds=60))
    return {"default": timeout(dist.group.WORLD), "mesh": [timeout(mesh.get_group(name))
                                                           for name in ("dp", "ep")],
            "overridden": [timeout(overridden.get_group(name)) for name in ("dp", "ep")],
            "enumerated": timeout(rows)}


def test_a_device_mesh_subgroup_on_gloo_waits_30_minutes_whatever_the_default_group():
    """11 README: "`init_device_mesh` would make the same groups, but on gloo its subgroups wait 30
    minutes unless its `backend_override` hands each dimension options carrying a timeout
    (`ProcessGroupGloo._Options`, whose `_timeout` is private)" (so run.mesh_groups, under
    moe.py's expert_groups and run.device_mesh, makes them with
    dist.new_subgroups_by_enumeration and the course's timeout)."""
    found = run_on_ranks(group_timeouts_on_rank, world_size=4, pg_timeout=60)[0]
    assert found["default"] == timedelta(seconds=60), found
    assert found["mesh"] == [timedelta(minutes=30)] * 2, found
    assert found["overridden"] == [timedelta(seconds=45)] * 2, found
    assert found["enumerated"] == timedelta(seconds=60), found


def test_dataparallel_checks_the_device_at_forward_not_when_wrapping():
    """01 README, the forum question: "it checks this at every forward, not when it wraps the
    model (with a single device id, wrapping moves the model there itself) ...
    `nn.DataParallel(model).to('cuda')` works"; and "One device id ... Wrapping moves the
    module to that device itself" (read from torch's source: no CPU has a device id)."""
    nn.DataParallel(nn.Linear(2, 2)).to("cpu")  # constructing and moving never checks
    check = "module must have its parameters and buffers"
    forward = inspect.getsource(nn.DataParallel.forward)
    init = inspect.getsource(nn.DataParallel.__init__)
    assert check in forward and check not in init
    assert forward.index(check) < forward.index("self.scatter(")  # every call, before the rest
    assert re.search(r"if len\(self\.device_ids\) == 1:\s*self\.module\.to\(", init), (
        "DataParallel no longer moves the module when given one device id")
    if torch.cuda.is_available():
        wrapped = nn.DataParallel(nn.Linear(2, 2)).to("cuda")
        assert wrapped(torch.randn(4, 2, device="cuda")).shape == (4, 2)


@pytest.mark.slow
def test_torchrun_sets_one_omp_thread_per_rank_and_warns_about_it():
    """03 README, Run it: with more than one process per node and OMP_NUM_THREADS unset,
    torchrun warns "Setting OMP_NUM_THREADS environment variable for each process to be 1"
    and sets it to 1 for every rank."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [*LAUNCHERS["torchrun"], "--nproc-per-node=2",
               str(REPO_ROOT / "tests" / "probes" / "launch_probe.py")]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "Setting OMP_NUM_THREADS environment variable for each process to be 1" in output
    assert output.count("OMP_NUM_THREADS=1") == 2, output


def test_adamw_keeps_two_moments_and_a_step_count_per_parameter():
    """05 README and walkthrough: "AdamW's state: `exp_avg` and `exp_avg_sq`", 8 bytes per fp32
    parameter (plus a step count)."""
    layer = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state[layer.weight]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, set(state)
    for name in ("exp_avg", "exp_avg_sq"):
        assert state[name].shape == layer.weight.shape and state[name].dtype == torch.float32
    assert state["step"].numel() == 1


def test_fully_shard_leaves_resharding_to_fsdp_and_mixed_precision_off_by_default():
    """05 README: "Left unset, FSDP2 chooses `True` for every module except the root" (the
    default is None; lesson 05's tests check what None does), and `MixedPrecisionPolicy()` changes
    no dtype: mp_policy=None in `shard_model` means no mixed precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    assert inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
    policy = MixedPrecisionPolicy()
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (None, None, None)


def fully_shard_offloaded(ctx, pin_memory: bool) -> str:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    layer = nn.Linear(4, 4)
    try:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
    except RuntimeError:
        return "fails"
    layer(torch.ones(2, 4)).sum().backward()
    return layer.weight.grad.to_local().device.type


@pytest.mark.skipif(torch.cuda.is_available(), reason="the claim is about a machine without a GPU")
def test_cpu_offload_pins_by_default_which_needs_a_gpu():
    """05 README, CPU offload: the shards are "pinned by default (`pin_memory=True`)"; torch's
    own description: parameters copied host-to-device before the all-gather, gradients
    device-to-host in backward, the optimizer step on the CPU; "without [a GPU],
    `CPUOffloadPolicy()` fails inside `fully_shard`, and `CPUOffloadPolicy(pin_memory=False)`
    runs"."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert CPUOffloadPolicy().pin_memory is True
    described = " ".join(CPUOffloadPolicy.__doc__.split())
    for words in ("Sharded parameters are copied host-to-device before all-gather",
                  "Sharded gradients are copied device-to-host in backward",
                  "the optimizer step runs on CPU with CPU optimizer states"):
        assert words in described, words
    results = [run_on_ranks(fully_shard_offloaded, pin, world_size=2) for pin in (True, False)]
    assert results == [["fails", "fails"], ["cpu", "cpu"]], results


def fully_shard_an_embedding_of_61_rows(ctx) -> tuple:
    from torch.distributed.fsdp import fully_shard

    embedding = nn.Embedding(61, 8)
    fully_shard(embedding)
    local = embedding.weight.to_local()
    return local.shape[0], local.untyped_storage().nbytes()


def test_fsdp2_pads_every_ranks_shard_to_the_largest():
    """05 README, the script's report: "the 61 rows ... split 31/30. The memory FSDP2 allocates
    for a parameter is the same on every rank: it pads each shard to the largest"."""
    (rows0, bytes0), (rows1, bytes1) = run_on_ranks(fully_shard_an_embedding_of_61_rows,
                                                    world_size=2)
    assert (rows0, rows1) == (31, 30)
    assert bytes0 == bytes1 == 31 * 8 * 4


def test_dtensor_random_ops_are_coordinated_on_cuda_like_devices_only():
    """06 README, dropout: DTensor's `OffsetBasedRNGTracker` "moves each shard's generator to
    its offset in a common stream", and "its docstring says the random APIs support
    "cuda/cuda-like devices" only"."""
    from torch.distributed.tensor import _random

    assert hasattr(_random, "OffsetBasedRNGTracker")
    assert hasattr(_random.OffsetBasedRNGTracker, "_set_pre_op_offset")
    doc = " ".join(inspect.getdoc(_random.is_rng_supported_mesh).split())
    assert "cuda/cuda-like devices" in doc


def test_the_collectives_renamed_in_torch_2_13_and_the_old_names_warn():
    """05 README: "torch 2.13 renamed `all_gather_into_tensor` and `reduce_scatter_tensor` to
    `all_gather_single` and `reduce_scatter_single` and made the old names warn. torch 2.11 and
    2.12 have only the old ones"."""
    renamed = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
    assert hasattr(dist, "all_gather_single") == renamed
    assert hasattr(dist, "reduce_scatter_single") == renamed
    if not renamed:
        return
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.warns(FutureWarning, match="all_gather_single"):
            dist.all_gather_into_tensor(torch.empty(2), torch.ones(2))
        with pytest.warns(FutureWarning, match="reduce_scatter_single"):
            dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2))
    finally:
        dist.destroy_process_group()


def test_ddp_buckets_are_another_copy_of_the_gradients_unless_the_gradients_are_views():
    """05 README: "DDP also all-reduces through buckets of its own, another copy of the
    gradients, unless you pass `gradient_as_bucket_view=True`, which makes the gradients views
    into the buckets; its documentation says so"."""
    parameter = inspect.signature(DDP).parameters["gradient_as_bucket_view"]
    assert parameter.default is False
    documented = " ".join(inspect.getdoc(DDP).split())
    assert ("gradients will be views pointing to different offsets of ``allreduce`` "
            "communication buckets") in documented, "DDP's documentation changed its words"
    assert "saved memory size will be equal to the total gradients size" in documented
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        storages = {}
        for as_view in (False, True):
            model = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
                        gradient_as_bucket_view=as_view)
            for _ in range(2):  # "gradients will be views after first iteration"
                model(torch.randn(3, 4)).sum().backward()
            storages[as_view] = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
            del model
            gc.collect()  # a DDP left in reference cycles holds the group
        assert len(storages[False]) == 4, "one gradient tensor per parameter"
        assert len(storages[True]) < 4, "the gradients share the buckets' memory"
    finally:
        dist.destroy_process_group()



def ddp_buckets_before_and_after_a_step(ctx, **options) -> dict:
    model = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]), **options)
    sizes = lambda: [b.buffer().numel() * 4 for b in model.reducer._get_zeros_like_grad_buckets()]
    before = sizes()
    for _ in range(3):  # rebuilt before the second step's forward (static_graph: the third)
        model(torch.randn(2, 512)).sum().backward()
    return {"before": before, "after": sizes()}


def by_size(limits: list[int], last_first: bool = True) -> list[int]:
    """The bytes of each bucket of the 8 layers' parameters cut at ``limits``: taken last
    first (the order their gradients arrive), or in their own order, the buckets then listed
    last first (as DDP hands its first assignment to the reducer)."""
    params = list(nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).parameters())
    order = params[::-1] if last_first else params
    buckets = [sum(order[i].numel() * 4 for i in b)
               for b in dist._compute_bucket_assignment_by_size(order, limits)[0]]
    return buckets if last_first else buckets[::-1]


MIB = 1024 * 1024
WHOLE = 8 * (512 * 512 + 512) * 4  # 8.0 MiB of gradients


@pytest.mark.parametrize("options,before,after", [
    ({}, [WHOLE], by_size([MIB, 25 * MIB])),
    ({"bucket_cap_mb": 25}, [WHOLE], by_size([25 * MIB])),
    ({"bucket_cap_mb": 1000}, [WHOLE], [WHOLE]),
    ({"static_graph": True}, [WHOLE], by_size([MIB, 25 * MIB])),
    ({"find_unused_parameters": True}, by_size([MIB, 25 * MIB], last_first=False),
     by_size([MIB, 25 * MIB], last_first=False)),
], ids=["unset", "25-given", "1000", "static", "find-unused"])
def test_ddp_buckets_first_one_then_by_size_with_a_small_first_only_by_default(
        options, before, after):
    """08 README: "By default (and with `static_graph=True`) it puts every gradient in one
    bucket for the first step ... and then rebuilds its buckets in the order the gradients
    arrived", "With `find_unused_parameters=True` it cuts its buckets by size once, at
    construction, from the parameters in their own order, and never rebuilds them", and "the
    first bucket's limit is 1 MiB (`dist._DEFAULT_FIRST_BUCKET_BYTES`) and every later one's
    25 MiB, when `bucket_cap_mb` is left unset. Given a cap, even 25, every bucket's limit is
    that cap"."""
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == MIB
    cap = inspect.signature(DDP).parameters["bucket_cap_mb"].default
    from torch.nn.parallel import distributed

    default = cap or getattr(distributed, "_DEFAULT_BUCKET_CAP_MB", None)
    if default is None:  # torch 2.11 writes the 25 inside DistributedDataParallel.__init__
        assert "bucket_cap_mb = 25" in inspect.getsource(DDP.__init__)
    else:
        assert default == 25
    got = run_on_ranks(ddp_buckets_before_and_after_a_step, world_size=2, **options)[0]
    assert got == {"before": before, "after": after}, got
    assert len(by_size([MIB, 25 * MIB])) == 2 and len(by_size([25 * MIB])) == 1


def ddp_bucket_launch_order(ctx) -> list[int]:
    """Two layers used in reverse: the first-defined layer's gradient is ready first, but sits
    in the last bucket (buckets follow the parameters reversed until DDP rebuilds them, and
    find_unused_parameters keeps that). The order the comm hook sees the buckets in."""
    first, second = nn.Linear(256, 256), nn.Linear(256, 256)

    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = first, second

        def forward(self, x):
            return self.first(self.second(x))

    model = DDP(Reversed(), bucket_cap_mb=0.1, find_unused_parameters=True)
    seen = []

    def hook(state, bucket):
        seen.append(bucket.index())
        return default_allreduce(bucket)

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def default_allreduce(bucket):
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, hook)
    model(torch.randn(2, 256)).sum().backward()
    return seen


def test_ddp_launches_its_buckets_strictly_in_order():
    """08 README: "Buckets are launched strictly in order: a bucket whose gradients are all
    ready waits for the buckets before it"."""
    seen = run_on_ranks(ddp_bucket_launch_order, world_size=2)[0]
    assert seen == sorted(seen) and len(seen) >= 2, seen


def ddp_bucket_sizes_in_launch_order(ctx, **options) -> list[int]:
    """The bytes of each bucket, in the order DDP hands them to the comm hook, at the third
    step (after any rebuild)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]), **options)
    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel() * 4)
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, hook)
    for _ in range(3):
        seen.clear()
        model(torch.randn(2, 512)).sum().backward()
    return seen


@pytest.mark.parametrize("options,small_one", [({}, "first"),
                                               ({"find_unused_parameters": True}, "last")],
                         ids=["default", "find-unused"])
def test_ddp_all_reduces_its_small_first_bucket_first_by_default_and_last_with_find_unused(
        options, small_one):
    """08 README: "Rebuilt, that bucket [the 1 MiB one] holds the gradients that come first,
    which start moving sooner; with `find_unused_parameters=True`, the model's first parameters,
    whose gradients come last: it is all-reduced last" (2 ranks, gloo; launch order)."""
    sizes = run_on_ranks(ddp_bucket_sizes_in_launch_order, world_size=2, **options)[0]
    assert len(sizes) == 2 and min(sizes) <= MIB + 4096, sizes
    assert sizes.index(min(sizes)) == (0 if small_one == "first" else len(sizes) - 1), sizes


def ddp_gradient_copies(ctx, as_view: bool, set_to_none: bool) -> int:
    """How many times the third step's backward writes a tensor into another tensor's memory
    (``copy_`` or an ``out=`` op; autograd's accumulation and in-place scaling excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            target = (kwargs.get("out") if "out" in kwargs
                      else args[0] if func.__name__.startswith("copy_") else None)
            if isinstance(target, torch.Tensor):
                sources = [a for a in args if isinstance(a, torch.Tensor) and a is not target]
                if all(s.untyped_storage().data_ptr() != target.untyped_storage().data_ptr()
                       for s in sources):
                    Copies.count += 1
            return func(*args, **kwargs)

    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)),
                gradient_as_bucket_view=as_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):  # "gradients will be views after first iteration"
        optimizer.zero_grad(set_to_none=set_to_none)
        x = torch.randn(4, 64)
        if step < 2:
            model(x).sum().backward()
        else:
            with Copies():
                model(x).sum().backward()
        optimizer.step()
    return Copies.count


@pytest.mark.parametrize("as_view,set_to_none,copies", [
    (False, False, 2), (False, True, 2), (True, False, 0), (True, True, 1)],
    ids=["copies", "copies-set-to-none", "views", "views-set-to-none"])
def test_gradient_as_bucket_view_removes_both_copies_only_when_gradients_are_zeroed(
        as_view, set_to_none, copies):
    """08 README, `gradient_as_bucket_view=True`: "With `zero_grad(set_to_none=False)`, as here,
    that removes the two copies; set to None (the default, and `train_amp.py`'s), each step's
    new gradients are still copied into the buckets, and only the copy back goes" (2 ranks,
    gloo, as ddp_costs.py runs; torch 2.14's docstring of `batched_grad_copy` says the same)."""
    parameters = 4  # two weights, two biases
    got = run_on_ranks(ddp_gradient_copies, world_size=2, as_view=as_view,
                       set_to_none=set_to_none)[0]
    assert got == copies * parameters, (got, copies * parameters)
    assert inspect.signature(torch.optim.Optimizer.zero_grad).parameters[
        "set_to_none"].default is True


# ----------------------------------------------------------------------------- lesson 06, DTensor

TP_BLOCK = dict(vocab_size=29, block_size=8, n_layer=1, n_head=4, n_embd=16, bias=True)


def tp_plan(prepare_attention_input: bool, sequence_parallel: bool = False) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan = {f"attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    plan |= {"attn.out_proj": RowwiseParallel(output_layouts=stream),
             "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(
                 output_layouts=stream)}
    if prepare_attention_input:
        plan["attn"] = PrepareModuleInput(input_layouts=(stream,),
                                          desired_input_layouts=(Replicate(),),
                                          use_local_output=False)
    if sequence_parallel:
        plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                 "mlp": PrepareModuleInput(input_layouts=(stream,),
                                           desired_input_layouts=(Replicate(),))}
    return plan


def tp_block_run(ctx, prepare_attention_input: bool, sequence_parallel: bool):
    """One gpt.Block parallelized with tp_plan on every rank: its placements, its output and
    input gradient against the unsplit block's, and CommDebugMode's counts of each collective."""
    from gpt import Block, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    whole = Block(GPTConfig(**TP_BLOCK))
    block = parallelize_module(copy.deepcopy(whole), init_device_mesh("cpu", (ctx.world_size,)),
                               tp_plan(prepare_attention_input, sequence_parallel))
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    mine = x.chunk(ctx.world_size, 1)[ctx.rank] if sequence_parallel else x
    mine = mine.clone().requires_grad_(True)
    with CommDebugMode() as forward:
        y = block(mine)
    with CommDebugMode() as backward:
        y.sum().backward()
    reference = x.clone().requires_grad_(True)
    y_whole = whole(reference)
    y_whole.sum().backward()
    expected_y, expected_grad = y_whole, reference.grad
    if sequence_parallel:
        expected_y = y_whole.chunk(ctx.world_size, 1)[ctx.rank]
        expected_grad = reference.grad.chunk(ctx.world_size, 1)[ctx.rank]
    ln_grad = block.ln_1.weight.grad

    def counts(mode):
        return {str(op).rpartition(".")[2]: n for op, n in mode.get_comm_counts().items()}

    return {"placements": {name: tuple(map(repr, p.placements)) for name, p in
                           block.named_parameters() if isinstance(p, DTensor)},
            "output_is_plain": type(y) is torch.Tensor,
            "y_error": float((y - expected_y).abs().max()),
            "grad_error": float((mine.grad - expected_grad).abs().max()),
            "ln_grad": tuple(map(repr, ln_grad.placements)) if isinstance(ln_grad, DTensor)
            else None,
            "forward": counts(forward), "backward": counts(backward)}


def test_colwise_and_rowwise_split_as_lesson_06_says():
    """06 README: ColwiseParallel shards weight and bias `Shard(0)`, RowwiseParallel the weight
    `Shard(1)` and keeps the bias `Replicate()`; their default input and output layouts;
    outputs are plain tensors (`use_local_output`
    defaults to True); one all-reduce per RowwiseParallel forward; in backward each
    ColwiseParallel all-reduces its own input gradient, three for q, k and v, unless
    PrepareModuleInput makes the attention's input a replicated DTensor once."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    for style in (ColwiseParallel, RowwiseParallel):
        assert inspect.signature(style).parameters["use_local_output"].default is True
    # "use_local_output=False is PrepareModuleInput's default, unlike the two styles'"
    assert inspect.signature(PrepareModuleInput).parameters["use_local_output"].default is False
    # "ColwiseParallel takes its input whole and gives each rank a slice of the last dimension;
    # RowwiseParallel takes that slice and gives back the whole"
    column, row = ColwiseParallel(), RowwiseParallel()
    assert (column.input_layouts, column.output_layouts) == ((Replicate(),), (Shard(-1),))
    assert (row.input_layouts, row.output_layouts) == ((Shard(-1),), (Replicate(),))
    plain, prepared = (run_on_ranks(tp_block_run, prepare, False, world_size=2)[0]
                       for prepare in (False, True))
    for result in (plain, prepared):
        assert result["y_error"] < 1e-5 and result["grad_error"] < 1e-5, result
        assert result["output_is_plain"], result
        placements = result["placements"]
        assert placements["attn.q_proj.weight"] == placements["attn.q_proj.bias"] == (
            "Shard(dim=0)",), placements
        assert placements["attn.out_proj.weight"] == ("Shard(dim=1)",), placements
        assert placements["attn.out_proj.bias"] == ("Replicate()",), placements
        assert result["forward"] == {"all_reduce": 2}, result["forward"]
    assert plain["backward"] == {"all_reduce": 4}, plain["backward"]  # 3 + 1
    assert prepared["backward"] == {"all_reduce": 2}, prepared["backward"]  # 1 + 1


def weights_after_parallelize_on_rank(ctx):
    """Each rank builds the same three layers from its own seed, then parallelizes the first two:
    what each parameter holds afterwards, gathered whole, against rank 0's and its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(ctx.rank)  # seeded differently on purpose
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    with torch.no_grad():
        model[2].weight.uniform_()  # a LayerNorm starts at ones everywhere: make it differ
    built = {name: p.detach().clone() for name, p in model.named_parameters()}
    rank0 = [dict(built) if ctx.rank == 0 else None]
    dist.broadcast_object_list(rank0, src=0)
    parallelize_module(model, init_device_mesh("cpu", (ctx.world_size,)),
                       {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": SequenceParallel()})
    held = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters()}
    return {name: ("rank 0's" if torch.equal(held[name], rank0[0][name])
                   else "its own" if torch.equal(held[name], built[name]) else "other")
            for name in held}


def test_parallelize_module_takes_split_weights_from_rank_0_and_leaves_the_rest_as_built():
    """06 README: "ColwiseParallel and RowwiseParallel take the weights they split from rank 0;
    SequenceParallel's norms and every parameter outside the plan stay as each rank built them"
    (2 gloo ranks, each seeded with its rank; torch 2.14's styles call distribute_tensor with
    src_data_rank=0, SequenceParallel wraps with DTensor.from_local)."""
    got = run_on_ranks(weights_after_parallelize_on_rank, world_size=2)[1]
    split = ("0.weight", "0.bias", "1.weight", "1.bias")  # 1.bias: Replicate(), also rank 0's
    assert {name: got[name] for name in split} == dict.fromkeys(split, "rank 0's"), got
    assert got["2.weight"] == got["3.weight"] == got["3.bias"] == "its own", got


def test_sequence_parallel_replaces_each_all_reduce_by_a_reduce_scatter_and_an_all_gather():
    """06 README, sequence parallelism: with the residual stream split along the sequence
    (`Shard(1)`), every all-reduce of the block becomes a reduce-scatter (leaving the split
    layers) and an all-gather (entering them), forward and backward; the block still computes
    the unsplit block's output; a layer norm's weight gradient is a `Partial` DTensor, each
    rank's tokens' share, summed only when it is needed."""
    result = run_on_ranks(tp_block_run, True, True, world_size=2)[0]
    assert result["y_error"] < 1e-5 and result["grad_error"] < 1e-5, result
    gathers = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert result["forward"] == gathers and result["backward"] == gathers, result
    assert result["ln_grad"] == ("Partial(sum)",), result["ln_grad"]


def uneven_shards(ctx):
    from gpt import CausalSelfAttention, GPTConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    sizes = distribute_tensor(torch.arange(5.0), mesh, [Shard(0)]).to_local().shape[0]
    # 3 heads of 4 features on 2 ranks: 6 features each, a head and a half.
    attn = CausalSelfAttention(GPTConfig(vocab_size=5, n_head=3, n_embd=12))
    parallelize_module(attn, mesh, {"q_proj": ColwiseParallel()})
    return sizes, attn.q_proj.weight.to_local().shape[0]


def test_dtensor_shards_a_dimension_that_does_not_divide_without_complaint():
    """06 README and parallelize_gpt's contract: DTensor cuts a dimension that does not divide
    unevenly (5 rows on 2 ranks: 3 and 2), and parallelize_module splits 3 heads of
    4 features over 2 ranks as 6 features each without a word: the check is ours to make."""
    assert run_on_ranks(uneven_shards, world_size=2) == [(3, 6), (2, 6)]


# ---------------------------------------------------------------------------- lesson 07, pipelining


def a_sliced_batch_on_one_stage(ctx):
    """Four micro-batches of `tokens[:, :-1]`, a slice whose rows are one element longer than
    they are wide (strides (S + 1, 1)), through one stage that learned its input from the first."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    tokens = torch.randn(8, 7, generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    assert not inputs.is_contiguous()
    schedule = ScheduleGPipe(PipelineStage(nn.Linear(6, 6), 0, 1, torch.device("cpu")),
                             n_microbatches=4, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    try:
        schedule.step(inputs, target=targets)
    except Exception as error:  # noqa: BLE001 - the refusal is what the test reports
        return f"{type(error).__name__}: {error}"
    return "accepted"


def test_a_sliced_batch_is_refused_by_torch_2_11_and_accepted_since_2_13():
    """07 README, PyTorch's API: "In torch 2.11 every later input must then have the first one's
    shape and strides: a slice such as `tokens[:, :-1]` is refused (`PipeliningShapeError`;
    torch 2.13 and 2.14 accept it)" (one stage, ScheduleGPipe, 4 micro-batches)."""
    got = run_on_ranks(a_sliced_batch_on_one_stage, world_size=1)[0]
    if torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        assert got.startswith("PipeliningShapeError"), got
    else:
        assert got == "accepted", got


def uneven_micro_batches(ctx):
    """One stage, a batch of 10 cut into 4 micro-batches by torch's schedule, against the
    whole batch's gradient and against the plain mean of the 4 micro-batches' gradients."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 3, generator=generator), torch.randn(10, 1, generator=generator)
    layer = nn.Linear(3, 1)
    reference = copy.deepcopy(layer)
    pieces = []  # the micro-batch sizes the stage really saw
    layer.register_forward_pre_hook(lambda _, args: pieces.append(len(args[0])))
    schedule = ScheduleGPipe(PipelineStage(layer, 0, 1, torch.device("cpu")), n_microbatches=4,
                             loss_fn=loss_fn)
    losses = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            schedule.step(x, target=y, losses=losses)
        except Exception as error:  # torch 2.11: PipeliningShapeError
            return {"refused": f"{type(error).__name__}: {error}"}
    loss_fn(reference(x), y).backward()
    mean_of_means = sum(torch.autograd.grad(loss_fn(reference(a), b), reference.weight)[0]
                        for a, b in zip(x.tensor_split(4), y.tensor_split(4), strict=True)) / 4
    return {"pieces": pieces, "losses": len(losses), "grad": layer.weight.grad,
            "warnings": [str(w.message) for w in said if "microbatch" in str(w.message).lower()],
            "whole": reference.weight.grad, "mean_of_means": mean_of_means}


def fewer_micro_batches_than_stages(ctx):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(nn.Linear(2, 2), ctx.rank, ctx.world_size, torch.device("cpu"))
    try:
        Schedule1F1B(stage, n_microbatches=1, loss_fn=lambda out, target: out.sum())
    except ValueError as error:
        return str(error)
    return "accepted"


def test_torch_pipelining_averages_micro_batches_as_if_they_were_equal():
    """07 README: torch's schedules average the micro-batches' gradients (`scale_grads=True`,
    the default); Schedule1F1B refuses fewer micro-batches than stages; a batch of 10 in 4
    micro-batches is refused by torch 2.11 (a shape mismatch) and, in torch 2.14, on one stage,
    cut 3, 3, 2, 2 without a word, each piece weighing a quarter: not the batch's mean (two
    stages: the next test). torch also offers interleaved and zero-bubble schedules, and
    `pipeline` with `SplitPoint` to cut a model by tracing it."""
    from torch.distributed import pipelining

    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                 "ScheduleInterleavedZeroBubble", "PipelineStage", "pipeline", "SplitPoint"):
        assert hasattr(pipelining, name), name
    assert callable(getattr(pipelining.Schedule1F1B, "eval", None)), "schedule.eval()"
    for schedule in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B):
        assert inspect.signature(schedule).parameters["scale_grads"].default is True
    got = run_on_ranks(uneven_micro_batches, world_size=1)[0]
    refusals = run_on_ranks(fewer_micro_batches_than_stages, world_size=2)
    assert all("must be greater than or equal to the number of stages" in r for r in refusals), (
        refusals)
    if "refused" in got:  # torch 2.11 checks every micro-batch against the first one's shape
        assert older_than_2_14(), got
        assert "shape mismatch" in got["refused"], got
        return
    # The last four forwards are the step's; before them torch may run the first micro-batch
    # once more, to learn what the stage sends (its "dynamic mode", torch 2.14 does).
    assert got["pieces"][-4:] == [3, 3, 2, 2] and len(got["pieces"]) in (4, 5), got
    assert got["losses"] == 4, got
    assert not got["warnings"], got["warnings"]  # "without a word"
    assert torch.allclose(got["grad"], got["mean_of_means"], atol=1e-6), got
    assert not torch.allclose(got["grad"], got["whole"], atol=1e-4), got


UNEVEN_HANG = 3.0  # seconds: the process group's timeout for the pipeline that breaks


def uneven_micro_batches_on_two_stages(ctx, schedule_name: str, detail: bool) -> dict:
    """Two stages on two ranks (a Linear each), a batch of 10 in 4 micro-batches, one step of
    torch's schedule; what each rank raised, and the shapes each stage ran on. ``detail`` sets
    TORCH_DISTRIBUTED_DEBUG=DETAIL as importing torch.distributed reads it (the pool's group
    already exists, so DETAIL's wrapper around new groups plays no part: it checks
    collectives, and a pipeline only sends and receives)."""
    import traceback

    from torch.distributed import pipelining

    if detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 3, generator=generator), torch.randn(10, 1, generator=generator)
    layer = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))[ctx.rank]
    pieces = []  # the micro-batch shapes this stage really ran on
    layer.register_forward_pre_hook(lambda _, args: pieces.append(tuple(args[0].shape)))
    stage = pipelining.PipelineStage(layer, ctx.rank, 2, torch.device("cpu"))
    schedule = getattr(pipelining, schedule_name)(
        stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    start = time.monotonic()
    try:
        schedule.step(x) if ctx.rank == 0 else schedule.step(target=y, losses=[])
        error, frames = None, []
    except Exception as raised:
        error = f"{type(raised).__name__}: {raised}"
        frames = [frame.name for frame in traceback.extract_tb(raised.__traceback__)]
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        dist.set_debug_level_from_env()
    return {"error": error, "frames": frames, "pieces": pieces,
            "waited": time.monotonic() - start}


@pytest.mark.parametrize("schedule_name", ["ScheduleGPipe", "Schedule1F1B"])
def test_uneven_micro_batches_break_a_two_stage_pipeline(schedule_name):
    """07 README: on two stages (two gloo ranks), a batch of 10 in 4 micro-batches fails, with
    both schedules. torch 2.11 refuses it on the first stage (a shape mismatch). torch 2.14
    checks shapes only under TORCH_DISTRIBUTED_DEBUG=DETAIL, where the first stage raises
    PipeliningMetadataError at the third micro-batch; without it, stage 1's receive buffers
    keep micro-batch 0's shape, the 2-row pieces arrive as 3 rows, and the loss fails against
    the target's 2 rows. Either way the other rank waits until the group's timeout."""
    from harness.ranks import get_pool

    got = {}
    for detail in (False, True):
        try:
            got[detail] = run_on_ranks(uneven_micro_batches_on_two_stages, schedule_name, detail,
                                       pg_timeout=UNEVEN_HANG, timeout=30)
        finally:
            get_pool(2, pg_timeout=UNEVEN_HANG).close()  # its group is broken: start afresh
    for detail, (first, last) in got.items():
        assert first["error"] and last["error"], (detail, first, last)  # never a silent step
        if older_than_2_14() or detail:
            # The first stage checks its input against micro-batch 0's before the third forward
            assert "shape mismatch" in first["error"], (detail, first)
            assert first["error"].startswith(
                "PipeliningMetadataError" if not older_than_2_14() else "PipeliningShapeError"
            ), (detail, first)
            assert first["pieces"][-1] == (3, 3) and (2, 3) not in first["pieces"], first
            waiting = last
        else:
            # No check: stage 0 runs 3, 3, 2, 2 (after one more run of micro-batch 0, to learn
            # what it sends), stage 1 receives all four into 3-row buffers and its loss fails.
            assert first["pieces"][-4:] == [(3, 3), (3, 3), (2, 3), (2, 3)], first
            assert last["pieces"] == [(3, 4)] * 4, last
            assert "_compute_loss" in last["frames"], last
            assert "must match the size of tensor b (2)" in last["error"], last
            waiting = first
        assert "Timed out" in waiting["error"] and waiting["waited"] >= UNEVEN_HANG - 0.5, (
            detail, waiting)

def sends_then_receives_crossed(ctx):
    """Rank 1 sends micro-batch 0's tensor, then 1's; rank 0 posts its receive for 1 first."""
    if ctx.rank == 1:
        works = [dist.isend(torch.full((2,), float(m)), dst=0) for m in (0, 1)]
        for work in works:
            work.wait()
        return None
    for_1, for_0 = torch.empty(2), torch.empty(2)
    works = [dist.irecv(for_1, src=1), dist.irecv(for_0, src=1)]
    for work in works:
        work.wait()
    return {"for_1": for_1.tolist(), "for_0": for_0.tolist()}


def test_sends_and_receives_of_one_tag_pair_up_in_the_order_they_are_posted():
    """07 README: "between two ranks, sends and receives of one tag pair up in the order they
    are posted, whatever micro-batch they carry" (so crossed orders swap the data silently)."""
    got = run_on_ranks(sends_then_receives_crossed, world_size=2)[0]
    assert got == {"for_1": [0.0, 0.0], "for_0": [1.0, 1.0]}, got


def test_schedule_1f1b_posts_a_send_in_one_batch_with_the_neighbours_receive():
    """07 README, on NCCL: `batch_isend_irecv` treats its operations as one batch in which "the
    relative ordering of sends vs. receives ... will not cause deadlocks" (torch 2.14; 2.11's asked
    for the order to match the other end's), and `Schedule1F1B`'s
    last warm-up send "is left for fuse with first 1B", posted as `fwd_sends + bwd_recvs`."""
    from torch.distributed.pipelining import Schedule1F1B

    doc = " ".join(inspect.getdoc(dist.batch_isend_irecv).split())
    if "does not matter" in doc or not older_than_2_14():
        assert ("the relative ordering of sends vs. receives in the list does not matter and "
                "will not cause deadlocks") in doc
    else:  # "torch 2.11's still asked that the order in the list match the other end's"
        assert ("The order of the isend/irecv in the list matters and it needs to match with "
                "corresponding isend/irecv on the remote end") in doc
    source = " ".join(inspect.getsource(Schedule1F1B._step_microbatches).split())
    assert "The last forward send is left for fuse with first 1B" in source
    assert "fwd_sends + bwd_recvs" in source and "bwd_sends + fwd_recvs" in source


def torch_schedule_steps(ctx, kind: str, m: int, steps: int) -> dict:
    """One of torch's multi-stage schedules on the 4-block GPT, ``steps`` SGD steps:
    "interleaved" is ScheduleInterleaved1F1B with two chunks per rank, chunk c being block
    c * p + rank (rank 0 holds blocks 0 and 2 and the embeddings, rank 1 blocks 1 and 3 and the
    head); "zb" ScheduleInterleavedZeroBubble with one stage of two blocks per rank; "zbv"
    ScheduleZBVZeroBubble, whose V puts stages r and 2p - 1 - r on rank r (rank 0 holds block 0
    and block 3, the first and the last)."""
    from gpt import GPTStage
    from torch.distributed import pipelining

    from lesson07.common import batch, make_gpt, next_token_loss, train_stage

    p, r = ctx.world_size, ctx.rank
    model = make_gpt()
    indices = {"interleaved": [r, p + r], "zb": [r], "zbv": [r, 2 * p - 1 - r]}[kind]
    per = 4 // (p * len(indices))
    chunks = nn.ModuleList(GPTStage(model, k * per, (k + 1) * per) for k in indices)
    stages = [pipelining.PipelineStage(chunk, k, p * len(indices), ctx.device)
              for k, chunk in zip(indices, chunks, strict=True)]
    cls = {"interleaved": pipelining.ScheduleInterleaved1F1B,
           "zb": pipelining.ScheduleInterleavedZeroBubble,
           "zbv": pipelining.ScheduleZBVZeroBubble}[kind]
    schedule = cls(stages, n_microbatches=m, loss_fn=next_token_loss)
    first, last = 0, (0 if kind == "zbv" else p - 1)  # the ranks of the first and last stage

    def one_step(step: int) -> list[float]:
        inputs, targets = batch(step)
        losses: list = []
        kwargs = {"target": targets, "losses": losses} if r == last else {}
        schedule.step(*([inputs] if r == first else []), **kwargs)
        return [float(loss) for loss in losses]

    return train_stage(model, chunks, one_step, steps)


def test_interleaved_1f1b_is_the_simulators_order_and_trains_like_one_process():
    """07 README: torch's ScheduleInterleaved1F1B builds the order the lesson gives (the
    simulator's interleaved_order, task7_5), for every shape up to 6 ranks, 4 chunks and 16
    micro-batches, and refuses the same shapes; its bubble is (p - 1) / (v m + p - 1) for
    m >= p and, with v > 1, larger below (40 % for 4 ranks, 2 chunks, 3 micro-batches); with
    one chunk it is not 1F1B (its warm-up is 2 (p - 1 - r); rank 0 holds 7 micro-batches, not 4);
    for 4 ranks, 2 chunks, 8 micro-batches rank 0 holds 5.5 micro-batches' activations at the
    peak and the last 2.5, against 1F1B's 4 and 1; and on 2 gloo ranks of 2 chunks each its
    steps are the unsplit model's."""
    from harness.ranks import in_a_child
    from lesson07.common import STEPS, assert_trains_like_one_process, torch_orders
    from lesson07.simulator import interleaved_order, reference_schedule, simulate

    orders = in_a_child(torch_orders, "interleaved", 6, 4, 16, timeout=120)
    for (p, v, m), theirs in orders.items():
        if theirs is None:
            with pytest.raises(ValueError):
                interleaved_order(p, v, m)
            continue
        assert interleaved_order(p, v, m) == theirs, (p, v, m)
        bubble = simulate(theirs, m, posting=None).bubble_fraction()
        formula = (p - 1) / (v * m + p - 1)
        assert (bubble == pytest.approx(formula) if m >= p or v == 1
                else bubble > formula), (p, v, m)
    for p, m in ((2, 4), (4, 8)):
        one_f_one_b = [[(k, i, 0) for k, i in actions]
                       for actions in reference_schedule("1f1b", p, m)]
        assert orders[p, 1, m] != one_f_one_b, (p, m)
        assert sum(a[0] == "F" for a in orders[p, 1, m][0][:2 * (p - 1) + 1]) == 2 * (p - 1) + 1
    interleaved = simulate(orders[4, 2, 8], 8, posting=None)
    one_f_one_b = simulate(reference_schedule("1f1b", 4, 8), 8)
    assert [interleaved.peak_activations(r) for r in (0, 3)] == [5.5, 2.5]
    assert [one_f_one_b.peak_in_flight(r) for r in (0, 3)] == [4, 1]
    assert simulate(orders[4, 1, 8], 8, posting=None).peak_activations(0) == 7
    few = simulate(orders[4, 2, 3], 3, posting=None).bubble_fraction()
    assert round(few, 2) == 0.40, few  # the formula's 3 / 9 = 33 %
    results = run_on_ranks(torch_schedule_steps, "interleaved", 4, STEPS, world_size=2, timeout=90)
    assert_trains_like_one_process(results, "torch's ScheduleInterleaved1F1B, 2 ranks x 2 "
                                   "chunks, 4 micro-batches", 4)


def test_zero_bubble_is_the_lessons_order_and_trains_like_one_process():
    """07 README: torch's ScheduleInterleavedZeroBubble with one stage per rank builds the
    lesson's ZB-H1 order (the simulator's, task7_6) on every shape up to 6 ranks and 16
    micro-batches it accepts; in the simulator (F = B = W) it leaves each stage a third of
    1F1B's idle time, (p - 1) / (3 m + p - 1) of the step for m >= p, and holds p micro-batches'
    activations on every stage; with m < p more (5 idle units against 9 for 4 stages and 2
    micro-batches); torch splits the backward itself (stage_backward_input and
    stage_backward_weight) and has ScheduleDualPipeV, whose steps overlap one micro-batch's
    forward with another's backward; ScheduleInterleavedZeroBubble and, in torch 2.14,
    ScheduleZBVZeroBubble (two stages per rank, in a V) take the unsplit model's steps on 2 gloo
    ranks: splitting a backward in two changes when the weights' gradients are computed, not
    what they are. torch 2.11's ZBV fails there at its first step, whose warm-up messages
    include one from rank 1's stage 1 to its stage 2, a send to itself that gloo refuses."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import _backward

    from harness.ranks import in_a_child
    from lesson07.common import STEPS, assert_trains_like_one_process, torch_orders
    from lesson07.simulator import reference_schedule, simulate

    # the split is torch's: B and W are separate functions; DualPipeV's steps pair a forward
    # with another micro-batch's backward (its OVERLAP_F_B actions)
    assert callable(_backward.stage_backward_input) and callable(_backward.stage_backward_weight)
    assert "OVERLAP_F_B" in inspect.getsource(pipelining.ScheduleDualPipeV)
    orders = in_a_child(torch_orders, "zero-bubble", 6, 1, 16, timeout=120)
    for (p, _, m), theirs in orders.items():
        if theirs is None:  # m not a multiple of its rounds: the rule is checked elsewhere
            assert m % max(1, m // p), (p, m)
            continue
        rule = [[(k, i, 0) for k, i in actions]
                for actions in reference_schedule("zero-bubble", p, m)]
        assert theirs == rule, (p, m)
        zb = simulate(reference_schedule("zero-bubble", p, m), m, posting=None)
        one = simulate(reference_schedule("1f1b", p, m), m, posting=None)
        if m >= p:  # a third of 1F1B's idle time, and 1F1B's most activations on every stage
            assert zb.bubble_fraction() == pytest.approx((p - 1) / (3 * m + p - 1)), (p, m)
            idle = [zb.idle(s) / one.idle(s) for s in range(p) if p > 1]
            assert idle == pytest.approx([1 / 3] * len(idle)), (p, m, idle)
            assert [zb.peak_in_flight(s) for s in range(p)] == [p] * p, (p, m)
    results = run_on_ranks(torch_schedule_steps, "zb", 4, STEPS, world_size=2, timeout=90)
    assert_trains_like_one_process(results, "torch's zero-bubble schedule, 2 ranks", 4)
    zb = simulate(reference_schedule("zero-bubble", 4, 2), 2, posting=None)
    one = simulate(reference_schedule("1f1b", 4, 2), 2, posting=None)
    assert [zb.idle(s) for s in range(4)] == [5] * 4 and [one.idle(s) for s in range(4)] == [9] * 4
    # ZBV's V: rank r holds stages r and 2p - 1 - r, rank 0 the first and the last
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    v = generate_stage_to_rank_mapping(2, 4, style="v")
    assert v == {0: 0, 1: 1, 2: 1, 3: 0}, v
    if torch.__version__.startswith("2.11."):  # its first step sends from rank 1 to rank 1
        with pytest.raises(RankError, match="Pair is not connected"):
            run_on_ranks(torch_schedule_steps, "zbv", 4, STEPS, world_size=2, timeout=90)
    else:
        try:
            results = run_on_ranks(torch_schedule_steps, "zbv", 4, STEPS, world_size=2, timeout=90)
        except RankError as error:  # releases between 2.11 and 2.14 may have either behaviour
            assert older_than_2_14() and "Pair is not connected" in str(error), error
        else:
            assert_trains_like_one_process(results, "torch's ZBV schedule, 2 ranks", 4)


def test_a_pipelines_step_follows_its_slowest_stage():
    """07 README: with stage s taking T_s per micro-batch (backward a fixed multiple of the
    forward), GPipe's step is sum(T) + (m - 1) * max(T) and 1F1B's no longer, in the
    simulator, on generated stage times; one stage 20 % slower makes 4 stages of 64
    micro-batches 19 % slower."""
    import random

    from lesson07.simulator import reference_schedule, simulate

    draw = random.Random(0)
    for _ in range(200):
        p, m = draw.randint(1, 5), draw.randint(1, 12)
        times = [draw.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(p)]
        formula = sum(times) + (m - 1) * max(times)
        steps = {kind: simulate(reference_schedule(kind, p, m), m, forward_time=1 / 3,
                                backward_time=2 / 3, posting=None, stage_cost=times).makespan
                 for kind in ("gpipe", "1f1b")}
        assert steps["gpipe"] == pytest.approx(formula), (p, m, times, steps)
        assert steps["1f1b"] <= formula + 1e-9, (p, m, times, steps)
    even = simulate(reference_schedule("1f1b", 4, 64), 64, posting=None).makespan
    slow = simulate(reference_schedule("1f1b", 4, 64), 64, posting=None,
                    stage_cost=[1, 1, 1.2, 1]).makespan
    assert round(slow / even, 2) == 1.19, slow / even


def test_bf16_and_fp16_mantissas_and_ranges():
    r"""08 README: bf16 "stores 7 mantissa bits (8 significant bits with the implicit leading
    one: a relative rounding error of up to $2^{-8}$, 0.4 %)" with fp32's exponent range; fp16
    "stores 10 mantissa bits" and "its largest number is 65504, bf16's about
    $3.4 \times 10^{38}$"."""
    bf16, fp16, fp32 = (torch.finfo(t) for t in (torch.bfloat16, torch.float16, torch.float32))
    assert bf16.eps == 2.0**-7 and fp16.eps == 2.0**-10  # eps = 2^-(stored mantissa bits)
    assert bf16.max == pytest.approx(3.39e38, rel=1e-2) and fp16.max == 65504
    assert bf16.tiny == fp32.tiny  # the same exponent range as fp32
    one_and_a_bit = torch.tensor(1 + 2.0**-8 + 2.0**-12)  # just over half an ulp above 1
    assert float(one_and_a_bit.to(torch.bfloat16)) == 1 + 2.0**-7  # rounds up one ulp
    assert float(torch.tensor(1 + 2.0**-9).to(torch.bfloat16)) == 1.0  # error below 2^-8


def ddp_with_a_hook_that_returns_bf16(ctx) -> dict:
    def bf16_result(state, bucket):  # the all-reduced bf16 tensor itself, never copied back
        compressed = bucket.buffer().to(torch.bfloat16).div_(ctx.world_size)
        return dist.all_reduce(compressed, async_op=True).get_future().then(
            lambda done: done.value()[0])

    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 8))
    model.register_comm_hook(None, bf16_result)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
    model(x).sum().backward()
    mine = nn.Linear(8, 8)
    mine.load_state_dict(model.module.state_dict())
    mine(x).sum().backward()
    return {"grad": model.module.weight.grad, "mine": mine.weight.grad}


def test_ddp_copies_a_hooks_bf16_result_into_the_fp32_gradients():
    """08 README, task8_3: "DDP would accept the bf16 result itself (it copies the future's
    value into the gradients, casting)"; and torch's own hook copies into the buffer "to reduce
    the peak memory"."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ranks = run_on_ranks(ddp_with_a_hook_that_returns_bf16, world_size=2)
    mean = sum(r["mine"] for r in ranks) / 2
    for got in ranks:
        assert got["grad"].dtype == torch.float32
        torch.testing.assert_close(got["grad"], mean, rtol=1e-2, atol=1e-2)
    assert "Decompress in place to reduce the peak memory" in inspect.getsource(default_hooks)


def test_ddp_refuses_a_hook_named_like_torchs_bf16_hook_without_cuda_and_nccl():
    """08 README, hint for task 8_3: "a hook named `bf16_compress_hook`, the name of torch's own,
    is refused on torch builds without CUDA and NCCL" (and ddp_costs.py renames it for that)."""
    source = inspect.getsource(DDP._check_comm_hook)
    assert '"bf16_compress_hook"' in source and "nccl" in source.lower()


def test_the_fake_process_group_completes_collectives_without_any_other_rank():
    """08 README, the methods side by side: "torch's fake process group completes every
    collective at once, without any other rank (an all-reduce leaves its tensor as it is), so
    what remains is the computation"."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        tensor = torch.arange(4.0)
        # World size 2 and no second process: a collective that needed one would never end.
        dist.all_reduce(tensor, async_op=True).wait()
        assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
        gathered = torch.zeros(8)
        all_gather_single(gathered, tensor)  # returns too, with no other rank
        assert gathered.shape == (8,)
    finally:
        dist.destroy_process_group()


def test_the_fake_process_group_plays_any_rank_and_moves_nothing_between_ranks():
    """08 README, a dry run: one process is any rank of any world size, and its collectives
    "complete at once, without any other rank, and use this rank's tensors alone: an all-reduce
    leaves its tensor as it is, an all-gather fills its output with copies of this rank's
    input" (not as if every rank held these tensors: the all-reduce is not 128 times them). No
    text says what a reduce-scatter leaves: torch 2.11 leaves its output as it was, 2.14 puts
    this rank's piece of its own input there."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=128)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (3, 128)
        tensor = torch.tensor([5.0, 6.0])
        dist.all_reduce(tensor)
        assert tensor.tolist() == [5.0, 6.0]
        gathered = torch.zeros(256)
        all_gather_single(gathered, tensor)
        assert gathered.tolist() == [5.0, 6.0] * 128
    finally:
        dist.destroy_process_group()


def test_the_fake_process_group_needs_no_store():
    """08 README, a dry run: "torch makes the FakeStore itself when given none: 2.11 and 2.14
    both do" (`init_process_group` in distributed_c10d.py; run on both)."""
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    dist.init_process_group("fake", rank=5, world_size=128)  # no store, no init_method, no env
    try:
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (5, 128, "fake")
    finally:
        dist.destroy_process_group()


def collectives_as_dispatched(ctx) -> list[str]:
    """The c10d operators that the process-group API and DDP's reducer reach, on gloo."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith("c10d."):
                seen.append(str(func).split(".")[1])
            return func(*args, **(kwargs or {}))

    reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                             or dist.reduce_scatter_tensor)  # the 2.13 rename, as above
    model = DDP(nn.Linear(4, 4))
    with Ops():
        all_gather_single(torch.empty(4 * ctx.world_size), torch.ones(4))
        reduce_scatter_single(torch.empty(4), torch.ones(4 * ctx.world_size))
        dist.all_reduce(torch.ones(4))
        seen.append("| DDP:")
        model(torch.randn(2, 4)).sum().backward()  # the reducer's all-reduce, from C++
    return seen


def test_every_collective_reaches_the_dispatcher_as_a_c10d_operator():
    """08 README, a dry run: "Every collective of the process-group API (`dist.all_gather_single`,
    `all_gather_into_tensor` before torch 2.13, and the rest), whoever calls it (FSDP2 from
    Python, DDP's reducer from C++) and whichever backend runs it, reaches torch's dispatcher
    as a `c10d` operator (`c10d._allgather_base_`, `c10d._reduce_scatter_base_`,
    `c10d.allreduce_`, ...)" (gloo, 2 ranks; the fake group's are counted by dry_run's test)."""
    seen = run_on_ranks(collectives_as_dispatched, world_size=2)[0]
    assert seen[:4] == ["_allgather_base_", "_reduce_scatter_base_", "allreduce_", "| DDP:"], seen
    assert seen[4:] == ["allreduce_"], seen


def two_all_reduces_at_once(ctx, tries: int = 3) -> list[bool]:
    """A 64 MiB all-reduce, then a 4-byte one, both async: is the big one still running when
    the small one has finished? (A single worker thread would finish them in order.)"""
    overtaken = []
    for _ in range(tries):
        big, small = torch.ones(16 * MIB), torch.ones(1)
        first = dist.all_reduce(big, async_op=True)
        second = dist.all_reduce(small, async_op=True)
        second.wait()
        overtaken.append(not first.is_completed())
        first.wait()
    return overtaken


def test_gloo_runs_two_collectives_at_once():
    """08 README: buckets are launched in order; "gloo then runs up to two at once, one per
    thread" (`ProcessGroupGloo::Options::threads`, 2 by default; 2 ranks on gloo, as the lesson
    runs)."""
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        threads = backend.options._threads if hasattr(backend, "options") else None
    finally:
        dist.destroy_process_group()
    assert threads in (2, None), f"gloo has {threads} threads"  # None: 2.11 may not expose it
    overtaken = run_on_ranks(two_all_reduces_at_once, world_size=2, timeout=120)
    assert any(map(any, overtaken)), f"a 4-byte all-reduce never overtook a 64 MiB one: {overtaken}"


def grad_scaler_run(gradient: float, steps: int, state: dict | None = None,
                    **options) -> tuple[int, dict]:
    """Steps a GradScaler (fresh, or loaded from a saved ``state``) skips on a gradient of
    ``gradient``, and its state afterwards."""
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", **options)
    if state is not None:
        scaler.load_state_dict(state)
    skipped = 0
    for _ in range(steps):
        optimizer.zero_grad()
        before = weight.item()
        scaler.scale((weight * gradient).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped += weight.item() == before
    return skipped, scaler.state_dict()


def test_a_run_resumed_without_its_scaler_skips_steps_only_below_65536():
    """08 README, mixed precision: "a run resumed without it would start again at 65536 and, if
    the saved scale was smaller, skip a step per halving back down to it"."""
    # fp32 overflows at 3.4e38: a gradient of 1e34 does at a scale of 65536, not at 32768.
    for gradient, halvings in ((1e34, 1), (2e34, 2)):
        _, saved = grad_scaler_run(gradient, 4)  # the run before the restart settles
        assert saved["scale"] == 65536.0 / 2**halvings, saved
        assert grad_scaler_run(gradient, 4, saved)[0] == 0, "resumed with its scaler's state"
        assert grad_scaler_run(gradient, 4)[0] == halvings, "resumed without it"
    _, grown = grad_scaler_run(1.0, 3, growth_interval=1)  # a calm run that grew its scale
    assert grown["scale"] == 65536.0 * 2**3, grown
    assert grad_scaler_run(1.0, 4)[0] == 0, "a fresh scaler below the saved scale skips nothing"


def test_grad_scaler_defaults_and_what_it_does_after_an_overflow():
    """08 README, mixed precision: "The scaler multiplies the loss by a scale before backward
    (65536 at first, torch's default) ... `scaler.step(optimizer)` unscales them and skips the
    step if any is inf or NaN; `scaler.update()` halves the scale after such an overflow and
    doubles it after 2000 steps without one"."""
    defaults = {name: p.default for name, p in
                inspect.signature(torch.amp.GradScaler).parameters.items()}
    assert (defaults["init_scale"], defaults["growth_factor"], defaults["backoff_factor"],
            defaults["growth_interval"]) == (65536.0, 2.0, 0.5, 2000)
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((weight * torch.tensor([1.0, float("inf")])).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert weight.tolist() == [1.0, 1.0], "the step with an inf gradient was skipped"
    assert scaler.get_scale() == 32768.0
    optimizer.zero_grad()
    (scaler.scale(weight.sum())).backward()
    assert weight.grad.tolist() == [32768.0, 32768.0], "the gradients are scaled too"


def test_compiled_ddp_breaks_its_graph_at_the_buckets_by_default():
    """08 README: "Dynamo splits the compiled graph at DDP's bucket boundaries
    (`torch._dynamo.config.optimize_ddp`, on by default)"."""
    import torch._dynamo
    from torch._dynamo.backends.distributed import DDPOptimizer

    assert torch._dynamo.config.optimize_ddp in (True, "ddp_optimizer")
    documented = " ".join(inspect.getdoc(DDPOptimizer).split())
    assert "breaks aligning to the boundaries of gradient-allreduce buckets" in documented


def profiled_ddp_step(ctx, bucket_cap_mb: float) -> dict:
    from torch.profiler import ProfilerActivity, profile

    model = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]),
                bucket_cap_mb=bucket_cap_mb)
    model(torch.randn(8, 512)).sum().backward()  # the first step: DDP builds its buckets
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(8, 512)).sum().backward()
    events = prof.events()
    comms = [e.time_range.start for e in events if "allreduce" in e.name.replace("_", "").lower()]
    backward = [e.time_range.start for e in events
                if e.name.startswith("autograd::engine::evaluate_function: AddmmBackward")]
    # The layers whose backward had not started when the first all-reduce began.
    return {"all_reduces": len(comms), "layers_after": sum(t > min(comms) for t in backward)}


def test_ddp_starts_all_reducing_buckets_before_the_backward_ends():
    """08 README, overlap: "The script also reports how long before the end of the backward the
    first all-reduce started ... so the all-reduces do run during the backward"."""
    got = run_on_ranks(profiled_ddp_step, 1, world_size=2)[0]  # 4 buckets, a layer each
    assert got["all_reduces"] >= 4 and got["layers_after"] >= 2, got
    one_bucket = run_on_ranks(profiled_ddp_step, 1000, world_size=2)[0]  # the check can fail:
    assert one_bucket["layers_after"] == 0, one_bucket  # one bucket waits for every layer


def test_torchrun_ignores_node_rank_with_a_c10d_rendezvous(caplog):
    """09 README, two nodes: "with --rdzv-backend=c10d, --node-rank is ignored (newer torchrun,
    2.14 here, warns, when it is not 0, ...; 2.11's says nothing) ... the rendezvous numbers the
    nodes in the sorted order of their addresses, then of their agents' process ids"
    (harness.launch.start_nodes relies on it)."""
    warning = "node_rank is only used for static rdzv_backend"
    with caplog.at_level("WARNING"):
        run.config_from_args(torchrun_args("--nnodes=2", "--node-rank=0", "--rdzv-backend=c10d",
                                           "--rdzv-endpoint=127.0.0.1:0"))
    assert warning not in caplog.text, "--node-rank=0: no warning"
    with caplog.at_level("WARNING"):
        run.config_from_args(torchrun_args("--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
                                           "--rdzv-endpoint=127.0.0.1:0"))
    warned = warning in caplog.text
    assert warned or older_than_2_14(), caplog.text
    source = inspect.getsource(
        torch.distributed.elastic.rendezvous.dynamic_rendezvous._DistributedRendezvousOpExecutor)
    assert "for rank, node in enumerate(sorted(state.participants))" in " ".join(source.split())
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    assert [f.name for f in dataclasses.fields(_NodeDesc)][:2] == ["addr", "pid"]
    assert _NodeDesc("127.0.0.1", 9, 0) < _NodeDesc("127.0.0.2", 1, 0)  # the address first


def test_a_new_dataloader_iterator_draws_a_seed_from_the_global_generator():
    """09 README, resuming mid-epoch: "every new iterator of a DataLoader draws a seed from the
    global generator, unless the DataLoader has a generator of its own"."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(DataLoader(range(4)))
    assert not torch.equal(torch.get_rng_state(), before)
    before = torch.get_rng_state()
    iter(DataLoader(range(4), generator=torch.Generator()))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.timeout(120)
def test_torchruns_store_outlives_a_restart_unless_sharing_is_off():
    """09 README, restarts: "torchrun keeps one store for every attempt, so a restarted rank can
    read what a dead one left there ... TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each
    attempt a fresh one" (pytorch/pytorch#135712)."""
    from harness.launch import run_script

    probe = REPO_ROOT / "tests" / "probes" / "restart_store.py"
    runs = {share: run_script(probe, launcher="torchrun", nproc=2, result=False, timeout=90,
                              launcher_args=("--max-restarts=1",), check=False,
                              env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": share})
            for share in ("0", "1")}
    seen = {share: {line.rsplit(" ", 1)[1] for line in run.output.splitlines()
                    if "key of the first attempt still there" in line}
            for share, run in runs.items()}
    assert seen["0"] == {"True"} and runs["0"].returncode == 0, runs["0"].output
    assert seen["1"] == {"False"} and runs["1"].returncode == 0, runs["1"].output


def test_distributed_samplers_order_depends_on_seed_and_epoch_not_the_global_generator():
    """09 README: "the sampler's order is a function of its seed, the epoch, the rank and the
    world size alone: nothing about it needs saving but the epoch"."""
    def order(epoch: int, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)
        sampler = DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=5)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(3, global_seed=0) == order(3, global_seed=1)
    assert order(3, global_seed=0) != order(4, global_seed=0)
    assert "g.manual_seed(self.seed + self.epoch)" in inspect.getsource(DistributedSampler.__iter__)


def test_torchruns_agent_logs_at_the_level_loglevel_names(monkeypatch):
    """09 README: "LOGLEVEL=INFO makes torchrun's agent say what it decides; by default it shows
    warnings and errors only"."""
    from torch.distributed.elastic.utils.logging import get_logger

    monkeypatch.delenv("LOGLEVEL", raising=False)
    assert get_logger("course.probe.default").getEffectiveLevel() == 30  # WARNING
    monkeypatch.setenv("LOGLEVEL", "INFO")
    assert get_logger("course.probe.info").getEffectiveLevel() == 20  # INFO


def test_dcp_writes_its_metadata_last_under_a_temporary_name():
    """09 README, sharded checkpoints: "`.metadata`, written by the coordinator (rank 0) after
    every rank's part is written, under a temporary name then renamed"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    finish = " ".join(inspect.getsource(FileSystemWriter.finish).split())
    assert ".tmp" in finish and "self.fs.rename(tmp_path, metadata_path)" in finish
    assert inspect.signature(_save_state_dict).parameters["coordinator_rank"].default == 0
    assert "Rank 0 is assumed to be the coordinator rank" in inspect.getdoc(dcp.save)


def test_dcp_fsyncs_the_files_it_writes_by_default(tmp_path, monkeypatch):
    """09 README, writing it atomically: "`torch.distributed.checkpoint` fsyncs its files too
    (`FileSystemWriter(sync_files=True)` is its default)"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    assert inspect.signature(FileSystemWriter).parameters["sync_files"].default is True
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    with warnings.catch_warnings():  # one process on purpose: torch warns that it assumes so
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"weight": torch.ones(3)}, storage_writer=FileSystemWriter(tmp_path),
                 no_dist=True)
    assert synced, "dcp.save wrote its files without an fsync"


def test_dcp_async_save_writes_in_a_thread_and_wants_a_cpu_backend():
    """09 README, the newest K: "a thread of the same process writes the copy
    (`AsyncCheckpointerType.THREAD`, the default; `PROCESS` starts a process for it)" and "Its
    group must have a CPU backend: `async_save` refuses one without". (That it copies the state
    before it returns is shown by the lesson's test, which changes the parameters at once.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    default = inspect.signature(dcp.async_save).parameters["async_checkpointer_type"].default
    assert default is AsyncCheckpointerType.THREAD
    assert {kind.name for kind in AsyncCheckpointerType} == {"THREAD", "PROCESS"}
    assert "A CPU backend must be enabled for async save" in inspect.getsource(dcp.async_save)


def test_an_elastic_rendezvous_waits_last_call_for_more_nodes_and_drops_silent_ones():
    """09 README, losing a node: "`keep_alive_interval` x `keep_alive_max_attempt` (5 s x 3 by
    default): how long an agent may be silent before the rendezvous drops it" and
    "`last_call_timeout` (30 s by default): once a round has `MIN` nodes but fewer than `MAX`,
    it waits this long for more before it completes"; `--rdzv-conf` sets all three."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _BackendRendezvousStateHolder,
        create_handler,
    )

    assert run.parse_min_max_nnodes("1:2") == (1, 2)
    settings = []
    for conf in ({}, {"last_call_timeout": "5", "keep_alive_interval": "1",
                      "keep_alive_max_attempt": "2"}):
        params = RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0", run_id="claims",
                                      min_nodes=1, max_nodes=2, is_host=True, **conf)
        backend, store = create_backend(params)  # a store of its own, on a port the OS picks
        got = create_handler(store, backend, params).settings
        settings.append((got.min_nodes, got.max_nodes, got.timeout.last_call,
                         got.keep_alive_interval, got.keep_alive_max_attempt))
        del store
    assert settings == [(1, 2, timedelta(seconds=30), timedelta(seconds=5), 3),
                        (1, 2, timedelta(seconds=5), timedelta(seconds=1), 2)], settings
    sanitize = " ".join(inspect.getsource(_BackendRendezvousStateHolder._sanitize).split())
    assert ("keep_alive_interval * self._settings.keep_alive_max_attempt" in sanitize
            and "del state.participants[dead_node]" in sanitize), "the silent are dropped"


def test_set_rng_state_takes_a_cpu_byte_tensor_only():
    """09 README: "`torch.set_rng_state` ... take[s] a CPU `ByteTensor` only" (so generator
    states loaded with `map_location` onto another device cannot be restored); the state
    torch hands out is such a tensor."""
    state = torch.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    for moved in (state.to("meta"), state.float()):
        with pytest.raises((TypeError, RuntimeError)):
            torch.set_rng_state(moved)
    torch.set_rng_state(state)


def test_nccls_watchdog_names_the_collective_and_the_flight_recorder_reads_its_buffer():
    """09 README, finding a hang: the watchdog logs "Watchdog caught collective operation
    timeout: WorkNCCL(SeqNum=..., OpType=..., NumelIn=..., ...)" and "To avoid data
    inconsistency, we are taking the entire process down"; `TORCH_FR_BUFFER_SIZE`
    (`TORCH_NCCL_TRACE_BUFFER_SIZE` in older releases); "with `TORCH_NCCL_DUMP_ON_TIMEOUT=1`";
    `torch.distributed.flight_recorder.fr_trace` (or `torchfrtrace`) is torch's analyser, and
    "reports where the first mismatch occurs"."""
    import mmap
    from pathlib import Path

    from torch.distributed.flight_recorder import fr_trace

    assert callable(fr_trace.main)
    assert "where the first mismatch occurs" in " ".join(fr_trace.__doc__.split())
    assert any(entry.name == "torchfrtrace"
               for entry in importlib.metadata.distribution("torch").entry_points)
    library = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    if not library.is_file():
        pytest.skip("this torch is a CPU build: no NCCL process group to ask")
    with library.open("rb") as handle, mmap.mmap(handle.fileno(), 0,
                                                  access=mmap.ACCESS_READ) as data:
        for text in (b"Watchdog caught collective operation timeout", b"SeqNum=", b"OpType=",
                     b"NumelIn=", b"To avoid data inconsistency, we are taking the entire "
                     b"process down", b"TORCH_FR_BUFFER_SIZE", b"TORCH_NCCL_TRACE_BUFFER_SIZE",
                     b"TORCH_NCCL_DUMP_ON_TIMEOUT"):
            assert data.find(text) != -1, text


def fr_recording_on_rank(ctx, collectives: int) -> dict:
    """``collectives`` all-reduces and a send on a new group, then this rank's flight-recorder
    entries of that group, as ``_dump_fr_trace`` gives them, and the whole dump."""
    import pickle

    group = dist.new_group(list(range(ctx.world_size)))
    tensor = torch.ones(3)
    for _ in range(collectives):
        dist.all_reduce(tensor, group=group)
    if ctx.world_size > 1:
        (dist.send if ctx.rank == 0 else dist.recv)(tensor, 1 - ctx.rank, group=group)
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    dist.destroy_process_group(group)
    return {"entries": [e for e in dump["entries"] if e["process_group"][0] == group.group_name],
            "dump": dump}


@pytest.mark.timeout(120)
def test_the_flight_recorder_records_gloo_collectives_and_fr_trace_cannot_read_them(tmp_path):
    """09 README, the flight recorder: "2000 of them by default on torch 2.13 and 2.14";
    "`TORCH_FR_BUFFER_SIZE=N` for another number (`TORCH_NCCL_TRACE_BUFFER_SIZE` in older
    releases, still read)"; each entry holds the group, the sequence number in that group, the
    name (`gloo:all_reduce`) and the input sizes; "gloo ranks record too (their sends and
    receives excepted)"; "`fr_trace` cannot read a gloo dump: it looks the groups up in the
    dump's `pg_config`, where gloo lists none, and stops with a `KeyError`"."""
    import pickle
    import sys

    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if version < (2, 13):
        pytest.skip(f"torch {torch.__version__}: the text states what 2.13 and newer do")
    results = run_on_ranks(fr_recording_on_rank, 2, timeout=30)
    for result in results:
        assert [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"])
                for e in result["entries"]] == [(1, "gloo:all_reduce", [[3]]),
                                                (2, "gloo:all_reduce", [[3]])], result["entries"]
    recorded = [e["profiling_name"] for r in results for e in r["dump"]["entries"]]
    assert not any("send" in name or "recv" in name for name in recorded), recorded
    names = {name for r in results for name in r["dump"]["pg_config"]}
    assert results[0]["entries"][0]["process_group"][0] not in names, names
    for rank, result in enumerate(results):
        (tmp_path / f"rank{rank}").write_bytes(pickle.dumps(result["dump"]))
    from torch.distributed.flight_recorder import fr_trace

    with pytest.raises(KeyError):
        fr_trace.main([str(tmp_path), "--prefix", "rank"])
    count = ("import os, pickle, torch, torch.distributed as dist\n"
             "store = dist.TCPStore('127.0.0.1', 0, 1, is_master=True)\n"
             "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
             "for _ in range(2010): dist.all_reduce(torch.ones(1))\n"
             "print(len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace())['entries']))\n"
             "dist.destroy_process_group()\n")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    for extra, expected in (({}, 2000), ({"TORCH_FR_BUFFER_SIZE": "7"}, 7),
                            ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "5"}, 5)):
        run = subprocess.run([sys.executable, "-c", count], env={**clean, **extra},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr[-2000:]
        assert int(run.stdout.split()[-1]) == expected, (extra, run.stdout)


def test_monitored_barrier_is_for_gloo_and_detail_wraps_new_groups():
    """09 README, finding a hang: "`monitored_barrier` (gloo only ...)" and "with
    TORCH_DISTRIBUTED_DEBUG=DETAIL, torch wraps every process group" (the lesson's own test
    shows what the wrapper then reports)."""
    assert "this collective is only supported with the GLOO backend" in " ".join(
        inspect.getdoc(dist.monitored_barrier).split())
    source = inspect.getsource(dist.distributed_c10d._new_process_group_helper)
    assert "get_debug_level() == DebugLevel.DETAIL" in source
    assert "_create_process_group_wrapper(" in source


def library_holds(library, *texts: bytes) -> list[bytes]:
    """Which of ``texts`` the shared library does not contain (names it reads, its messages)."""
    import mmap

    with library.open("rb") as handle, mmap.mmap(handle.fileno(), 0,
                                                  access=mmap.ACCESS_READ) as data:
        return [text for text in texts if data.find(text) == -1]


def env_with_debug_level(value: str | None) -> dict:
    """This process's environment with TORCH_DISTRIBUTED_DEBUG set to ``value`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}
    env.update({} if value is None else {"TORCH_DISTRIBUTED_DEBUG": value})
    return env


def debug_level_with(value: str | None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import torch.distributed as d; "
                           "print(d.get_debug_level())"], env=env_with_debug_level(value),
                          capture_output=True, text=True, timeout=120)


DDP_UNDER_DEBUG = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
print("joined", flush=True)
model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
print("built", flush=True)
model(torch.ones(3, 2)).sum().backward()
print("trained", flush=True)
dist.destroy_process_group()
"""


def ddp_on_two_gloo_ranks(folder, *debug_levels: str) -> dict:
    """For each level, two fresh processes (TORCH_DISTRIBUTED_DEBUG is read when
    torch.distributed is imported) join a gloo group, build a DDP model and take one backward:
    each one's exit code and what it printed. All start at once; any still running after 120 s
    is killed."""
    procs = {}
    for debug in debug_levels:
        store = folder / f"store-{debug}"
        procs[debug] = [
            subprocess.Popen([sys.executable, "-c", DDP_UNDER_DEBUG, str(rank), str(store)],
                             env=env_with_debug_level(debug), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True) for rank in range(2)]
    deadline = time.monotonic() + 120
    got = {}
    try:
        for debug, pair in procs.items():
            got[debug] = []
            for proc in pair:
                try:
                    text = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                except subprocess.TimeoutExpired:
                    text = "(killed after 120 s)"
                got[debug].append((proc.returncode, text))
    finally:
        for proc in (proc for pair in procs.values() for proc in pair):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return got


@pytest.mark.timeout(240)
def test_ddp_on_gloo_crashes_under_torch_distributed_debug_detail(tmp_path):
    """04 README and doctor.py: on gloo, building a DDP model under
    TORCH_DISTRIBUTED_DEBUG=DETAIL kills the process with a segfault (torch 2.11.0, 2.13.0 and
    2.14.1: in DDP's construction-time logging, c10d::Logger::set_construction_data_and_log,
    which casts the group's gloo backend, by then DETAIL's wrapper, to ProcessGroupGloo); the
    group joins
    first, so it is DDP, not DETAIL's wrapped group, that crashes. INFO builds and trains."""
    got = ddp_on_two_gloo_ranks(tmp_path, "DETAIL", "INFO")
    detail, info = got["DETAIL"], got["INFO"]
    for code, text in detail:
        assert "joined" in text, detail  # the wrapped group itself works
        assert code == -signal.SIGSEGV and "built" not in text, (
            f"torch {torch.__version__} no longer crashes building DDP on gloo under DETAIL "
            f"({detail}): lesson 04's text and doctor.py can recommend DETAIL there again")
    assert all(code == 0 and "trained" in text for code, text in info), info

def test_the_settings_lesson_04_tabulates_are_read_by_torch_and_nccl():
    """04 README, settings that decide hangs and speed: each name is one torch (or NCCL, or
    gloo) reads, with the messages the text quotes; TORCH_DISTRIBUTED_DEBUG is OFF by default,
    read in any case, and INFO names the parameters DDP got no gradient for; the dumps' default
    prefix is comm_lib_trace_rank_ under $XDG_CACHE_HOME/torch or ~/.cache/torch; the flight
    recorder's 2000 entries and torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING=1 are asked of torch
    at run time by the tests of lessons 09 and 04. The defaults read from torch 2.14's compiled
    code (3, 0, 1, 480, 1, 0) are cited in doctor.py's KNOBS, not testable without NCCL."""
    from pathlib import Path

    lib = Path(torch.__file__).parent / "lib"
    assert not library_holds(
        lib / "libtorch_cpu.so", b"TORCH_DISTRIBUTED_DEBUG", b"GLOO_SOCKET_IFNAME",
        b"TORCH_FR_BUFFER_SIZE", b"TORCH_NCCL_TRACE_BUFFER_SIZE", b"TORCH_FR_DUMP_TEMP_FILE",
        b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE", b"XDG_CACHE_HOME", b"/.cache", b"comm_lib_trace_r",
        b"to either INFO or DETAIL to print out information about which particular parameters "
        b"did not receive gradient")
    assert str(debug_level_with(None).stdout).strip() == "DebugLevel.OFF"
    assert str(debug_level_with("detail").stdout).strip() == "DebugLevel.DETAIL"
    wrong = debug_level_with("VERBOSE")
    assert wrong.returncode != 0 and "must be OFF, INFO, or DETAIL" in wrong.stderr, wrong.stderr
    if not (lib / "libtorch_cuda.so").is_file():
        pytest.skip("this torch is a CPU build: no NCCL process group to ask")
    assert not library_holds(
        lib / "libtorch_cuda.so", b"TORCH_NCCL_ASYNC_ERROR_HANDLING", b"TORCH_NCCL_BLOCKING_WAIT",
        b"TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created.",
        b"TORCH_NCCL_ENABLE_MONITORING", b"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
        b"watchdog got stuck for", b"monitor thread is disabled, but would have terminated",
        b"TORCH_NCCL_DUMP_ON_TIMEOUT", b"TORCH_NCCL_DESYNC_DEBUG")
    import site

    nccl = [path for root in site.getsitepackages()
            for path in Path(root).glob("nvidia/nccl/lib/libnccl.so*")]
    if nccl:  # the NCCL that pip installs beside torch's CUDA wheels
        assert not library_holds(nccl[0], b"NCCL_DEBUG", b"NCCL_DEBUG_SUBSYS", b"NCCL_DEBUG_FILE",
                                 b"NCCL_P2P_DISABLE", b"NCCL_SOCKET_IFNAME")


RESILIENT = REPO_ROOT / "lessons" / "09_survive_and_scale_out" / "train_resilient.py"


@pytest.mark.timeout(120)
def test_an_agent_whose_other_node_never_comes_gives_up_after_its_join_timeout():
    """09 README, restarts: "a node that never joins: each agent waits at most
    `--rdzv-conf=join_timeout=<seconds>`, then fails naming the rendezvous"."""
    from harness.launch import free_port, run_script

    port = free_port()  # for the rendezvous; nobody else will come
    began = time.monotonic()
    run = run_script(RESILIENT, "--epochs", "1", launcher="torchrun-node", nproc=1,
                     result=False, check=False, timeout=90, launcher_args=(
                         "--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                         "--rdzv-id=alone", "--rdzv-conf=join_timeout=5"))
    assert run.returncode != 0
    assert "RendezvousTimeoutError" in run.output, run.output[-3000:]
    assert "RANK=" not in run.output, "no worker may start without the whole group"
    assert time.monotonic() - began < 60


@pytest.mark.timeout(120)
def test_ctrl_c_to_torchrun_stops_every_worker():
    """09 README, restarts: "Ctrl-C to torchrun stops every process it started"."""
    from harness.launch import Launch

    launch = Launch(RESILIENT, "--epochs", "50", launcher="torchrun", nproc=2, result=False,
                    check=False, timeout=90)
    wait_until(lambda: len(workers_of(launch)) >= 2, time.monotonic() + 60, every=0.5)
    workers = workers_of(launch)
    assert len(workers) == 2, f"the two workers did not start: {workers}"
    time.sleep(2)  # inside training by now
    os.kill(launch.pid, signal.SIGINT)  # what Ctrl-C sends to the launcher
    run = launch.result()
    assert run.returncode != 0
    assert not alive(workers), f"workers left running after Ctrl-C: {alive(workers)}"


def two_nodes_training(tmp_path, job: str, epochs: int, env: dict | None = None) -> list:
    """Two torchrun agents as two nodes of one process each, 32 steps an epoch, a checkpoint
    every 2 steps (node 0's agent hosts the rendezvous's store)."""
    from harness.launch import start_nodes

    return start_nodes(RESILIENT, "--backend", "gloo", "--epochs", str(epochs), "--batch-size", "4",
                       "--train-windows", "256", "--save-every", "2", "--checkpoint-dir",
                       str(tmp_path), job=job, check=False, timeout=90, env=env)


def wait_until(condition, until: float, every: float = 0.1) -> None:
    """Poll ``condition`` until it holds or the monotonic clock reaches ``until``."""
    while not condition() and time.monotonic() < until:
        time.sleep(every)


def workers_of(launch) -> list[int]:
    """The training processes a launch's agent started, alive now."""
    from harness.processes import command_line, descendants

    return [pid for pid in descendants(launch.pid) if "train_resilient.py" in command_line(pid)]


def own_sessions(workers: list[int]) -> list[int]:
    """``workers``, each checked to lead a session of its own (torchrun starts them so)."""
    for pid in workers:
        try:
            assert os.getsid(pid) == pid, "torchrun starts each worker in a session of its own"
        except ProcessLookupError:
            pass  # already gone
    return workers


def wait_until_saved(folder, step: int) -> None:
    wait_until((folder / f"step-{step:08d}").exists, time.monotonic() + 60)
    assert (folder / f"step-{step:08d}").exists(), f"no checkpoint of step {step} after 60 s"


def alive(pids) -> list[int]:
    from harness.processes import command_line

    return [pid for pid in pids if command_line(pid)]


def kill_all(agents, pids) -> None:
    for agent in agents:
        agent.stop()
    for pid in alive(pids):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(150)
def test_a_killed_agent_that_hosted_the_store_ends_every_process_of_the_job(tmp_path):
    """09 README, several nodes: "torchrun starts each worker in a session of its own, so a
    SIGKILLed agent's worker runs on; if that agent hosted the rendezvous store, the other
    agents fail on their next look at it (RendezvousConnectionError) and stop their workers,
    the orphan's next collective fails, and no process of the job is left"."""
    agents, workers = two_nodes_training(tmp_path, "killed", epochs=10), []  # killed early
    try:
        wait_until_saved(tmp_path, 2)
        workers = own_sessions(workers_of(agents[0]) + workers_of(agents[1]))
        assert len(workers) == 2, f"the two workers were not found running: {workers}"
        os.kill(agents[0].pid, signal.SIGKILL)  # node 0's torchrun, lost; its worker is not
        killed_at = time.monotonic()
        other = agents[1].result()
        wait_until(lambda: not alive(workers), killed_at + 60)
        assert not alive(workers), f"still running {time.monotonic() - killed_at:.0f} s later"
        assert other.returncode != 0, other.output[-3000:]
        assert "RendezvousConnectionError" in other.output, other.output[-3000:]
        assert "closing signal SIGTERM" in other.output, "the other agent stops its own worker"
        assert agents[0].result().returncode == -signal.SIGKILL
        assert (tmp_path / "step-00000002" / "train.pt").is_file(), "the checkpoint to resume from"
    finally:
        kill_all(agents, workers)


@pytest.mark.timeout(150)
def test_a_killed_agent_that_hosted_nothing_leaves_the_others_waiting_at_the_exit_barrier(
        tmp_path):
    """09 README, several nodes: "any other agent lost: nothing fails; its worker trains to the
    end with the others, then each surviving agent waits at its exit barrier for the lost one,
    up to 300 s (exit_barrier_timeout), which torchrun has no option for, and then logs an
    error and ends"."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher.api import launch_agent

    assert inspect.signature(LocalElasticAgent).parameters["exit_barrier_timeout"].default == 300
    assert "exit_barrier_timeout" not in inspect.getsource(launch_agent), "torchrun passes none"
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    assert "Error waiting on exit barrier" in inspect.getsource(SimpleElasticAgent._exit_barrier)
    options = [action.dest for action in run.get_args_parser()._actions]
    assert not [name for name in options if "barrier" in name or "exit" in name], options
    # LOGLEVEL=INFO: the agent says it is waiting (at INFO).
    agents, workers = two_nodes_training(tmp_path, "waiting", 2, env={"LOGLEVEL": "INFO"}), []
    try:
        wait_until_saved(tmp_path, 2)
        workers = own_sessions(workers_of(agents[0]) + workers_of(agents[1]))
        assert len(workers) == 2, f"the two workers were not found running: {workers}"
        os.kill(agents[1].pid, signal.SIGKILL)  # node 1's torchrun; the store lives on
        deadline = time.monotonic() + 80
        waiting = "Waiting 300 seconds for other agents to finish"
        wait_until(lambda: waiting in agents[0].output_so_far(), deadline, every=0.2)
        output = agents[0].output_so_far()
        assert waiting in output, output[-3000:]
        assert "epoch 2/2" in output, "the job trained to its end without node 1's agent"
        wait_until(lambda: not alive(workers), deadline)  # the orphan may end a bit later
        assert not alive(workers), "both workers, node 1's orphan too, end by themselves"
        assert agents[0].running(), "node 0's agent still waits for node 1's"
    finally:
        kill_all(agents, workers)


SIGNALLED_WORKER = '''
import os, signal, sys, time
def caught(signum, frame):
    print(f"worker {os.getpid()} got {signal.Signals(signum).name}", flush=True)
    sys.exit(128 + signum)
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, caught)
print(f"worker {os.getpid()} ready", flush=True)
time.sleep(60)
'''


def torchrun_signalled(tmp_path, sig: signal.Signals, *launcher_args: str):
    """A torchrun of one worker that reports the signals it gets, sent ``sig`` once the worker
    is ready: (torchrun's result, the worker's pid, whether the worker outlived torchrun)."""
    from harness.launch import Launch

    worker = tmp_path / "worker.py"
    worker.write_text(SIGNALLED_WORKER)
    launch = Launch(worker, launcher="torchrun", nproc=1, result=False, check=False, timeout=60,
                    launcher_args=launcher_args)
    pid = None
    try:
        wait_until(lambda: "ready" in launch.output_so_far(), time.monotonic() + 45)
        found = re.search(r"worker (\d+) ready", launch.output_so_far())
        assert found, f"the worker did not start: {launch.output_so_far()[-3000:]}"
        pid = int(found.group(1))
        os.kill(launch.pid, sig)
        run = launch.result()
        return run, pid, bool(alive([pid]))
    finally:
        launch.stop()
        if pid and alive([pid]):
            os.kill(pid, signal.SIGKILL)  # the orphan a SIGUSR1 leaves


def test_torchrun_handles_sigterm_sigint_sighup_sigquit_and_waits_30_s_by_default(monkeypatch):
    """09 README, time limits: "torchrun handles SIGTERM, SIGINT, SIGHUP and SIGQUIT (its
    --signals-to-handle, also PET_SIGNALS_TO_HANDLE); it sends the same signal to its workers
    and waits for them up to 30 s (torch 2.14 can change it: --shutdown-timeout, or
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT; in 2.11 it is fixed) before a SIGKILL"."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api as mp_api

    default = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert default in inspect.getsource(mp_api.PContext.start), "what the agent registers"
    help_text = run.get_args_parser().format_help()
    assert "--signals-to-handle" in help_text
    assert torchrun_args().signals_to_handle == default
    if "--shutdown-timeout" in help_text or not older_than_2_14():
        assert "--shutdown-timeout" in help_text and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in help_text
        assert torchrun_args().shutdown_timeout is None  # then the variable, or 30
        from torch.distributed.launcher.api import LaunchConfig

        assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 30
    else:  # 2.11: no flag, and the agent's close waits its default 30 s
        assert inspect.signature(mp_api.PContext.close).parameters["timeout"].default == 30
    assert inspect.signature(LocalElasticAgent._shutdown).parameters["death_sig"].default \
        == signal.SIGTERM
    # What is left after the timeout gets the kill signal (SIGKILL on Linux).
    assert mp_api._get_kill_signal() == signal.SIGKILL
    assert "_get_kill_signal()" in inspect.getsource(mp_api.SubprocessContext._close)
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1")
    assert torchrun_args().signals_to_handle == "SIGTERM,SIGUSR1"


@pytest.mark.timeout(120)
def test_torchrun_passes_sigterm_on_and_dies_of_sigusr1_leaving_its_worker(tmp_path):
    """09 README, time limits: torchrun "sends it to its ranks (handled by default)" for SIGTERM;
    SIGUSR1 "named in --signals-to-handle: sends it to its ranks; not named: dies of it" (its
    worker, in a session of its own, runs on; under SLURM the step's end kills it)."""
    run_, pid, orphan = torchrun_signalled(tmp_path, signal.SIGTERM)
    assert f"worker {pid} got SIGTERM" in run_.output, run_.output[-3000:]
    assert "death signal, shutting down workers" in run_.output, run_.output[-3000:]
    assert run_.returncode == 1 and not orphan, "exits with 1, whatever its worker returned"
    run_, pid, orphan = torchrun_signalled(tmp_path, signal.SIGUSR1)
    assert run_.returncode == -signal.SIGUSR1, "the signal's default action ends torchrun"
    assert "got SIGUSR1" not in run_.output, run_.output[-3000:]
    assert orphan, "the worker, in a session of its own, outlives torchrun"
    run_, pid, orphan = torchrun_signalled(tmp_path, signal.SIGUSR1,
                                           "--signals-to-handle=SIGTERM,SIGUSR1")
    assert f"worker {pid} got SIGUSR1" in run_.output, run_.output[-3000:]
    assert run_.returncode == 1 and not orphan


@pytest.mark.timeout(120)
def test_a_subprocess_timeout_kills_torchrun_alone_and_leaves_its_workers(tmp_path):
    """04 README and lab 14, from a notebook: "`subprocess.run(..., timeout=...)` would kill
    torchrun with SIGKILL and leave its workers running"; the lab sends SIGTERM instead, which
    torchrun passes on (test_torchrun_passes_sigterm_on_and_dies_of_sigusr1_leaving_its_worker)."""
    assert "process.kill()" in inspect.getsource(subprocess.run), "what run does on a timeout"
    _, _, orphan = torchrun_signalled(tmp_path, signal.SIGKILL)
    assert orphan, "the worker, in a session of its own, outlives a torchrun killed with SIGKILL"


SPAWNED_LOADER = '''
import os, signal, time
import torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.tensor(i)

if __name__ == "__main__":
    caught = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: caught.append(signum))
    loader = DataLoader(Slow(), num_workers=1, multiprocessing_context="spawn")
    batches = iter(loader)
    next(batches)  # the worker is up
    os.kill(batches._workers[0].pid, signal.SIGUSR1)  # what srun does to every process
    try:
        for _ in range(100):
            next(batches)
        print("the step went on", caught)
    except RuntimeError as error:
        print("the step died:", caught, error)
'''


@pytest.mark.timeout(120)
def test_a_spawned_dataloader_worker_dies_of_the_warning_the_step_handles(tmp_path):
    """09 README: "Every process of the step gets the signal, helpers too: a `DataLoader`
    worker started by spawn dies of SIGUSR1 and takes the step with it" (the main process
    handles SIGUSR1; its spawned worker, which did not inherit the handler, is sent it too)."""
    script = tmp_path / "loader.py"
    script.write_text(SPAWNED_LOADER)
    run_ = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100)
    assert "the step died: []" in run_.stdout and "exited unexpectedly" in run_.stdout, (
        run_.stdout[-2000:], run_.stderr[-2000:])


# ---------------------------------------------------------------- lesson 10: context parallel


def _context_parallel_modules():
    """torch's context-parallel attention and load-balancer modules: the private package
    ``_context_parallel`` in recent releases, ``_attention`` (which still re-exports them) in
    older ones."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import (
            _attention,
            _load_balancer,
        )
    except ImportError:
        from torch.distributed.tensor.experimental import _attention
        _load_balancer = _attention
    return _attention, _load_balancer


def test_context_parallel_handles_only_sdpas_cuda_kernels():
    """Lesson 10: "its dispatch table lists the flash, memory-efficient and cuDNN attention
    operators and their backwards, and none of SDPA's CPU kernels"; ring_attention.py --torch-cp
    refuses to start without CUDA: "torch's context_parallel attends across ranks only inside
    SDPA's flash, memory-efficient and cuDNN CUDA kernels, and its dispatch table has none of
    SDPA's CPU kernels"."""
    from torch.distributed.tensor.experimental import context_parallel  # the public name

    assert callable(context_parallel)
    attention, _ = _context_parallel_modules()
    table = getattr(attention, "custom_ops", None)
    if table is None:
        pytest.skip("this torch keeps context parallel's dispatch table elsewhere")
    names = {str(op) for op in table}
    assert names == {f"aten._scaled_dot_product_{kind}_attention{part}.default"
                     for kind in ("flash", "efficient", "cudnn") for part in ("", "_backward")}
    cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert cpu not in table


def test_context_parallel_all_gathers_by_default_and_balances_only_lengths_of_2w():
    """Lesson 10: "By default each rank all-gathers every rank's keys and values at once ...
    set_rotate_method("alltoall") passes them to the next rank instead. It uses the head-tail
    split whenever the length divides by 2W, whatever the mask"; "Torch 2.11 picks the
    head-tail split for any length". What 2.14 does with other lengths: the next test."""
    attention, balancers = _context_parallel_modules()
    options = attention._cp_options
    assert options.rotate_method == attention._RotateMethod.ALL_GATHER
    assert options.enable_load_balance
    try:
        attention.set_rotate_method("alltoall")
        assert options.rotate_method == attention._RotateMethod.ALL_TO_ALL
        assert "next rank" in attention._AllToAllRotater.__doc__
    finally:
        attention.set_rotate_method("allgather")
    make = balancers._create_default_load_balancer
    assert isinstance(make(16, 4, "cpu"), balancers._HeadTailLoadBalancer)
    if make(12, 4, "cpu") is None or not older_than_2_14():
        assert make(12, 4, "cpu") is None  # 12 tokens do not cut into 8 chunks
    else:  # "2.11 picks the head-tail split for any length and fails an assertion on one
        # that does not divide by 2W"
        assert isinstance(make(12, 4, "cpu"), balancers._HeadTailLoadBalancer)
        with pytest.raises(AssertionError):
            make(12, 4, "cpu")._generate_indices()
    assert "is_causal" not in inspect.signature(make).parameters  # the mask plays no part


def cp_ring_on_this_rank(ctx, length: int):
    """torch's context-parallel ring (``_templated_ring_attention``, which its CUDA handlers
    call) on this rank, with SDPA's CPU kernel as its attention, on ``length`` tokens sharded by
    torch's own rules (its default balancer, its ``_context_parallel_buffers``): this rank's
    positions and its largest error against causal attention over the whole sequence."""
    from torch.distributed.device_mesh import init_device_mesh

    attention, balancers = _context_parallel_modules()
    q, k, v = (torch.randn(1, 2, length, 4, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    balancer = balancers._create_default_load_balancer(length, ctx.world_size, "cpu")
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    mine = attention._context_parallel_buffers(mesh, [q, k, v], [2, 2, 2], balancer)
    positions = attention._context_parallel_buffers(mesh, [torch.arange(length)], [0],
                                                     balancer)[0]

    def cpu_kernel(q, k, v, is_causal, **kwargs):  # returns (out, logsumexp), as flash does
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0,
                                                                          is_causal)

    if length % ctx.world_size:  # gloo aborts the process: its message is enough, no stack dump
        import faulthandler
        faulthandler.disable()
    balancing = attention._cp_options.enable_load_balance
    attention._cp_options.enable_load_balance = balancer is not None  # as context_parallel does
    try:
        out = attention._templated_ring_attention(mesh.get_group(), 2, cpu_kernel, *mine,
                                                  is_causal=True)[0]
    finally:
        attention._cp_options.enable_load_balance = balancing
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return positions.tolist(), (out - want.index_select(2, positions)).abs().max().item()


def test_context_parallel_without_balancing_still_needs_the_length_to_divide_by_w():
    """Lesson 10: "For other lengths newer torch (2.14 here) cuts W contiguous blocks,
    unbalanced, and the length must still divide by W: given 7 tokens on 2 gloo ranks (blocks of
    4 and 3), its ring's exchange aborts the processes." torch's own ring and sharding, on 2 gloo
    ranks, with SDPA's CPU kernel in place of the CUDA ones its dispatch table lists."""
    if older_than_2_14():
        pytest.skip("torch 2.11 picks the head-tail split for any length (the test above)")
    (zero, error0), (one, error1) = run_on_ranks(cp_ring_on_this_rank, 8, world_size=2)
    assert (zero, one) == ([0, 1, 6, 7], [2, 3, 4, 5])  # head-tail: 8 divides by 2W
    assert max(error0, error1) < 1e-5
    (zero, error0), (one, error1) = run_on_ranks(cp_ring_on_this_rank, 6, world_size=2)
    assert (zero, one) == ([0, 1, 2], [3, 4, 5])  # 6 does not divide by 4: contiguous blocks
    assert max(error0, error1) < 1e-5
    with pytest.raises(RankError) as raised:  # blocks of 4 and 3
        run_on_ranks(cp_ring_on_this_rank, 7, world_size=2)
    assert re.search(r"died|doesn't match expected size", str(raised.value)), raised.value


def test_context_parallels_ring_calls_the_head_tail_split_round_robin():
    """Lesson 10: its `_HeadTailLoadBalancer`; "which the code of its ring calls round-robin"."""
    attention, balancers = _context_parallel_modules()
    assert hasattr(balancers, "_HeadTailLoadBalancer")
    source = inspect.getsource(attention._templated_ring_attention)
    assert "Round-robin load balancing case" in source and "ROUND_ROBIN_CYCLE" in source


def test_sdpas_fused_kernel_keeps_the_output_and_log_sum_exp_not_the_probabilities():
    """Lesson 10: autograd keeps, "with a softmax written out as task10_3's is, every block's
    probabilities (S/W x S per head ...; SDPA's fused kernels keep each block's output and
    log-sum-exp instead)". On the CPU, SDPA's fused kernel (flash attention for CPU); the CUDA
    kernels' backwards take the same (tests/sourced_claims.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, T, D = 1, 2, 16, 4
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))

    def kept(attend):
        shapes = []

        def pack(tensor):
            shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            attend()
        return shapes

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fused = kept(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                              is_causal=True))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    written_out = kept(lambda: torch.softmax(
        (q @ k.transpose(-2, -1) * D ** -0.5).masked_fill(~mask, float("-inf")), -1) @ v)
    assert (B, H, T, T) in written_out  # the probabilities, for the product with v
    assert sorted(fused) == sorted([(B, H, T, D)] * 4 + [(B, H, T)]), fused  # q, k, v, out, lse


def test_context_parallels_balanced_ring_refuses_attention_without_is_causal():
    """Lesson 10: "its ring then refuses attention without is_causal ("Load balancing requires
    is_causal=True")". The ring runs only on CUDA kernels: read from its source."""
    attention, _ = _context_parallel_modules()
    source = inspect.getsource(attention._templated_ring_attention)
    assert "if not is_causal and _cp_options.enable_load_balance:" in source
    assert "Load balancing requires `is_causal=True`." in source


def cp_buffers_on_this_rank(ctx):
    """What ``context_parallel`` does to its buffers on this rank, on a CPU mesh (no attention is
    called, so no CUDA kernel is needed): inside, after, with the balancer off, and after an
    error inside the block."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import (
        _attention,  # the name the lesson gives
        context_parallel,
    )

    sdpa = F.scaled_dot_product_attention
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("cp",))
    kept, dropped = torch.arange(8), torch.arange(8)
    with context_parallel(mesh["cp"], buffers=[kept, dropped], buffer_seq_dims=[0, 0],
                          no_restore_buffers={dropped}):
        inside = kept.tolist()
    found = {"inside": inside, "kept": kept.tolist(), "dropped": dropped.tolist()}
    balancing = _attention._cp_options.enable_load_balance
    _attention._cp_options.enable_load_balance = False
    try:
        kept = torch.arange(8)
        with context_parallel(mesh["cp"], buffers=[kept], buffer_seq_dims=[0]):
            found["unbalanced"] = kept.tolist()
    finally:
        _attention._cp_options.enable_load_balance = balancing
    kept = torch.arange(8)
    with pytest.raises(KeyError), context_parallel(mesh["cp"], buffers=[kept],
                                                   buffer_seq_dims=[0]):
        raise KeyError("an error inside the block")
    found["after an error"] = (kept.tolist(), F.scaled_dot_product_attention is sdpa)
    F.scaled_dot_product_attention = sdpa  # torch 2.11 leaves its patch in place
    return found


def test_context_parallel_shards_its_buffers_and_restores_only_the_others():
    """Lesson 10: on entry `context_parallel` shards `buffers` in place (head-tail, 8 tokens on 2
    gloo ranks: 0, 1, 6, 7 and 2 to 5); on exit it restores them, except `no_restore_buffers`,
    which stay sharded; with `torch.distributed.tensor.experimental._attention._cp_options
    .enable_load_balance = False` set before, contiguous blocks. "Torch 2.11 does not undo its
    patch of SDPA, nor restore the buffers, when the block raises; 2.14 does." """
    for rank, got in enumerate(run_on_ranks(cp_buffers_on_this_rank, world_size=2)):
        mine = [[0, 1, 6, 7], [2, 3, 4, 5]][rank]
        assert got["inside"] == mine and got["dropped"] == mine, got
        assert got["kept"] == list(range(8)), got
        assert got["unbalanced"] == [[0, 1, 2, 3], [4, 5, 6, 7]][rank], got
        if torch.torch_version.TorchVersion(torch.__version__) < "2.12":
            assert got["after an error"] == (mine, False), got  # no try/finally round its yield
        elif not older_than_2_14() or got["after an error"] != (mine, False):
            assert got["after an error"] == (list(range(8)), True), got


def test_context_parallel_balances_packed_documents_only_with_a_per_document_balancer():
    """Lesson 10: "torch 2.14's private `_PerDocumentHeadTailLoadBalancer` does [split each
    document head-tail on its own], and asserts (2.11's too) that each document's length divides
    by 2W"; "2.11's orders its indices document by document, so the contiguous cut falls
    mid-document". The default balancer knows only the sequence's length. Documents of 4 and 12
    tokens, 2 ranks: on 2.14 rank 0 holds chunks 0 and 3 of each."""
    _, balancers = _context_parallel_modules()
    make = balancers._PerDocumentHeadTailLoadBalancer
    indices = make([[4, 12]], 2, "cpu")._generate_indices().flatten().tolist()
    assert sorted(indices) == list(range(16))
    if not older_than_2_14():
        assert indices[:8] == [0, 3, 4, 5, 6, 13, 14, 15], indices
    else:  # document by document: rank 0's cut takes all of the first and part of the second
        assert indices[:8] == [0, 3, 1, 2, 4, 5, 6, 13], indices
    with pytest.raises(AssertionError):
        make([[6, 10]], 2, "cpu")._generate_indices()  # 6 does not cut into 4 chunks
    assert list(inspect.signature(balancers._create_default_load_balancer).parameters) == [
        "seq_length", "world_size", "device"]


def _linear_checkpointed(**options):
    """A Linear layer run under torch.utils.checkpoint on an input that needs no gradient
    (a block after frozen embeddings): its weight's gradient, and the warnings on the way."""
    from torch.utils.checkpoint import checkpoint

    layer = nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = checkpoint(layer, torch.randn(2, 4), **options)
        (out.sum() + layer.weight.sum()).backward()  # something needs a gradient either way
    return layer.weight.grad, [str(w.message) for w in caught]


def test_checkpoint_without_use_reentrant_warns_and_takes_the_reentrant_variant():
    """05 README: "Without the argument, `checkpoint` warns and takes the older, reentrant
    variant. That one gives a block's parameters no gradient when the block's input needs none
    (frozen embeddings, in fine-tuning), with only a warning." The gradient of the weight is
    then only the extra term's ones; the non-reentrant variant adds the layer's own."""
    unset, unset_warnings = _linear_checkpointed()
    reentrant, reentrant_warnings = _linear_checkpointed(use_reentrant=True)
    fixed, _ = _linear_checkpointed(use_reentrant=False)
    assert any("use_reentrant" in w for w in unset_warnings), unset_warnings
    assert any("requires_grad" in w for w in reentrant_warnings), reentrant_warnings
    assert torch.equal(unset, torch.ones(4, 4)) and torch.equal(reentrant, torch.ones(4, 4))
    assert not torch.equal(fixed, torch.ones(4, 4)), "the layer's own gradient is missing"


def test_the_reentrant_checkpoint_supports_backward_alone():
    """05 README: the reentrant variant "supports `backward()` alone, not
    `torch.autograd.grad`"."""
    from torch.utils.checkpoint import checkpoint

    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    (grad,) = torch.autograd.grad(checkpoint(layer, x, use_reentrant=False).sum(), [layer.weight])
    assert grad is not None
    with pytest.raises(RuntimeError):  # "... appears to not have been used in the graph"
        torch.autograd.grad(checkpoint(layer, x, use_reentrant=True).sum(), [layer.weight])


def test_checkpoint_wrapper_is_non_reentrant_and_keeps_the_state_dict_names():
    """05 README: "`checkpoint_wrapper` takes the non-reentrant one unless told otherwise";
    "`blocks.0._checkpoint_wrapped_module.ln_1.weight` in `named_parameters()`.
    `checkpoint_wrapper` takes that part out of `state_dict()` and puts it back on loading"."""
    from gpt import GPT, GPTConfig
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    default = inspect.signature(checkpoint_wrapper).parameters["checkpoint_impl"].default
    assert default == CheckpointImpl.NO_REENTRANT
    model = GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16), seed=0)
    saved = model.state_dict()
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    assert "blocks.0._checkpoint_wrapped_module.ln_1.weight" in dict(model.named_parameters())
    assert list(model.state_dict()) == list(saved)
    model.load_state_dict(saved)  # strict


def test_checkpoint_recomputes_with_the_forwards_dropout_masks_and_restores_the_generator():
    """05 README: "`preserve_rng_state=True`, the default, saves the generators' state before
    the forward, restores it for the recomputation, and puts the later state back afterwards"."""
    from torch.utils.checkpoint import checkpoint

    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for wrapped in (False, True):
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = checkpoint(layer, x, use_reentrant=False) if wrapped else layer(x)
        out.sum().backward()
        results.append(([p.grad.clone() for p in layer.parameters()], torch.get_rng_state()))
    (plain, plain_rng), (mine, mine_rng) = results
    assert all(torch.equal(a, b) for a, b in zip(plain, mine, strict=True))
    assert torch.equal(plain_rng, mine_rng)


def test_the_readmes_activation_bytes_are_what_autograd_keeps():
    """05 README: "a forward keeps 153,668 bytes of activations, of which each block keeps
    35,712. Checkpointed, a block keeps its input instead, 1,536 bytes: 85,316 bytes kept with
    every other block checkpointed, 16,964 with all four" (the test's 4-block model, width 16,
    3 x 8 tokens, dropout 0.2), counted with a saved-tensors hook, less the parameters, and
    torch's wrapper."""
    from gpt import GPT, GPTConfig
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    config = GPTConfig(vocab_size=29, block_size=8, n_layer=4, n_head=2, n_embd=16, dropout=0.2)
    tokens = torch.randint(0, 29, (3, 9), generator=torch.Generator().manual_seed(1))

    def kept(every: int | None, inside: int | None = None) -> int:
        model = GPT(config, seed=0).train()
        total, active = [0], [inside is None]
        if inside is not None:
            model.blocks[inside].register_forward_pre_hook(lambda *_: active.__setitem__(0, 1))
            model.blocks[inside].register_forward_hook(lambda *_: active.__setitem__(0, 0))
        for index in range(every - 1, 4, every) if every else ():
            model.blocks[index] = checkpoint_wrapper(model.blocks[index])

        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(tensor):  # parameters (a linear layer keeps its weight) cost nothing more
            if active[0] and tensor.untyped_storage().data_ptr() not in parameters:
                total[0] += tensor.numel() * tensor.element_size()
            return tensor

        torch.manual_seed(5)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(tokens[:, :-1], tokens[:, 1:])
        return total[0]

    assert (kept(None), kept(None, inside=0)) == (153_668, 35_712)
    assert (kept(2), kept(1)) == (85_316, 16_964)
    assert 3 * 8 * 16 * 4 == 1_536  # a block's input: batch x tokens x width float32s


# -- lesson 05: FSDP2's schedule and the meta device, on gloo

# The timelines the text shows: F2/B2, block 2's forward/backward begins; AG2/RS2, its
# all-gather/reduce-scatter starts.
DEFAULT_TIMELINE = "AG0 F0 AG1 F1 AG2 F2 AG3 F3 AG3 AG2 B3 RS3 AG1 B2 RS2 AG0 B1 RS1 B0 RS0"
PREFETCHED_TIMELINE = "AG0 AG1 F0 AG2 F1 AG3 F2 F3 AG3 AG2 AG1 B3 RS3 AG0 B2 RS2 B1 RS1 B0 RS0"
KEPT_TIMELINE = "AG0 F0 AG1 F1 AG2 F2 AG3 F3 B3 RS3 B2 RS2 B1 RS1 B0 RS0"


def explicit_prefetching(blocks):
    """The text's example: one block ahead in the forward, two in the backward."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 2):i][::-1])


def the_texts_timelines(ctx) -> dict:
    return {"plain": tower_step(ctx, 4), "default": tower_step(ctx, 4),
            "explicit": tower_step(ctx, 4, explicit_prefetching),
            "kept": tower_step(ctx, 4, None, False)}


def test_when_fsdp_starts_each_all_gather():
    """05 README, "When each all-gather starts": by default FSDP2 issues a block's all-gather
    when the block's forward is reached and, in the backward, one block ahead; explicit
    prefetching issues them earlier; reshard_after_forward=False leaves the backward none to
    issue. The same gradients in all three."""
    want = {"default": DEFAULT_TIMELINE, "explicit": PREFETCHED_TIMELINE, "kept": KEPT_TIMELINE}
    for rank, runs in enumerate(run_on_ranks(the_texts_timelines, world_size=2)):
        for case, timeline in want.items():
            assert " ".join(runs[case]["events"]) == timeline, (rank, case, runs[case]["events"])
            for grad, plain in zip(runs[case]["grads"], runs["plain"]["grads"], strict=True):
                assert torch.equal(grad, plain), (rank, case)


class SameSizeBlock(nn.Module):
    """A residual MLP of width 64; ``seen`` records, as its forward begins (after FSDP's
    pre-forward hook), the bytes alive in ``peak``."""

    def __init__(self, index: int, seen: dict, peak: list):
        super().__init__()
        self.index, self.seen, self.peak = index, seen, peak
        self.up, self.down = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        self.seen[self.index] = self.peak[0].live_bytes()
        return x + self.down(self.up(x).tanh())


def gathered_in_the_forward(ctx, ahead: int) -> dict[int, float]:
    """Six blocks of one size, each fully_shard-ed (reshard_after_forward=True), then the root;
    each block's forward list the next ``ahead`` blocks. Block i -> the bytes allocated during
    the forward that are alive as its forward begins, in blocks' parameters (the shards and the
    input aside; the activations of one row of 64 are about 1 % of a block)."""
    from torch.distributed.fsdp import fully_shard

    seen, peak = {}, []
    with torch.random.fork_rng(devices=[]):
        blocks = nn.ModuleList(SameSizeBlock(i, seen, peak) for i in range(6))
    model = nn.Sequential(*blocks)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(list(blocks[i + 1:i + 1 + ahead]))
    block_bytes = sum(4 * p.numel() for p in blocks[0].parameters())
    x = torch.randn(1, 64)
    with AllocationPeak(ignore=[*model.parameters(), x]) as live:
        peak.append(live)
        model(x)
    return {i: nbytes / block_bytes for i, nbytes in seen.items()}


def test_the_forward_holds_two_blocks_gathered_and_one_more_per_block_prefetched():
    """05 README, "When each all-gather starts" and "What stays": on 2 gloo ranks, as each
    block's forward begins, a rank holds two blocks' whole parameters by default (the block's
    own, and the all-gather's output it copied them out of, which FSDPParamGroup.wait_for_unshard
    keeps in the forward until the next group's copy-out), and one more for each block
    prefetched ahead: 2 + d while d blocks remain ahead."""
    for ahead in (0, 1, 2):
        for rank, got in enumerate(run_on_ranks(gathered_in_the_forward, ahead, world_size=2)):
            want = {i: 2 + min(ahead, 5 - i) for i in range(6)}
            assert {i: round(v) for i, v in got.items()} == want, (ahead, rank, got)
            assert all(abs(v - want[i]) < 0.1 for i, v in got.items()), (ahead, rank, got)


def test_an_int_reshard_after_forward_gathers_the_backward_from_fewer_ranks():
    """05 README, "`reshard_after_forward` can be an int": 2 on 4 ranks keeps half of each
    block after its forward (rank 0: ceil(rows / 2) rows of each) and all-gathers the backward's
    parameters within pairs of ranks; the forward's all-gathers and the reduce-scatters still
    span all 4. The same gradients as True, bit for bit."""
    plain = run_on_ranks(tower_step, 2, world_size=4)
    runs = run_on_ranks(tower_step, 2, None, 2, world_size=4)
    blocks = Tower(2).blocks
    for k, got in ((4, plain[0]), (2, runs[0])):  # rank 0 holds the first, fullest rows
        want = [sum(-(-p.shape[0] // k) * p[0].numel() for p in block.parameters())
                for block in blocks]
        assert got["held_after_forward"] == want, (k, got["held_after_forward"], want)
    for rank, (got, base) in enumerate(zip(runs, plain, strict=True)):
        assert " ".join(got["events"]) == " ".join(base["events"]), rank
        gathers = [ranks for op, ranks in got["ranks"] if op == "all_gather"]
        scatters = [ranks for op, ranks in got["ranks"] if op == "reduce_scatter"]
        assert gathers == [4, 4, 2, 2] and scatters == [4, 4], (rank, got["ranks"])
        for grad, base_grad in zip(got["grads"], base["grads"], strict=True):
            assert torch.equal(grad, base_grad), rank  # a gather copies; nothing is summed


def int_reshard_at_the_ends(ctx) -> dict:
    runs = {repr(k): tower_step(ctx, 2, None, k) for k in (1, 2, False, True)}  # 1 == True
    return {k: (run["events"], run["held_after_forward"]) for k, run in runs.items()}


def test_an_int_reshard_after_forward_of_one_or_every_rank_is_a_bool():
    """05 README: "torch turns k = 1 into `False` and k = W into `True`": on 2 gloo ranks,
    reshard_after_forward=1 gives False's step (the same collectives, whole blocks held after
    the forward) and 2 gives True's."""
    for rank, got in enumerate(run_on_ranks(int_reshard_at_the_ends, world_size=2)):
        assert got["1"] == got["False"] and got["2"] == got["True"], (rank, got)
        assert got["False"] != got["True"], (rank, got)


def root_then_block(ctx) -> str:
    from torch.distributed.fsdp import fully_shard

    model = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=1, n_embd=8))
    fully_shard(model)
    try:
        fully_shard(model.blocks[0])
    except Exception as error:  # noqa: BLE001 - which exception is the claim
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_fully_shard_on_a_block_after_the_root_fails_without_naming_the_cause():
    """05 README: "Shard the root first ...; `fully_shard` on a block then fails, in torch
    2.14.1 with a `TypeError` from deep inside that names no cause" (2 gloo ranks)."""
    for rank, got in enumerate(run_on_ranks(root_then_block, world_size=2)):
        assert got != "no error", rank
        assert "root" not in got.lower() and "bottom" not in got.lower(), (rank, got)
        if torch.__version__.startswith("2.14."):  # the text names the type for 2.14.1 only
            assert got.startswith("TypeError"), (rank, got)


def build_peaks(ctx) -> dict:
    """05 README, the meta device: the most bytes a rank holds while building a deep,
    narrow GPT, eagerly then sharded, and on the meta device then materialised; its shards."""
    from torch.distributed.fsdp import fully_shard

    config = GPTConfig(vocab_size=29, block_size=8, n_layer=6, n_head=2, n_embd=16, bias=True)
    peaks = {}
    for how in ("eager", "meta"):
        with AllocationPeak() as peak:
            with torch.device("meta" if how == "meta" else "cpu"):
                model = GPT(config, seed=0)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            if how == "meta":
                model.to_empty(device="cpu")
                model.init_weights(torch.Generator().manual_seed(0))
        peaks[how] = peak.bytes
        if how == "meta":
            eager = GPT(config, seed=0)
            peaks["equal"] = all(torch.equal(p.full_tensor(), q) for p, q in
                                 zip(model.parameters(), eager.parameters(), strict=True))
    storages = {p.to_local().untyped_storage().data_ptr(): p.to_local().untyped_storage().nbytes()
                for p in model.parameters()}
    return {**peaks, "shards": sum(storages.values()),
            "whole": sum(4 * p.numel() for p in GPT(config).parameters()),
            "largest": max(4 * p.numel() for p in GPT(config).parameters())}


def copies_into_few_rows(ctx) -> dict:
    """05 README, the meta device: a whole tensor copied into a Shard(0) DTensor under
    implicit_replication(), for 2, 3 and 4 rows on this many ranks; and distribute_tensor with
    src_data_rank=None given a different whole on each rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    copied = {}
    for rows in (2, 3, 4):
        param = distribute_tensor(torch.zeros(rows, 5), mesh, [Shard(0)])
        try:
            with implicit_replication():
                param.copy_(torch.ones(rows, 5))
            copied[rows] = ("copied", tuple(param.to_local().shape))
        except RuntimeError as error:
            copied[rows] = ("raised", "no valid strategy preserves this placement" in str(error))
    own = distribute_tensor(torch.full((6, 2), float(ctx.rank)), mesh, [Shard(0)],
                            src_data_rank=None)
    return {"copied": copied, "own": own.to_local().unique().tolist()}


def test_copying_a_whole_tensor_under_implicit_replication_needs_a_row_per_rank():
    """05 README, the meta device: on 3 gloo ranks, copying a whole plain tensor into a Shard(0)
    DTensor under implicit_replication() raises in torch 2.14 on every rank where the parameter
    has fewer rows than ranks (2; torch 2.11 copied it), and copies where it has as many or more
    (3; 4, where rank 2 holds none): DTensor's is_tensor_shardable wants a dimension at least as
    large as the shards. distribute_tensor(..., src_data_rank=None) cuts each rank's own whole,
    with no communication (each rank's piece is of the tensor that rank passed)."""
    results = run_on_ranks(copies_into_few_rows, world_size=3)
    for rank, got in enumerate(results):
        if older_than_2_14() and got["copied"][2][0] == "copied":
            assert got["copied"][2] == ("copied", (1, 5) if rank < 2 else (0, 5)), (rank, got)
        else:
            assert got["copied"][2] == ("raised", True), (rank, got)
        assert got["copied"][3] == ("copied", (1, 5)), (rank, got)
        assert got["copied"][4][0] == "copied", (rank, got)
        assert got["own"] == [float(rank)], (rank, got)
    assert results[2]["copied"][4] == ("copied", (0, 5)), results[2]


def test_a_model_built_on_the_meta_device_peaks_at_its_shards():
    """05 README, "the meta device": on 2 ranks, a 6-block GPT of 83 kB peaks at 91 kB
    built eagerly and at 52 kB built on meta (42 kB of shards, a weight drawn and scaled, and
    this rank's piece of it), and equals the eager build."""
    got = run_on_ranks(build_peaks, world_size=2)[0]
    kb_ = {name: round(got[name] / 1000) for name in ("eager", "meta", "shards", "whole")}
    assert kb_ == {"eager": 91, "meta": 52, "shards": 42, "whole": 83}, (kb_, got)
    assert got["meta"] <= got["shards"] + 3 * got["largest"] < got["whole"], got
    assert got["equal"], "the meta-built model differs from the eager one"


def test_grouped_mm_on_the_cpu_takes_these_dtypes_and_rows():
    """11 README, "grouped_mm across versions": on the CPU, `grouped_mm` takes float32, bfloat16
    and float16 but not float64, int32 offsets only, and rows whose length in bytes is a
    multiple of 16 (8 float32 columns, not 6); and "`grouped_mm` itself takes any sizes, 0
    included", differentiably: each result equals the loop over the groups, gradients too."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped_mm is None:
        pytest.skip(f"needs torch.nn.functional.grouped_mm (torch {torch.__version__} has none)")
    offs = torch.tensor([3, 3, 8, 9], dtype=torch.int32)  # a group of 0 rows, uneven ones

    def both(dtype, columns=8):
        x = torch.randn(9, columns, dtype=dtype, requires_grad=True)
        w = torch.randn(4, columns, 8, dtype=dtype, requires_grad=True)
        got = grouped_mm(x, w, offs=offs)
        starts = [0, 3, 3, 8]
        want = torch.cat([x[a:b] @ w[g]
                          for g, (a, b) in enumerate(zip(starts, offs, strict=True))])
        probe = torch.randn(got.shape, dtype=dtype)  # a dense gradient (sum()'s is stride 0)
        grads = torch.autograd.grad(got, (x, w), probe)
        want_grads = torch.autograd.grad(want, (x, w), probe)
        return [(a.float() - b.float()).abs().max().item()
                for a, b in zip((got, *grads), (want, *want_grads), strict=True)]

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert max(both(dtype)) < (1e-5 if dtype == torch.float32 else 0.1), dtype
    with pytest.raises(RuntimeError, match="Float32, BFloat16 or Float16"):
        both(torch.float64)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        both(torch.float32, columns=6)
    with pytest.raises(RuntimeError, match="int32"):
        grouped_mm(torch.randn(9, 8), torch.randn(4, 8, 8), offs=offs.long())


def test_the_memory_efficient_kernel_pads_its_log_sum_exp_to_32_rows():
    """10 README: "on CUDA the memory-efficient kernel pads the log-sum-exp it returns to a
    multiple of 32 rows" (asked of its meta registration, which mirrors the CUDA kernel's shapes:
    16 and 40 queries give 32 and 64 rows)."""
    for rows, padded in ((16, 32), (40, 64), (64, 64)):
        q = torch.empty(1, 2, rows, 8, device="meta")
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, q, q, None, True)
        assert tuple(out.shape) == (1, 2, rows, 8) and tuple(lse.shape) == (1, 2, padded), (
            rows, lse.shape)
