"""Lesson 03: sharding, hand-written and real DDP, and the script under real launchers.

The equalities this lesson rests on are checked against a single process:
W ranks with per-rank batch b, averaging gradients, take exactly the steps of one process with
batch W*b, provided every global batch is the same set of samples.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import load_exercise, load_lesson_module
from harness.hardware import needs_gpus
from harness.launch import run_script, start_script
from harness.ranks import group_params, run_on_ranks

LESSON = "03_ddp"
SCRIPT = f"lessons/{LESSON}/train_ddp.py"
GROUPS = group_params(world_sizes=(2, 3))


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


def no_tf32() -> None:
    # CUDA results are compared with a CPU run: full fp32 matmuls on both sides.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def single_process_gradients(inputs, targets) -> dict[str, torch.Tensor]:
    model = make_model()
    nn.functional.mse_loss(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


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
                    assert [int(i) for i in got] == want, (
                        f"{call} = {got}, but DistributedSampler yields {want}"
                    )


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


CHECK_INIT = f"lessons/{LESSON}/check_init_from_env.py"


@pytest.fixture(scope="module")
def init_checks():
    """Both launches of the init check, started together."""
    return {"torchrun": start_script(CHECK_INIT, launcher="torchrun", nproc=2),
            "bad environments": start_script(CHECK_INIT, "--bad-environments", timeout=60)}


@pytest.mark.slow
@pytest.mark.task3_2
def test_init_from_env_under_torchrun(init_checks):
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
def test_init_from_env_rejects_bad_environments(init_checks):
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
    no_tf32()
    model = make_model().to(ctx.device)
    x, y = my_share(ctx, inputs, targets)
    nn.functional.mse_loss(model(x), y).backward()
    load_exercise(LESSON).average_gradients(model)
    return {name: p.grad for name, p in model.named_parameters()}


def ddp_gradients(ctx, inputs, targets):
    no_tf32()
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
    for rank, grads in enumerate(results):
        assert_parameters_close(grads, expected, rank=rank, what="averaged gradient")


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
    no_tf32()
    inputs, targets = make_data(SAMPLES)
    dataset = TensorDataset(inputs, targets)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
    loader = DataLoader(dataset, batch_size=PER_RANK_BATCH, sampler=sampler)
    model = DDP(make_model().to(ctx.device),
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for epoch in range(EPOCHS):
        if use_exercise:
            losses.append(load_exercise(LESSON).train_one_epoch(
                model, loader, optimizer, nn.functional.mse_loss, epoch))
            continue
        sampler.set_epoch(epoch)  # the lesson's claim, with the plain loop
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)).backward()
            optimizer.step()
    return {"parameters": dict(model.module.named_parameters()), "losses": losses}


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
        assert_parameters_close(result["parameters"], expected_params, rank=rank,
                                what=f"parameter after {EPOCHS} epochs")
        for epoch, (got, want) in enumerate(zip(result["losses"], expected_losses, strict=True)):
            assert_close(torch.tensor(got), torch.tensor(want), rank=rank,
                         what=f"mean loss of epoch {epoch} (all samples, all ranks)")


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


def bucketed_vs_ddp(ctx, steps: int):
    no_tf32()
    events: list[str] = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(*args, **kwargs):
        events.append("all_reduce")
        return real_all_reduce(*args, **kwargs)

    ours = make_model().to(ctx.device)
    reference = DDP(copy.deepcopy(ours),
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    layer_numel = sum(p.numel() for p in ours[2].parameters())  # one bucket per hidden layer
    buckets = load_exercise(LESSON).GradientBuckets(ours, bucket_size=layer_numel)
    for name, param in ours.named_parameters():  # after theirs: runs once their hook has run
        param.register_post_accumulate_grad_hook(lambda p, name=name: events.append(name))
    first_layer = {"0.weight", "0.bias"}
    results = []
    dist.all_reduce = recording_all_reduce
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
        dist.all_reduce = real_all_reduce
        buckets.remove()
    return results


@pytest.mark.task3_5
@pytest.mark.parametrize("group", GROUPS)
def test_gradient_buckets_equal_ddp_and_overlap_backward(group):
    world, backend, device = group
    results = run_on_ranks(bucketed_vs_ddp, 3, world_size=world, backend=backend, device=device)
    for rank, steps in enumerate(results):
        for step, result in enumerate(steps):
            assert_parameters_close(result["ours"], result["ddp"], rank=rank,
                                    what=f"step {step}: bucketed gradient vs DDP's")
            started = result["events"][: result["first_layer_at"]].count("all_reduce")
            assert started >= 1, (
                f"rank {rank}, step {step}: no dist.all_reduce started before backward reached "
                f"the first layer (events: {result['events']}). Start each bucket's all-reduce "
                f"(async_op=True) from the hooks as soon as its gradients are ready."
            )


# ----------------------------------------------------------------------------- the script


def load_trained(parameters: dict) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(values) for name, values in parameters.items()}


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """The training script under every launcher, all started at once (most of each launch is
    importing torch, which overlaps well), with the same global batch of 16."""
    checkpoint = tmp_path_factory.mktemp("checkpoint") / "model.pt"
    runs = {
        "python": start_script(SCRIPT, "--batch-size", "16"),
        "torchrun": start_script(SCRIPT, "--batch-size", "8", "--checkpoint", str(checkpoint),
                                 launcher="torchrun", nproc=2),
        # python -m torch.distributed.launch, which passes --local-rank=N
        "launch": start_script(SCRIPT, "--batch-size", "8", launcher="launch", nproc=2),
        "spawn": start_script(f"lessons/{LESSON}/train_spawn.py", "--nprocs", "2",
                              "--batch-size", "8"),
    }
    yield runs, checkpoint
    for run in runs.values():
        run.stop()


@pytest.mark.slow
def test_script_under_torchrun_equals_single_process(script_runs):
    runs, checkpoint = script_runs
    run, single = runs["torchrun"].result(), runs["python"].result()
    assert run.data["world_size"] == 2 and run.data["global_batch"] == 16
    assert run.data["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    assert_parameters_close(load_trained(run.data["parameters"]),
                            load_trained(single.data["parameters"]),
                            what="final parameter, 2 ranks x 8 vs 1 process x 16")
    assert_close(torch.tensor(run.data["losses"]), torch.tensor(single.data["losses"]),
                 "epoch losses")
    # Progress is printed by rank 0 only.
    assert any("epoch 0" in line for line in run.rank_lines(0))
    assert not any("epoch" in line for line in run.rank_lines(1))
    # Exactly one checkpoint, complete, loadable into a plain model without "module." prefixes.
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["model.pt"]
    train = load_lesson_module(LESSON, "train_ddp")
    model = train.build_model(0)
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
    assert_parameters_close(dict(model.state_dict()), load_trained(run.data["parameters"]),
                            what="checkpointed parameter")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch", "spawn"])
def test_older_launchers_train_the_same_model(script_runs, launcher):
    runs, _ = script_runs
    run, single = runs[launcher].result(), runs["python"].result()
    assert run.data["world_size"] == 2
    assert_parameters_close(load_trained(run.data["parameters"]),
                            load_trained(single.data["parameters"]),
                            what=f"final parameter under {launcher}")


@pytest.mark.slow
@needs_gpus(1, "nccl world 1 under torchrun")
def test_script_on_a_gpu_equals_the_cpu_run(script_runs):
    single = script_runs[0]["python"].result()
    run = run_script(SCRIPT, "--batch-size", "16", launcher="torchrun", nproc=1)
    assert run.data["backend"] == "nccl" and run.data["device"] == "cuda:0"
    # Different kernels sum in a different order: allow fp32 rounding to accumulate a little.
    assert_parameters_close(load_trained(run.data["parameters"]),
                            load_trained(single.data["parameters"]),
                            what="final parameter, GPU vs CPU", rtol=1e-4, atol=1e-5)


def test_script_explains_a_partial_launcher_environment(monkeypatch, capsys):
    train = load_lesson_module(LESSON, "train_ddp")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        train.main([])
    assert info.value.code == 2
    message = capsys.readouterr().err
    assert "MASTER_ADDR" in message and "torchrun" in message, message


def test_script_explains_nccl_without_gpus(monkeypatch, capsys):
    train = load_lesson_module(LESSON, "train_ddp")
    launcher_env = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT")
    saved = {name: os.environ.pop(name) for name in launcher_env if name in os.environ}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        with pytest.raises(SystemExit):
            train.main(["--backend", "nccl"])
    finally:  # a one-process run fills these in itself
        for name in launcher_env:
            os.environ.pop(name, None)
        os.environ.update(saved)
    assert "needs CUDA GPUs" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_script_explains_more_ranks_than_gpus(monkeypatch, capsys):
    train = load_lesson_module(LESSON, "train_ddp")
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never reached: fails before
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit):
        train.main(["--backend", "nccl"])
    assert "4 processes on this machine, 2 GPU(s) visible" in capsys.readouterr().err
