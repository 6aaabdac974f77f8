"""Lesson 04, task4_1: ``exact_accuracy`` on lab 03's validation set, on pooled ranks: the
accuracy counted once per sample (no sampler padding, counts all-reduced, not accuracies
averaged), each rank evaluating its strided shard only, with one all_reduce, under no_grad.

    pytest lessons/04_pitfalls -m task4_1
"""

from __future__ import annotations

import pytest
import torch

from harness.collectives import CollectiveLog
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from lesson04.common import LESSON, TRUE_ACCURACY, lab

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
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
}


def exact_accuracy_on_rank(ctx):
    model, dataset = lab("03_padded_eval").validation_set()
    evaluated = [0]  # samples this rank's model saw

    def count(module, args):
        evaluated[0] += len(args[0])

    model.register_forward_pre_hook(count)
    accuracy = load_exercise(LESSON).exact_accuracy(model, dataset, batch_size=4)
    return {"accuracy": accuracy, "evaluated": evaluated[0], "samples": len(dataset)}


@pytest.mark.task4_1
def test_exact_accuracy_counts_every_sample_once(ex):
    """On 2 gloo ranks, every rank returns the float 8/11 for lab 03's 11 samples (not 8/12 from
    padding, the mean of the ranks' accuracies, or one shard's), and each rank's model evaluates as
    many samples as its own shard holds."""
    raise_if_untouched(ex.exact_accuracy)  # not attempted: no ranks
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
def test_exact_accuracy_evaluates_the_strided_shard(ex):
    """On 2 gloo ranks, rank r's model sees exactly the samples `range(r, 11, 2)` of lab 03's 11
    (each input scaled by its index plus one, which leaves the predictions alone, tells which)."""
    raise_if_untouched(ex.exact_accuracy)  # not attempted: no ranks
    results = run_on_ranks(exact_accuracy_seen_on_rank)
    world = len(results)
    for rank, result in enumerate(results):
        shard = list(range(rank, result["size"], world))
        assert sorted(result["samples"]) == shard, (
            f"rank {rank} evaluated samples {sorted(result['samples'])}; its shard is "
            f"range({rank}, {result['size']}, {world}) = {shard}: rank r evaluates samples r, "
            f"r + W, r + 2W, ... (Subset(dataset, range(rank, len(dataset), world_size)))")


@pytest.mark.task4_1
def test_exact_accuracy_adds_the_counts_with_one_all_reduce(ex):
    """On 2 gloo ranks, `exact_accuracy` calls exactly one collective, a single `all_reduce` for
    both sums, as a log of its calls to torch.distributed records."""
    raise_if_untouched(ex.exact_accuracy)  # not attempted: no ranks
    results = run_on_ranks(exact_accuracy_seen_on_rank)
    for rank, result in enumerate(results):
        assert result["collectives"] == ["all_reduce"], (
            f"rank {rank}: exact_accuracy ran {result['collectives'] or 'no collective'}; "
            f"expected one all_reduce of one tensor holding both sums, correct predictions "
            f"and samples (torch.tensor([correct, total])): one round trip, not one per number")


@pytest.mark.task4_1
def test_exact_accuracy_evaluates_under_no_grad(ex):
    """On 2 gloo ranks, every forward of the model inside `exact_accuracy` runs with gradients
    disabled."""
    raise_if_untouched(ex.exact_accuracy)  # not attempted: no ranks
    results = run_on_ranks(exact_accuracy_seen_on_rank)
    for rank, result in enumerate(results):
        recording = sum(result["grad_enabled"])
        assert not recording, (
            f"rank {rank}: {recording} of the model's {len(result['grad_enabled'])} forwards "
            f"ran with gradients enabled, so autograd kept a graph (and its activations) for "
            f"every batch: evaluate under `with torch.no_grad():`")
