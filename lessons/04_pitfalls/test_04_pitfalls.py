"""Lesson 04: every pitfall's symptom is real, every fix removes it, and the doctor never hangs.

Each lab script's ``demo(fix)`` runs here on pooled ranks: the buggy variant must show the
symptom the lesson claims (so the lesson cannot claim what does not happen), and the fix must
remove it. Demonstrated hangs run in a pool whose process group times out after HANG_TIMEOUT
seconds, so torch's own timeout error ends them within seconds.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import io
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 - DDP's first use imports it: ~3 s per forked rank
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any group exists: see the labs' setup()
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.collectives import CollectiveLog
from harness.compare import assert_close, assert_parameters_close
from harness.exercises import load_exercise, load_lesson_module
from harness.hardware import needs_gpus
from harness.launch import run_script, start_first, start_script
from harness.ranks import RankError, group_params, run_on_ranks

LESSON = "04_pitfalls"
DOCTOR = f"lessons/{LESSON}/doctor.py"
HANG_TIMEOUT = 2  # s: the process-group timeout under which a demonstrated hang becomes an error
GRADE_TIMEOUT = 5  # s: the same for task tests, where only a wrong answer hangs

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken (tests/test_course.py checks the names).  # noqa: E501
CLAUSES = {
    "task4_1": {
        "the accuracy of model on dataset, every sample counted exactly once":
            ["test_exact_accuracy_counts_every_sample_once"],
        "every rank returns the same Python float":
            ["test_exact_accuracy_counts_every_sample_once"],
        "the prediction is model(inputs).argmax(dim=1)":
            ["test_exact_accuracy_counts_every_sample_once"],
        "rank r evaluates samples r, r + W, r + 2W, ... (no padding)":
            ["test_exact_accuracy_evaluates_the_strided_shard",
             "test_exact_accuracy_counts_every_sample_once"],
        "under torch.no_grad()": ["test_exact_accuracy_evaluates_under_no_grad"],
        "on the device of the model's parameters":
            "not testable on CPU: the model, the data and the counts are all on the CPU there, "
            "so inputs or counts left on the CPU are on the model's device anyway",
        "each rank sums its correct predictions and its samples":
            ["test_exact_accuracy_counts_every_sample_once"],
        "one all_reduce adds them over the ranks":
            ["test_exact_accuracy_counts_every_sample_once",
             "test_exact_accuracy_adds_the_counts_with_one_all_reduce"],
        "return correct / total, not the mean of the ranks' accuracies":
            ["test_exact_accuracy_counts_every_sample_once"],
        "not a DistributedSampler (its padding counts some samples twice)":
            ["test_exact_accuracy_counts_every_sample_once",
             "test_exact_accuracy_evaluates_the_strided_shard"],
    },
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
    "task4_3": {
        "only rank 0 writes": ["test_save_on_rank0_writes_once_atomically_and_everyone_waits"],
        "it writes model.module.state_dict() (without DDP's module. prefix)":
            ["test_save_on_rank0_writes_once_atomically_and_everyone_waits"],
        "it writes to a temporary file in the same folder, then os.replaces it onto path":
            ["test_save_on_rank0_writes_once_atomically_and_everyone_waits"],
        "every rank then waits at dist.barrier(), outside the if rank == 0":
            ["test_save_on_rank0_writes_once_atomically_and_everyone_waits"],
    },
    "task4_4": {
        "one step per (inputs, targets): zero the gradients, backward, optimizer.step()":
            ["test_train_with_join_trains_every_batch_without_hanging"],
        "wrap the loop in Join([model]): ranks with fewer batches do not hang":
            ["test_train_with_join_trains_every_batch_without_hanging"],
        "train on every batch: none is dropped":
            ["test_train_with_join_trains_every_batch_without_hanging"],
        "return the number of steps this rank took":
            ["test_train_with_join_trains_every_batch_without_hanging"],
    },
    "task4_5": {
        "torch.load(path, map_location=device, ...)":
            ["test_load_checkpoint_maps_devices_and_strips_prefixes"],
        "weights_only=True": ["test_load_checkpoint_refuses_a_checkpoint_that_runs_code"],
        "strip a leading module. from the keys":
            ["test_load_checkpoint_maps_devices_and_strips_prefixes",
             "test_load_checkpoint_strips_only_the_leading_prefix"],
        "keys without it are left alone":
            ["test_load_checkpoint_accepts_plain_keys_and_rejects_wrong_ones"],
        "strict: a missing key is an error":
            ["test_load_checkpoint_accepts_plain_keys_and_rejects_wrong_ones"],
        "strict: an unexpected key is an error":
            ["test_load_checkpoint_rejects_an_unexpected_key"],
        "return model": ["test_load_checkpoint_maps_devices_and_strips_prefixes"],
    },
    "task4_6": {
        "(loss_fn(model(inputs), targets) / k).backward() for each micro-batch":
            ["test_accumulate_gradients_syncs_once_and_equals_the_full_batch"],
        "all but the last micro-batch, forward and backward, inside model.no_sync()":
            ["test_accumulate_gradients_syncs_once_and_equals_the_full_batch"],
        "the last one outside it: its backward all-reduces the sum once":
            ["test_accumulate_gradients_syncs_once_and_equals_the_full_batch"],
        "do not zero the gradients": ["test_accumulate_gradients_neither_zeroes_nor_steps"],
        "do not step": ["test_accumulate_gradients_neither_zeroes_nor_steps"],
    },
    "task4_7": {
        "every rank's model an exact copy of rank src's": [
            "test_broadcast_initial_state_copies_parameters_and_buffers",
            "test_broadcast_initial_state_writes_into_the_models_own_tensors"],
        "every parameter": ["test_broadcast_initial_state_copies_parameters_and_buffers",
                            "test_broadcast_initial_state_writes_into_the_models_own_tensors"],
        "every buffer (BatchNorm's running statistics, its batch counter)": [
            "test_broadcast_initial_state_copies_parameters_and_buffers",
            "test_broadcast_initial_state_writes_into_the_models_own_tensors"],
        "in place": ["test_broadcast_initial_state_writes_into_the_models_own_tensors"],
    },
}


def lab(name: str):
    """A lab script as a module: lessons/04_pitfalls/labs/<name>.py."""
    return load_lesson_module(LESSON, f"labs/{name}")


def lab_on_rank(ctx, name: str, fix: bool, *args, **kwargs):
    """Run a lab's demo on this rank, inside the pool's process group."""
    return lab(name).demo(fix, *args, **kwargs)


def run_lab(name: str, fix: bool, *args, **kwargs) -> list[dict]:
    return run_on_ranks(lab_on_rank, name, fix, *args, **kwargs)


@pytest.fixture
def ex():
    return load_exercise(LESSON)


def runtime_error_from(action, expected: str) -> RuntimeError:
    """The RuntimeError ``action()`` raises. An untouched stub's NotImplementedError (itself a
    RuntimeError) passes through, so the test counts as not attempted."""
    try:
        action()
    except NotImplementedError:
        raise
    except RuntimeError as error:
        return error
    raise AssertionError(f"expected a RuntimeError: {expected}")


# ----------------------------------------------------------------------------- the labs' scaffold

LABS = sorted((Path(__file__).parent / "labs").glob("[0-9][0-9]_*.py"))
SCAFFOLD = ("setup", "demo", "summarize", "main")


def test_every_lab_carries_the_same_scaffold():
    """A lab is one file a learner can copy and run alone, so the scaffold is copied into every
    lab, not imported: one setup(), identical everywhere; demo(fix, ...) and summarize(facts, fix)
    called from main; the --fix and --result options."""
    assert len(LABS) >= 15, f"expected the 15 labs, found {[p.name for p in LABS]}"
    first, reference = None, None
    for path in LABS:
        source = path.read_text()
        functions = {node.name: node for node in ast.parse(source).body
                     if isinstance(node, ast.FunctionDef)}
        missing = [name for name in SCAFFOLD if name not in functions]
        assert not missing, f"labs/{path.name} lacks {missing}: copy them from labs/{LABS[0].name}"
        start = ast.get_source_segment(source, functions["setup"])
        if reference is None:
            first, reference = path.name, start
        elif start != reference:
            diff = "\n".join(difflib.unified_diff(reference.splitlines(), start.splitlines(),
                                                  f"labs/{first}", f"labs/{path.name}",
                                                  lineterm=""))
            raise AssertionError(f"labs/{path.name}'s setup() differs from labs/{first}'s: every "
                                 f"lab carries the same copy, so change them all together\n{diff}")
        demo = [a.arg for a in functions["demo"].args.args]
        assert demo[:1] == ["fix"], f"labs/{path.name}: demo's first argument is fix, not {demo}"
        summarize = [a.arg for a in functions["summarize"].args.args]
        assert summarize == ["facts", "fix"], (
            f"labs/{path.name}: summarize(facts, fix) returns (symptom, verdict); got {summarize}")
        calls = [node for node in ast.walk(functions["main"]) if isinstance(node, ast.Call)]
        called = {node.func.id for node in calls if isinstance(node.func, ast.Name)}
        assert {"setup", "demo", "summarize"} <= called, (
            f"labs/{path.name}: main calls {sorted(called)}; it should call setup, demo and "
            f"summarize")
        options = {node.args[0].value for node in calls
                   if isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                   and node.args and isinstance(node.args[0], ast.Constant)}
        assert {"--fix", "--result"} <= options, (
            f"labs/{path.name} accepts {sorted(options)}; every lab accepts --fix and --result")


# ----------------------------------------------------------------------------- 1 · set_epoch


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_set_epoch_decides_whether_epochs_reshuffle(fix):
    facts = run_lab("01_set_epoch", fix)
    for f in facts:
        orders = f["orders"]
        if fix:
            assert len({tuple(o) for o in orders}) == len(orders), (
                f"rank {f['rank']}: with set_epoch every epoch should read a new order: {orders}")
        else:
            assert all(o == orders[0] for o in orders), (
                f"rank {f['rank']}: without set_epoch every epoch repeats epoch 0: {orders}")
    for epoch in range(len(facts[0]["orders"])):  # still one permutation shared by the ranks
        everything = sorted(i for f in facts for i in f["orders"][epoch])
        assert everything == list(range(12)), f"epoch {epoch}: the ranks' shards {everything}"
    assert lab("01_set_epoch").summarize(facts, fix)[0] is not fix


# ----------------------------------------------------------------------------- 2 · no sampler


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_without_a_sampler_every_rank_reads_everything(fix):
    facts = run_lab("02_no_sampler", fix)
    seen = [sorted(f["seen"]) for f in facts]
    if fix:
        assert sorted(i for s in seen for i in s) == list(range(12)), f"shards overlap: {seen}"
        assert all(f["steps"] == 2 for f in facts), "12 samples, 2 ranks, batch 3: 2 steps each"
    else:
        assert all(s == list(range(12)) for s in seen), f"each rank should read all 12: {seen}"
        assert all(f["steps"] == 4 for f in facts), "as many steps per epoch as one GPU"
    assert "mutually exclusive" in facts[0]["shuffle_and_sampler"]
    assert lab("02_no_sampler").summarize(facts, fix)[0] is not fix


# ----------------------------------------------------------------------------- 3 · padded eval

TRUE_ACCURACY = 8 / 11  # lab 03's validation set, counted once in one process


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_padding_skews_an_evaluation_metric(fix):
    facts = run_lab("03_padded_eval", fix)
    evaluated = [i for f in facts for i in f["shard"]]
    for f in facts:
        assert f["truth"] == pytest.approx(TRUE_ACCURACY)
    if fix:
        assert sorted(evaluated) == list(range(11)), "each sample evaluated exactly once"
        assert all(f["reported"] == pytest.approx(TRUE_ACCURACY) for f in facts)
    else:
        assert len(evaluated) == 12 and evaluated.count(0) == 2, f"sample 0 padded: {evaluated}"
        assert facts[0]["reported"] == pytest.approx(8 / 12), "the padded duplicate is counted"
        assert facts[0]["mean_of_ranks"] == pytest.approx((5 / 6 + 3 / 5) / 2), (
            "averaging the accuracies of shards of 6 and 5 samples weighs them alike")
    assert lab("03_padded_eval").summarize(facts, fix)[0] is not fix


def exact_accuracy_on_rank(ctx):
    model, dataset = lab("03_padded_eval").validation_set()
    evaluated = [0]  # samples this rank's model saw

    def count(module, args):
        evaluated[0] += len(args[0])

    model.register_forward_pre_hook(count)
    accuracy = load_exercise(LESSON).exact_accuracy(model, dataset, batch_size=4)
    return {"accuracy": accuracy, "evaluated": evaluated[0], "samples": len(dataset)}


@pytest.mark.task4_1
def test_exact_accuracy_counts_every_sample_once():
    results = run_on_ranks(exact_accuracy_on_rank)
    world = len(results)
    for rank, result in enumerate(results):
        accuracy = result["accuracy"]
        assert isinstance(accuracy, float), (
            f"rank {rank}: return a Python float (.item()), not {type(accuracy).__name__}")
        hint = {8 / 12: " (8/12: a padded sample counted twice: shard with range(rank, N, W))",
                (5 / 6 + 3 / 5) / 2: " (the mean of the ranks' accuracies: sum the counts)",
                5 / 6: " (rank 0's shard only: all-reduce the sums)",
                3 / 5: " (rank 1's shard only: all-reduce the sums)"}
        why = next((text for value, text in hint.items() if abs(accuracy - value) < 1e-9), "")
        assert accuracy == pytest.approx(TRUE_ACCURACY), (
            f"rank {rank}: accuracy {accuracy:.6f}, expected 8/11 = {TRUE_ACCURACY:.6f}{why}")
    # The right number is not enough: each rank must evaluate its shard only.
    samples = results[0]["samples"]
    shards = [len(range(rank, samples, world)) for rank in range(world)]
    evaluated = [result["evaluated"] for result in results]
    if evaluated != shards:
        rank = next(r for r in range(world) if evaluated[r] != shards[r])
        why = (" (the whole dataset, on every rank: each rank repeats the others' work)"
               if all(n == samples for n in evaluated) else "")
        raise AssertionError(
            f"rank {rank}: the model evaluated {evaluated[rank]} samples{why}; its shard, "
            f"range({rank}, {samples}, {world}), has {shards[rank]} (every rank: {evaluated}, "
            f"expected {shards}). Evaluate only this rank's shard, then all-reduce the sums")


def exact_accuracy_seen_on_rank(ctx):
    """exact_accuracy on lab 03's validation set with each sample's input scaled by 1 + its
    index (the predictions, argmax, stay the same), so that the model's forward tells which
    samples it evaluated, and whether autograd was recording."""
    model, dataset = lab("03_padded_eval").validation_set()
    inputs, targets = dataset.tensors
    scale = 1 + torch.arange(len(inputs), dtype=inputs.dtype).unsqueeze(1)
    dataset = torch.utils.data.TensorDataset(inputs * scale, targets)
    seen = {"samples": [], "grad_enabled": []}

    def note(module, args):
        seen["samples"] += [round(v) - 1 for v in args[0].detach().amax(dim=1).tolist()]
        seen["grad_enabled"].append(torch.is_grad_enabled())

    model.register_forward_pre_hook(note)
    ex = load_exercise(LESSON)
    with CollectiveLog(ex) as log:
        ex.exact_accuracy(model, dataset, batch_size=4)
    return {**seen, "size": len(dataset), "collectives": [call.op for call in log.calls]}


@pytest.mark.task4_1
def test_exact_accuracy_evaluates_the_strided_shard():
    results = run_on_ranks(exact_accuracy_seen_on_rank)
    world = len(results)
    for rank, result in enumerate(results):
        shard = list(range(rank, result["size"], world))
        assert sorted(result["samples"]) == shard, (
            f"rank {rank} evaluated samples {sorted(result['samples'])}; its shard is "
            f"range({rank}, {result['size']}, {world}) = {shard}: rank r evaluates samples r, "
            f"r + W, r + 2W, ... (Subset(dataset, range(rank, len(dataset), world_size)))")


@pytest.mark.task4_1
def test_exact_accuracy_adds_the_counts_with_one_all_reduce():
    results = run_on_ranks(exact_accuracy_seen_on_rank)
    for rank, result in enumerate(results):
        assert result["collectives"] == ["all_reduce"], (
            f"rank {rank}: exact_accuracy ran {result['collectives'] or 'no collective'}; "
            f"expected one all_reduce of one tensor holding both sums, correct predictions "
            f"and samples (torch.tensor([correct, total])): one round trip, not one per number")

@pytest.mark.task4_1
def test_exact_accuracy_evaluates_under_no_grad():
    results = run_on_ranks(exact_accuracy_seen_on_rank)
    for rank, result in enumerate(results):
        recording = sum(result["grad_enabled"])
        assert not recording, (
            f"rank {rank}: {recording} of the model's {len(result['grad_enabled'])} forwards "
            f"ran with gradients enabled, so autograd kept a graph (and its activations) for "
            f"every batch: evaluate under `with torch.no_grad():`")


# ----------------------------------------------------------------------------- 4 · device


def test_global_rank_as_gpu_index_overflows_the_second_machine():
    lab04 = lab("04_device_from_rank")
    buggy = [lab04.gpu_index(env, fix=False) for env in lab04.TWO_MACHINES]
    fixed = [lab04.gpu_index(env, fix=True) for env in lab04.TWO_MACHINES]
    assert buggy == [0, 1, 2, 3], "RANK as the GPU index: the second machine asks for 2 and 3"
    assert fixed == [0, 1, 0, 1], "LOCAL_RANK: every machine uses its own cuda:0 and cuda:1"
    assert lab04.summarize([{"emulated": buggy}], False)[0]
    assert not lab04.summarize([{"emulated": fixed}], True)[0]


def test_the_lab_names_the_process_that_asked_for_a_gpu_its_machine_lacks():
    """What lesson 09's two-node GPU run reports, given as the facts its ranks gather."""
    lab04 = lab("04_device_from_rank")
    emulated = [lab04.gpu_index(env, fix=False) for env in lab04.TWO_MACHINES]
    two_nodes = [{"rank": 0, "local_rank": 0, "emulated": emulated, "bare_cuda_tensor": "cuda:0"},
                 {"rank": 1, "local_rank": 0, "emulated": emulated, "bare_cuda_tensor": "cuda:0",
                  "rank_as_gpu_error": "CUDA error: invalid device ordinal"}]
    symptom, verdict = lab04.summarize(two_nodes, False)
    assert symptom and "rank 1 (local rank 0) asked for cuda:1: CUDA error" in verdict, verdict
    emulated = [lab04.gpu_index(env, fix=True) for env in lab04.TWO_MACHINES]
    fixed = [{"rank": r, "local_rank": 0, "emulated": emulated, "bare_cuda_tensor": "cuda:0"}
             for r in (0, 1)]
    assert not lab04.summarize(fixed, True)[0], "one GPU per node: cuda:0 on both is right"
    one_machine = [{**fixed[0]}, {**fixed[1], "local_rank": 1}]
    symptom, verdict = lab04.summarize(one_machine, True)
    assert symptom and "rank 1's tensors landed on cuda:0" in verdict, verdict
    one_gpu = [{**fixed[0]}, {"rank": 1, "local_rank": 1, "emulated": emulated, "gpus_here": 1}]
    symptom, verdict = lab04.summarize(one_gpu, True)
    assert symptom and "rank 1 has LOCAL_RANK 1, but its machine has 1 GPU(s)" in verdict, verdict


@pytest.mark.slow
@needs_gpus(2, "two ranks on two GPUs, to see where a bare 'cuda' lands")
def test_without_set_device_every_rank_lands_on_gpu_0():
    script = f"lessons/{LESSON}/labs/04_device_from_rank.py"
    buggy = run_script(script, launcher="torchrun", nproc=2).data["ranks"]
    fixed = run_script(script, "--fix", launcher="torchrun", nproc=2).data["ranks"]
    assert [r["bare_cuda_tensor"] for r in buggy] == ["cuda:0", "cuda:0"]
    assert [r["bare_cuda_tensor"] for r in fixed] == ["cuda:0", "cuda:1"]


@pytest.mark.task4_2
def test_pick_device_uses_the_local_rank(ex):
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
    too_many = runtime_error_from(
        lambda: ex.pick_device({"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"}, gpu_count=2),
        "LOCAL_RANK=3 on a machine with 2 GPUs")
    missing = [n for n in ("3", "2") if not re.search(rf"\b{n}\b", str(too_many))]
    assert not missing, (
        f"LOCAL_RANK=3 on a machine with 2 GPUs: the error should name both numbers, the "
        f"local rank (3) and the GPU count (2), but {' and '.join(missing)} is missing: "
        f"{too_many}")


# ----------------------------------------------------------------------------- 5 · rank-0 barrier


def test_a_barrier_only_rank_0_calls_times_out(tmp_path):
    began = time.monotonic()
    with pytest.raises(RankError, match="Timed out"):
        run_lab("05_rank0_collective", False, str(tmp_path), pg_timeout=HANG_TIMEOUT,
                timeout=30)
    assert time.monotonic() - began < 20, "the short process-group timeout should end it"


def test_a_barrier_every_rank_calls_lets_training_go_on(tmp_path):
    facts = run_lab("05_rank0_collective", True, str(tmp_path))
    assert_close(torch.tensor(facts[1]["weight"]), torch.tensor(facts[0]["weight"]),
                 "weight after the save and one more step", rank=1)
    assert (tmp_path / "checkpoint.pt").is_file()


def saving_on_rank(ctx, folder: str, as_text: bool = False) -> dict:
    """Call save_on_rank0 with a slow torch.save that records what it writes, and where;
    ``as_text``: pass the path as a str (the contract takes a str or a path-like)."""
    path = Path(folder) / "model.pt"
    torch.manual_seed(0)
    if ctx.rank == 0:
        torch.save(nn.Linear(4, 2).state_dict(), path)  # the previous checkpoint
    dist.barrier()
    torch.manual_seed(1)
    model = DDP(nn.Linear(4, 2))  # the new weights (rank 0's, broadcast by DDP)
    calls = []
    real_save = torch.save

    def slow_save(obj, destination, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        target = destination if isinstance(destination, (str, os.PathLike)) else getattr(
            destination, "name", None)
        calls.append({"target": str(target), "keys": sorted(obj)})
        with contextlib.ExitStack() as stack:
            file = destination
            if isinstance(destination, (str, os.PathLike)):
                file = stack.enter_context(open(destination, "wb"))
            file.write(data[: len(data) // 2])  # a big file takes a while: half now ...
            file.flush()
            time.sleep(0.3)
            calls[-1]["previous_readable_mid_write"] = readable(path)
            file.write(data[len(data) // 2:])  # ... and the rest later

    torch.save = slow_save
    try:
        load_exercise(LESSON).save_on_rank0(model, str(path) if as_text else path)
    finally:
        torch.save = real_save
    read = readable(path)  # what this rank finds right after the call returns
    new = {k: v.clone() for k, v in model.module.state_dict().items()}
    dist.barrier()
    files = sorted(os.listdir(folder))
    del model
    return {"calls": calls, "read": read, "new": new, "files": files}


def readable(path: Path):
    try:
        return torch.load(path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - the error is the finding
        return f"{type(error).__name__}: {str(error)[:120]}"


@pytest.mark.task4_3
@pytest.mark.parametrize("as_text", [False, True], ids=["Path", "str"])
def test_save_on_rank0_writes_once_atomically_and_everyone_waits(tmp_path, as_text):
    try:
        results = run_on_ranks(saving_on_rank, str(tmp_path), as_text,
                               pg_timeout=GRADE_TIMEOUT, timeout=40)
    except RankError as error:
        if "Timed out" not in str(error):
            raise AssertionError(f"save_on_rank0 failed on a rank (if several ranks write the "
                                 f"same file, they race: only rank 0 should write):\n{error}"
                                 ) from None
        raise AssertionError(
            f"save_on_rank0 did not return on every rank within {GRADE_TIMEOUT} s: is "
            f"dist.barrier() inside `if rank == 0`? Every rank must call it.\n{error}") from None
    path = tmp_path / "model.pt"
    writers = [rank for rank, r in enumerate(results) for _ in r["calls"]]
    assert writers == [0], f"torch.save was called on ranks {writers}: only rank 0 should write"
    call = results[0]["calls"][0]
    prefixed = [k for k in call["keys"] if k.startswith("module.")]
    assert not prefixed, f"saved keys {prefixed}: save model.module.state_dict(), not the DDP's"
    assert call["target"] != str(path) and isinstance(call["previous_readable_mid_write"], dict), (
        f"torch.save wrote straight to {path.name}: while it wrote, the previous checkpoint was "
        f"unreadable ({call['previous_readable_mid_write']}); a crash then loses both. Write to a "
        f"temporary file in the same folder, then os.replace it onto the path")
    assert Path(call["target"]).parent == path.parent, (
        f"the temporary file {call['target']} is not in {path.parent}: os.replace is only "
        f"atomic within one file system, so keep it in the checkpoint's folder")
    for rank, r in enumerate(results):
        assert isinstance(r["read"], dict), f"rank {rank} cannot read the checkpoint: {r['read']}"
        try:
            assert_parameters_close(r["read"], r["new"], rank=rank,
                                    what="checkpoint read right after save_on_rank0")
        except AssertionError as error:
            raise AssertionError(
                f"{error}\nrank {rank} read the previous checkpoint: every rank must wait at "
                f"dist.barrier() after rank 0 has written (the barrier outside the if)") from None
        assert r["files"] == ["model.pt"], f"rank {rank}: files left behind: {r['files']}"


# ----------------------------------------------------------------------------- 6 · uneven inputs


def test_uneven_inputs_hang_without_join():
    began = time.monotonic()
    with pytest.raises(RankError, match="Timed out"):
        run_lab("06_uneven_inputs", False, pg_timeout=HANG_TIMEOUT, timeout=30)
    assert time.monotonic() - began < 20, "the short process-group timeout should end it"


def test_join_lets_uneven_ranks_finish_with_equal_weights():
    facts = run_lab("06_uneven_inputs", True)
    assert [f["steps"] for f in facts] == [3, 4], "every rank trains on all its batches"
    assert_close(torch.tensor(facts[1]["weight"]), torch.tensor(facts[0]["weight"]),
                 "final weight after Join", rank=1)


def mse_of_output_and_target(output, target):
    """``nn.functional.mse_loss``, which checks that it is called as ``loss_fn(output, target)``:
    MSE itself is symmetric, the losses a learner passes (cross-entropy) are not."""
    if target.requires_grad or not output.requires_grad:
        raise AssertionError("loss_fn was called as loss_fn(targets, model(inputs)): call it "
                             "as loss_fn(model(inputs), targets), the model's output first")
    return nn.functional.mse_loss(output, target)


def joining_on_rank(ctx) -> dict:
    generator = torch.Generator().manual_seed(ctx.rank)
    batches = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
               for _ in range(2 + 2 * ctx.rank)]
    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = load_exercise(LESSON).train_with_join(model, batches, optimizer,
                                                  mse_of_output_and_target)
    torch.manual_seed(0)
    reference = DDP(nn.Linear(3, 1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with Join([reference]):
        for inputs, targets in batches:
            reference_optimizer.zero_grad()
            nn.functional.mse_loss(reference(inputs), targets).backward()
            reference_optimizer.step()
    return {"steps": steps, "batches": len(batches), "weights": model.module.state_dict(),
            "reference": reference.module.state_dict()}


@pytest.mark.task4_4
def test_train_with_join_trains_every_batch_without_hanging():
    try:
        results = run_on_ranks(joining_on_rank, pg_timeout=GRADE_TIMEOUT, timeout=40)
    except RankError as error:
        raise AssertionError(
            f"the ranks hung (process-group timeout {GRADE_TIMEOUT} s): rank 1 has more batches; "
            f"wrap the loop in Join([model]) so the finished rank answers its all-reduces."
            f"\n{error}") from None
    for rank, r in enumerate(results):
        assert r["steps"] == r["batches"], (
            f"rank {rank} returned {r['steps']} steps for its {r['batches']} batches: train on "
            f"every batch (Join lets the ranks take different numbers of steps)")
    for rank, r in enumerate(results):
        assert_parameters_close(r["weights"], r["reference"], rank=rank,
                                what="weight after train_with_join vs a Join reference")


# ----------------------------------------------------------------------------- 7 · unused params


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_unused_parameters_break_ddp_until_declared(fix):
    facts = run_lab("07_unused_parameters", fix, steps=3)
    if fix:
        weights = {tuple(f[option][1]) for f in facts for option in lab("07_unused_parameters")
                   .FIXES}
        assert len(weights) == 1, "every fix trains the same weights on every rank"
    else:
        for f in facts:
            assert f["error"] and "Expected to have finished reduction" in f["error"], (
                f"rank {f['rank']}: {f['error']}")


# ----------------------------------------------------------------------------- 8 · model.module


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_calling_model_module_skips_the_gradient_all_reduce(fix):
    facts = run_lab("08_module_forward", fix)
    gradients = [torch.tensor(f["first_gradient"]) for f in facts]
    weights = [torch.tensor(f["weight"]) for f in facts]
    if fix:
        assert_close(gradients[1], gradients[0], "first gradient", rank=1)
        assert_close(weights[1], weights[0], "weight after training", rank=1)
    else:
        assert (gradients[1] - gradients[0]).abs().max() > 1e-3, "each rank kept its own gradient"
        assert (weights[1] - weights[0]).abs().max() > 1e-3, "the copies drifted apart"


# ----------------------------------------------------------------------------- 9 · checkpoints


def test_checkpoint_mistakes_show_their_symptoms(tmp_path):
    facts = run_lab("09_checkpoints", False, str(tmp_path))
    assert facts[0]["writers"] == 2, "every rank wrote the same file"
    assert facts[1]["early_read"].startswith("FileNotFoundError"), facts[1]["early_read"]
    for f in facts:
        assert "module.weight" in f["prefix"], f"rank {f['rank']}: {f['prefix']}"
        where = "cuda:0" if torch.cuda.is_available() else "on a CUDA device"
        assert where in f["map_location"], f"rank {f['rank']}: {f['map_location']}"
        assert f["crash_save"].startswith("SimulatedCrash")
        assert not f["crash"].startswith("ok"), "the crash destroyed the previous checkpoint"


def test_checkpoint_fixes_remove_them(tmp_path):
    facts = run_lab("09_checkpoints", True, str(tmp_path))
    assert facts[0]["writers"] == 1, "only rank 0 wrote"
    for f in facts:
        for scene in ("early_read", "prefix", "crash"):
            assert f[scene] == "ok", f"rank {f['rank']}, {scene}: {f[scene]}"
        assert f["map_location"] == "ok (tensors on cpu)", f["map_location"]
        assert f["crash_save"].startswith("SimulatedCrash"), "the crash did happen"


@pytest.mark.task4_5
def test_load_checkpoint_maps_devices_and_strips_prefixes(ex, tmp_path, monkeypatch):
    torch.manual_seed(0)
    trained = nn.Linear(4, 2)
    path = tmp_path / "ddp.pt"
    with lab("09_checkpoints").written_on_cuda0():  # as saved by a process on cuda:0
        torch.save({f"module.{k}": v for k, v in trained.state_dict().items()}, path)
    seen = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        seen.append(kwargs.get("map_location", args[1] if len(args) > 1 else None))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    try:
        model = ex.load_checkpoint(path, nn.Linear(4, 2), torch.device("cpu"))
    except NotImplementedError:
        raise
    except RuntimeError as error:
        if "CUDA" in str(error):
            raise AssertionError(f"torch.load without map_location put the tensors back on "
                                 f"cuda:0: pass map_location=device. ({error})") from None
        raise AssertionError(f"loading a DDP checkpoint failed: strip the leading 'module.' "
                             f"from every key. ({' '.join(str(error).split())[:300]})") from None
    assert seen and seen[0] is not None, "call torch.load with map_location=device"
    assert isinstance(model, nn.Module), "return the model"
    assert_parameters_close(model, trained, what="loaded parameter")


@pytest.mark.task4_5
def test_load_checkpoint_accepts_plain_keys_and_rejects_wrong_ones(ex, tmp_path):
    torch.manual_seed(0)
    trained = nn.Linear(4, 2)
    plain = tmp_path / "plain.pt"
    torch.save(trained.state_dict(), plain)
    try:
        loaded = ex.load_checkpoint(plain, nn.Linear(4, 2), torch.device("cpu"))
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(
            f"loading a plain checkpoint (keys 'weight', 'bias', no 'module.') failed: remove "
            f"the prefix only from keys that start with it, key.removeprefix('module.'). "
            f"({type(error).__name__}: {' '.join(str(error).split())[:300]})") from None
    assert_parameters_close(loaded, trained, what="parameter loaded from a plain checkpoint")
    wrong = tmp_path / "wrong.pt"
    torch.save({"module.weight": trained.weight.detach()}, wrong)  # no bias
    error = runtime_error_from(lambda: ex.load_checkpoint(wrong, nn.Linear(4, 2),
                                                          torch.device("cpu")),
                               "load_state_dict is strict: a missing 'bias' is an error")
    assert "bias" in str(error), f"the error should name the missing key: {error}"


CODE_RAN: list[str] = []  # what the checkpoint below ran when it was unpickled


def code_run_by_unpickling(state: dict) -> dict:
    CODE_RAN.append("ran")
    return state


class RunsCodeWhenLoaded:
    """Pickled as a call to code_run_by_unpickling: any function a file names runs when
    ``torch.load(..., weights_only=False)`` unpickles it."""

    def __init__(self, state: dict):
        self.state = state

    def __reduce__(self):
        return code_run_by_unpickling, (self.state,)


@pytest.mark.task4_5
def test_load_checkpoint_refuses_a_checkpoint_that_runs_code(ex, tmp_path):
    torch.manual_seed(0)
    state = {f"module.{k}": v for k, v in nn.Linear(4, 2).state_dict().items()}
    path = tmp_path / "runs_code.pt"
    torch.save(RunsCodeWhenLoaded(state), path)
    CODE_RAN.clear()
    try:
        ex.load_checkpoint(path, nn.Linear(4, 2), torch.device("cpu"))
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001 - refusing the file, however it says so, is right
        refused = True
    else:
        refused = False
    assert not CODE_RAN, (
        "load_checkpoint ran a function named in the checkpoint file: torch.load with "
        "weights_only=False unpickles anything, and unpickling can call any function. Pass "
        "weights_only=True: it loads tensors and plain containers only")
    assert refused, ("load_checkpoint loaded a checkpoint holding more than tensors and plain "
                     "containers: torch.load(..., weights_only=True) refuses it")


@pytest.mark.task4_5
def test_load_checkpoint_rejects_an_unexpected_key(ex, tmp_path):
    torch.manual_seed(0)
    trained = nn.Linear(4, 2)
    extra = tmp_path / "extra.pt"
    torch.save({**{f"module.{k}": v for k, v in trained.state_dict().items()},
                "module.scale": torch.ones(2)}, extra)
    error = runtime_error_from(
        lambda: ex.load_checkpoint(extra, nn.Linear(4, 2), torch.device("cpu")),
        "load_state_dict is strict: an unexpected key 'scale' is an error too (a checkpoint "
        "of another model)")
    assert "scale" in str(error), f"the error should name the unexpected key 'scale': {error}"


class Wrapper(nn.Module):
    """A model whose own submodule is called ``module``: its plain keys start with 'module.'."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 2)


@pytest.mark.task4_5
def test_load_checkpoint_strips_only_the_leading_prefix(ex, tmp_path):
    torch.manual_seed(0)
    trained = Wrapper()
    path = tmp_path / "ddp_of_wrapper.pt"
    torch.save({f"module.{k}": v for k, v in trained.state_dict().items()}, path)
    try:
        loaded = ex.load_checkpoint(path, Wrapper(), torch.device("cpu"))
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(
            f"loading the DDP checkpoint of a model whose own submodule is called 'module' "
            f"(keys {sorted(f'module.{k}' for k in trained.state_dict())}) failed: strip the "
            f"leading 'module.' once, not every 'module.' in the key: "
            f"key.removeprefix('module.'). ({type(error).__name__}: "
            f"{' '.join(str(error).split())[:300]})") from None
    assert_parameters_close(loaded, trained, what="parameter of a model with a submodule "
                                                  "called 'module'")


# ----------------------------------------------------------------------------- 10 · no_sync


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_accumulation_all_reduces_every_micro_step_without_no_sync(fix):
    facts = run_lab("10_no_sync", fix, k=4)
    for f in facts:
        assert f["sync_rounds"] == (1 if fix else 4), (
            f"rank {f['rank']}: every gradient was all-reduced {f['sync_rounds']:g} times")
        assert f["gap_to_full_batch"] < 1e-5, "either way the accumulated gradient is right"
        if fix:  # the half-fix: only backward() inside no_sync(), the forward outside
            half = f["backward_only"]
            assert half["sync_rounds"] == 4, (
                f"rank {f['rank']}: with the forward outside no_sync() every gradient was "
                f"all-reduced {half['sync_rounds']:g} times, the lesson says 4")
            assert half["gap_to_full_batch"] < 1e-5


ACCUMULATION_GROUPS = group_params(world_sizes=(2,), cuda_world_sizes=(2,),
                                   nccl_world_sizes=(2,))


def accumulating_on_rank(ctx, k: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # compared with a CPU run
    lab10 = lab("10_no_sync")
    model = DDP(lab10.make_model().to(ctx.device),
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    counter = {"buckets": 0, "elements": 0}
    model.register_comm_hook(None, lab10.counting_hook(counter))
    # Whether no_sync() was on at each forward (where DDP decides whether the next backward
    # all-reduces) and at each backward (once the first parameter's gradient is in).
    synced = {"forward": [], "backward": []}
    model.register_forward_pre_hook(
        lambda module, args: synced["forward"].append(module.require_backward_grad_sync))
    next(model.module.parameters()).register_post_accumulate_grad_hook(
        lambda param: synced["backward"].append(model.require_backward_grad_sync))
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in lab10.micro_batches(ctx.rank, k)]
    load_exercise(LESSON).accumulate_gradients(model, batches, mse_of_output_and_target)
    parameters = sum(p.numel() for p in model.parameters())
    return {"gradients": {n: p.grad for n, p in model.module.named_parameters()},
            "rounds": counter["elements"] / parameters, **synced}


def accumulation_problem(r: dict, k: int) -> str:
    """Why DDP did not all-reduce every gradient exactly once over the k micro-batches."""
    rounds, forward, backward = r["rounds"], r["forward"], r["backward"]
    armed_early = [i for i, (armed, syncs) in enumerate(zip(forward, backward, strict=False))
                   if armed and not syncs]
    if rounds > 1 and armed_early:
        return (f"DDP all-reduced every gradient {rounds:g} times for {k} micro-batches: the "
                f"forward ran outside no_sync(): DDP armed the all-reduce in forward (it reads "
                f"require_backward_grad_sync there), so the backward inside no_sync() still "
                f"all-reduced (micro-batches {armed_early}). Run the forward and the backward "
                f"of all but the last micro-batch inside `with model.no_sync():`")
    if rounds > 1:
        return (f"DDP all-reduced every gradient {rounds:g} times for {k} micro-batches; "
                f"expected once: run the forward and the backward of all but the last "
                f"micro-batch inside `with model.no_sync():`")
    if rounds == 0 and forward and not forward[-1] and backward and backward[-1]:
        return ("no gradient was all-reduced: the last micro-batch's forward ran inside "
                "no_sync(), and DDP decides in forward whether the backward all-reduces. Run "
                "the last micro-batch's forward and backward outside no_sync()")
    if rounds == 0:
        return ("no gradient was all-reduced: the last micro-batch (forward and backward) must "
                "run outside no_sync(), so that its backward all-reduces the accumulated sum")
    if rounds != 1:
        return f"DDP all-reduced {rounds:g} of every gradient's elements; expected all, once"
    return ""


@pytest.mark.task4_6
@pytest.mark.parametrize("group", ACCUMULATION_GROUPS)
def test_accumulate_gradients_syncs_once_and_equals_the_full_batch(group):
    world, backend, device = group
    k = 4
    lab10 = lab("10_no_sync")
    results = run_on_ranks(accumulating_on_rank, k, world_size=world, backend=backend,
                           device=device)
    reference = lab10.make_model()
    everything = [b for r in range(world) for b in lab10.micro_batches(r, k)]
    inputs, targets = (torch.cat(parts) for parts in zip(*everything, strict=True))
    nn.functional.mse_loss(reference(inputs), targets).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for rank, r in enumerate(results):
        problem = accumulation_problem(r, k)
        assert not problem, f"rank {rank}: {problem}"
        assert_parameters_close(r["gradients"], expected, rank=rank,
                                what="accumulated gradient vs one process on the full batch "
                                     "(divide each micro-batch loss by k)")


EARLIER_GRADIENT = 0.25  # what the caller's earlier backwards left in every .grad, on every rank


def accumulating_onto_earlier_gradients(ctx, k: int) -> dict:
    lab10 = lab("10_no_sync")
    model = DDP(lab10.make_model())
    for p in model.parameters():
        p.grad = torch.full_like(p, EARLIER_GRADIENT)
    weights = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    load_exercise(LESSON).accumulate_gradients(model, lab10.micro_batches(ctx.rank, k),
                                               mse_of_output_and_target)
    return {"gradients": {n: p.grad for n, p in model.module.named_parameters()},
            "weights_before": weights,
            "weights_after": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


@pytest.mark.task4_6
def test_accumulate_gradients_neither_zeroes_nor_steps():
    k = 4
    results = run_on_ranks(accumulating_onto_earlier_gradients, k)
    lab10 = lab("10_no_sync")
    reference = lab10.make_model()
    everything = [b for r in range(len(results)) for b in lab10.micro_batches(r, k)]
    inputs, targets = (torch.cat(parts) for parts in zip(*everything, strict=True))
    nn.functional.mse_loss(reference(inputs), targets).backward()
    for rank, r in enumerate(results):
        for name, before in r["weights_before"].items():
            assert torch.equal(r["weights_after"][name], before), (
                f"rank {rank}: accumulate_gradients changed the weight {name!r}: do not step, "
                f"the caller steps once the gradients are accumulated")
        for name, p in reference.named_parameters():
            got = r["gradients"][name]
            assert got is not None, f"rank {rank}: {name!r} has no gradient after the call"
            if torch.allclose(got, p.grad, rtol=1e-4, atol=1e-6):
                raise AssertionError(
                    f"rank {rank}: the gradient of {name!r} holds only this call's micro-batches: "
                    f"what the caller had accumulated before ({EARLIER_GRADIENT} in every "
                    f"element) is gone. Do not zero the gradients: the caller does, before its "
                    f"first micro-batch")
            assert_close(got, p.grad + EARLIER_GRADIENT,
                         f"gradient of {name!r}: the caller's earlier gradient plus this call's",
                         rank=rank)


# ----------------------------------------------------------------------------- 11 · sum loss


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_a_summed_loss_shrinks_the_gradient_by_the_world_size(fix):
    facts = run_lab("11_sum_loss", fix)
    for f in facts:
        expected = 1.0 if fix else 1 / f["world_size"]
        assert f["ratio"] == pytest.approx(expected, rel=1e-5), (
            f"rank {f['rank']}: DDP gradient / one-GPU gradient = {f['ratio']}, "
            f"expected {expected} with reduction={f['reduction']!r}")


# ----------------------------------------------------------------------------- 12 · random state


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_equal_seeds_repeat_augmentation_and_unbroadcast_models_differ(fix):
    facts = run_lab("12_random_state", fix)
    same_augmentation = facts[0]["augmentation"] == facts[1]["augmentation"]
    same_weights = facts[0]["weights"] == facts[1]["weights"]
    assert same_augmentation is not fix, "equal seeds: the same crops on every rank"
    assert same_weights is fix, "without a broadcast the hand-written DDP copies never agree"


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_dataloader_workers_repeat_across_ranks_seeded_alike(fix):
    lab12 = lab("12_random_state")
    with torch.random.fork_rng():  # the lab seeds the global generator
        draws = [lab12.worker_draws(rank, fix, workers=2) for rank in (0, 1)]
    assert (draws[0] == draws[1]) is not fix, f"worker draws of ranks 0 and 1: {draws}"
    assert len(set(draws[0])) == len(draws[0]), "within a rank, the workers differ"


def broadcasting_on_rank(ctx, src: int) -> dict:
    torch.manual_seed(10 + ctx.rank)  # a different model on every rank
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].num_batches_tracked += ctx.rank + 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if src is None:  # the default: rank 0's state
        load_exercise(LESSON).broadcast_initial_state(model)
    else:
        load_exercise(LESSON).broadcast_initial_state(model, src=src)
    return {"before": before, "after": model.state_dict(),
            "buffers": [name for name, _ in model.named_buffers()]}


@pytest.mark.task4_7
@pytest.mark.parametrize("src", [0, 1, None], ids=["src=0", "src=1", "default"])
def test_broadcast_initial_state_copies_parameters_and_buffers(src):
    try:
        results = run_on_ranks(broadcasting_on_rank, src, pg_timeout=GRADE_TIMEOUT, timeout=40)
    except RankError as error:
        if "Timed out" not in str(error):
            raise
        raise AssertionError(
            f"the ranks hung in broadcast_initial_state(model, src={src}) (process-group "
            f"timeout {GRADE_TIMEOUT} s): every rank must call dist.broadcast with the same src, "
            f"the rank whose values everyone copies (src=src, not dist.get_rank()), and the "
            f"same tensors in the same order.\n{error}") from None
    source = results[src or 0]["before"]
    called = "without src (the default is rank 0)" if src is None else f"from rank {src}"
    for rank, r in enumerate(results):
        for name, tensor in source.items():
            kind = "buffer" if name in r["buffers"] else "parameter"
            assert_close(r["after"][name], tensor, f"{kind} {name} after broadcasting {called}",
                         rank=rank)


def broadcasting_in_place_on_rank(ctx, src: int) -> dict:
    torch.manual_seed(10 + ctx.rank)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    held = model.state_dict(keep_vars=True)  # the very tensors (an optimizer holds the same)
    before = {k: v.detach().clone() for k, v in held.items()}
    load_exercise(LESSON).broadcast_initial_state(model, src=src)
    now = model.state_dict(keep_vars=True)
    return {"before": before, "held_after": {k: v.detach().clone() for k, v in held.items()},
            "replaced": [k for k in held if now[k] is not held[k]],
            "buffers": [name for name, _ in model.named_buffers()]}


@pytest.mark.task4_7
def test_broadcast_initial_state_writes_into_the_models_own_tensors():
    results = run_on_ranks(broadcasting_in_place_on_rank, 1, pg_timeout=GRADE_TIMEOUT,
                           timeout=40)
    source = results[1]["before"]
    for rank, r in enumerate(results):
        for name, tensor in source.items():
            kind = "buffer" if name in r["buffers"] else "parameter"
            if not torch.equal(r["held_after"][name], tensor):
                replaced = (f" (the model now holds another tensor as {name})"
                            if name in r["replaced"] else "")
                raise AssertionError(
                    f"rank {rank}: the tensor that was the model's {kind} {name} before the "
                    f"call does not hold rank 1's values after it{replaced}: broadcast into "
                    f"the model's own tensors, in place (dist.broadcast(tensor, src) "
                    f"overwrites tensor); an optimizer built before the call holds them")


# ----------------------------------------------------------------------------- 13 · BatchNorm


def test_batchnorm_statistics_are_per_rank():
    facts = run_lab("13_batchnorm", False)
    spread = (torch.tensor(facts[0]["running_mean"]) -
              torch.tensor(facts[1]["running_mean"])).abs().max()
    assert spread > 0.01, "each rank's running mean comes from its own data"
    assert all(f["gradient_gap"] > 1e-3 for f in facts), (
        "with BatchNorm, DDP's gradient is not one GPU's on the global batch")


def test_syncbatchnorm_fix_says_it_needs_gpus_on_the_cpu():
    facts = run_lab("13_batchnorm", True)
    assert "needs CUDA" in facts[0]["skipped"]


@needs_gpus(2, "SyncBatchNorm on nccl")
def test_syncbatchnorm_shares_statistics_across_ranks():
    facts = run_lab("13_batchnorm", True, world_size=2, backend="nccl", device="cuda")
    assert_close(torch.tensor(facts[1]["running_mean"]), torch.tensor(facts[0]["running_mean"]),
                 "SyncBatchNorm running mean", rank=1)
    for f in facts:
        assert f["running_mean_gap"] < 1e-5 and f["gradient_gap"] < 1e-4, (
            f"rank {f['rank']}: SyncBatchNorm should match one process on the global batch: {f}")


# ----------------------------------------------------------------------------- 15 · printing


@pytest.mark.parametrize("fix", [False, True], ids=["symptom", "fix"])
def test_progress_printed_by_rank_0_only(fix):
    facts = run_lab("15_print_once", fix)
    assert len(facts[0]["printed"]) == 3
    assert bool(facts[1]["printed"]) is not fix, f"rank 1 printed {facts[1]['printed']}"


# ----------------------------------------------------------------------------- launches
# Every real launch of this lesson (the notebook lab, the printing lab under torchrun, the
# doctor), started together: most of a launch is Python importing torch, which overlaps well.
# They start before the module's first test (start_launches_first), so that their imports also
# overlap the pooled checks' waits on a short process-group timeout.

NOTEBOOK_LAB = f"lessons/{LESSON}/labs/14_notebooks.py"


start_launches_first = start_first("launches")  # while the other checks run


@pytest.fixture(scope="module")
def launches():
    runs = {
        "notebook": start_script(NOTEBOOK_LAB, timeout=120),
        "notebook --fix": start_script(NOTEBOOK_LAB, "--fix", timeout=120),
        "printing": start_script(f"lessons/{LESSON}/labs/15_print_once.py", launcher="torchrun",
                                 nproc=2),
        "doctor": start_script(DOCTOR, "--timeout", "30", "--sizes", "1,4", launcher="torchrun",
                               nproc=2),
        "doctor, python": start_script(DOCTOR, "--timeout", "30"),
        "doctor, stall": start_script(DOCTOR, "--timeout", "5", "--simulate-stall", "1",
                                      launcher="torchrun", nproc=2, check=False, timeout=90),
        "doctor, crash": start_script(DOCTOR, "--timeout", "30", "--simulate-crash", "1",
                                      launcher="torchrun", nproc=2, check=False, timeout=90),
        # One process stuck where no torch timeout applies: only the doctor's deadline helps.
        "doctor, stuck alone": start_script(DOCTOR, "--timeout", "1", "--simulate-stall", "0",
                                            check=False, timeout=90),
    }
    yield runs
    for run in runs.values():
        run.stop()


@pytest.mark.slow
def test_a_notebook_cell_cannot_spawn_or_init_alone(launches):
    data = launches["notebook"].result().data
    assert data["spawn"]["returncode"] != 0
    assert "Can't get attribute 'work'" in data["spawn"]["error"], data["spawn"]
    assert "Timed out" in data["init"] and "1/2 clients" in data["init"], data["init"]
    assert data["symptom"]


@pytest.mark.slow
def test_a_notebook_can_launch_a_guarded_script_with_torchrun(launches):
    data = launches["notebook --fix"].result().data
    assert data["launch"]["returncode"] == 0, data["launch"]
    assert "2 ranks trained; all-reduce gave 3" in data["launch"]["output"]


@pytest.mark.slow
def test_under_torchrun_every_rank_prints(launches):
    run = launches["printing"].result()
    for rank in (0, 1):
        steps = [line for line in run.rank_lines(rank) if "step" in line and "loss" in line]
        assert len(steps) == 3, f"rank {rank} printed {steps}"
    assert run.data["symptom"]


@pytest.mark.slow
def test_doctor_passes_on_a_healthy_group(launches):
    run = launches["doctor"].result()
    data = run.data
    assert data["ok"] and data["verdict"].startswith("OK"), data.get("verdict")
    assert data["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    for step in ("ranks and devices", "barrier", "all-reduce (value check)"):
        assert step in data["steps"], f"step {step!r} missing: {sorted(data['steps'])}"
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert [b["megabytes"] for b in data["bandwidth"]] == [1, 4]
    assert all(b["busbw_GBps"] > 0 for b in data["bandwidth"])
    assert not any("verdict" in line for line in run.rank_lines(1)), "rank 0 reports"


@pytest.mark.slow
def test_doctor_runs_as_one_process_without_a_launcher(launches):
    data = launches["doctor, python"].result().data
    assert data["ok"] and [r["rank"] for r in data["ranks"]] == [0]
    assert "bandwidth" not in data, "one rank has nobody to measure bandwidth with"
    assert data["environment"]["torch"] == torch.__version__
    packages = data["environment"]["packages"]
    assert packages["numpy"] != "missing" and packages["pytest"] != "missing", packages


def test_doctor_names_a_missing_package_and_the_fix(monkeypatch):
    doctor = load_lesson_module(LESSON, "doctor")
    real_version = doctor.importlib.metadata.version

    def version(name):
        if name == "numpy":
            raise doctor.importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(doctor.importlib.metadata, "version", version)
    found, problems = doctor.packages()
    assert found["numpy"] == "missing"
    assert problems == [f"numpy is missing ({doctor.NEEDED_PACKAGES['numpy']})"], problems


@pytest.mark.slow
def test_doctor_names_a_stalled_rank_instead_of_hanging(launches):
    run = launches["doctor, stall"].result()  # within its 90 s limit, or LaunchError
    assert run.returncode != 0
    assert run.data["failed_step"] == "barrier" and run.data["kind"] == "hang", run.data
    assert "rank(s) 1" in run.data["verdict"], run.data["verdict"]
    assert any("verdict: HANG" in line for line in run.rank_lines(0)), run.output[-2000:]
    # One line per rank: only rank 0 gives the verdict and the next steps.
    other = [line for line in run.rank_lines(1) if "[FAIL]" in line or "next steps" in line
             or "verdict" in line]
    assert len(other) == 1 and "[FAIL] barrier" in other[0], other


@pytest.mark.slow
def test_doctor_names_the_step_where_a_rank_crashed(launches):
    run = launches["doctor, crash"].result()
    assert run.returncode != 0
    assert any("simulating a crash" in line for line in run.rank_lines(1))
    verdicts = [line for line in run.rank_lines(0) if "verdict:" in line]
    assert verdicts and "all-reduce" in verdicts[0], run.output[-2000:]
    assert any(kind in verdicts[0] for kind in ("CRASH", "STOPPED")), verdicts[0]


@pytest.mark.slow
def test_doctor_gives_up_on_a_step_past_its_deadline(launches):
    run = launches["doctor, stuck alone"].result()
    assert run.returncode != 0
    assert run.data["failed_step"] == "barrier" and run.data["kind"] == "hang", run.data
    assert "no answer within 3 s" in run.data["verdict"], run.data["verdict"]
    # Before it gives up, the stack of every thread: the stuck one is in the barrier step.
    stacks = run.output[run.output.index("most recent call first"):]
    assert "in simulate" in stacks and "in barrier" in stacks, run.output[-3000:]


@pytest.mark.slow
@needs_gpus(1, "the doctor's CUDA checks: NCCL, devices, peer-to-peer")
def test_doctor_checks_the_gpus():
    nproc = min(2, torch.cuda.device_count())
    data = run_script(DOCTOR, "--timeout", "60", "--sizes", "8", launcher="torchrun",
                      nproc=nproc).data
    assert data["ok"] and data["backend"] == "nccl", data.get("verdict")
    assert data["environment"]["nccl"][0].isdigit(), data["environment"]["nccl"]
    assert [r["device"] for r in data["ranks"]] == [f"cuda:{i}" for i in range(nproc)]
    if torch.cuda.device_count() >= 2:
        assert len(data["p2p"]) == torch.cuda.device_count()
