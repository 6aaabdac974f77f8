"""Lesson 01, task1_3 and task1_4: replicate makes independent copies of the model, in its mode
and without gradients; gather joins the replicas' outputs in order, still part of their graphs.

    pytest lessons/01_data_parallel -m task1_3
    pytest lessons/01_data_parallel -m task1_4
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import task_of

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task1_3": {
        "num_replicas copies": ["test_replicate_makes_independent_copies"],
        "the same structure, parameter and buffer values": [
            "test_replicate_makes_independent_copies"],
        "the same training mode as model": ["test_replicate_makes_independent_copies"],
        "its own tensors: no replica is model itself": [
            "test_replicate_makes_independent_copies"],
        "every replica starts with no gradients": ["test_replicate_makes_independent_copies"],
    },
    "task1_4": {
        "join the outputs in replica order, along dim 0": [
            "test_gather_joins_in_order_and_keeps_the_graph"],
        "stay connected to the autograd graph of every output": [
            "test_gather_joins_in_order_and_keeps_the_graph"],
    },
}


# --------------------------------------------------------------------------------------------
# task1_3: replicate


def model_with_buffers_and_grads(training: bool) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(3))).sum().backward()
    return model.train(training)


@pytest.mark.task1_3
@pytest.mark.parametrize("training", [True, False], ids=["train mode", "eval mode"])
def test_replicate_makes_independent_copies(ex, training):
    """replicate(model, 3) gives 3 copies of a model with BatchNorm and gradients, in train and in
    eval mode: the same type, mode, parameter and buffer values; no tensor sharing memory with the
    model or another replica; every parameter requiring grad, with no gradient."""
    model = model_with_buffers_and_grads(training)
    replicas = ex.replicate(model, 3)
    assert len(replicas) == 3, f"replicate(model, 3) returned {len(replicas)} replicas"
    model_tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    seen_storage = {t.data_ptr(): f"the model's {name!r}" for name, t in model_tensors.items()}
    for i, replica in enumerate(replicas):
        assert replica is not model, (
            f"replica {i} is the model itself; every replica must be a copy, or its gradients "
            f"would be counted twice when they are summed back into the model"
        )
        assert type(replica) is type(model), f"replica {i} is a {type(replica).__name__}"
        assert replica.training == model.training, (
            f"replica {i} has training={replica.training}, the model {model.training}: a "
            f"replica runs in the model's mode (copy.deepcopy keeps it; do not call .train() "
            f"or .eval() on the replicas)"
        )
        assert_parameters_close(replica, model, f"replica {i}'s parameter")
        assert_parameters_close(dict(replica.named_buffers()), dict(model.named_buffers()),
                                f"replica {i}'s buffer")
        for name, tensor in {**dict(replica.named_parameters()),
                             **dict(replica.named_buffers())}.items():
            owner = seen_storage.get(tensor.data_ptr())
            assert owner is None, (
                f"replica {i}'s {name!r} shares memory with {owner}: each replica needs its own "
                f"copy (copy.copy shares; copy.deepcopy copies)"
            )
            seen_storage[tensor.data_ptr()] = f"replica {i}'s {name!r}"
        for name, param in replica.named_parameters():
            assert param.requires_grad, f"replica {i}'s {name!r} does not require grad"
            assert param.grad is None, (
                f"replica {i}'s {name!r} already has a gradient; a fresh replica has none, or "
                f"summing the replicas' gradients would add the model's old gradient again"
            )


# --------------------------------------------------------------------------------------------
# task1_4: gather


@pytest.mark.task1_4
@pytest.mark.parametrize("sizes", [[4, 4, 2], [3, 3, 3], [5]], ids=str)
def test_gather_joins_in_order_and_keeps_the_graph(ex, sizes):
    """gather joins outputs of chunks [4, 4, 2], [3, 3, 3] and [5] along dim 0 in replica order, and
    a backward from the result brings each output its own slice of the gradient."""
    g = torch.Generator().manual_seed(4)
    leaves = [torch.randn(size, 3, generator=g, requires_grad=True) for size in sizes]
    outputs = [leaf * 2.0 for leaf in leaves]  # like a replica's output: part of a graph
    shapes = [tuple(o.shape) for o in outputs]
    expected = torch.cat([o.detach() for o in outputs])
    try:
        gathered = ex.gather(outputs)
    except Exception as err:
        if task_of(err):  # the untouched stub: reported as "not attempted yet"
            raise
        pytest.fail(f"gather(outputs of shapes {shapes}) raised {type(err).__name__}: "
                    f"{str(err).splitlines()[0]}; join the outputs along dim 0 (the batch "
                    f"dimension), one replica's rows after the other's: torch.cat(outputs, dim=0)")
    if isinstance(gathered, torch.Tensor) and gathered.shape != expected.shape:
        stacked = "torch.stack adds a new dimension; " if gathered.dim() == expected.dim() + 1 \
            else ""
        pytest.fail(f"gather(outputs of shapes {shapes}) has shape {tuple(gathered.shape)}, "
                    f"expected {tuple(expected.shape)}: {stacked}join the outputs along dim 0 "
                    f"(the batch dimension), one replica's rows after the other's")
    assert_close(gathered, expected,
                 f"gathered outputs of chunks {sizes} (replica 0's rows first, then replica 1's)")
    assert gathered.grad_fn is not None, (
        "the gathered output is cut off from the replicas' graphs (it has no grad_fn): a "
        "backward from the loss could not reach the replicas. Do not detach or rebuild it."
    )
    weights = torch.randn(expected.shape, generator=g)
    (gathered * weights).sum().backward()
    start = 0
    for i, (leaf, size) in enumerate(zip(leaves, sizes, strict=True)):
        assert leaf.grad is not None, f"no gradient reached replica {i}'s output"
        assert_close(leaf.grad, 2.0 * weights[start:start + size],
                     f"gradient that reached replica {i}'s output")
        start += size
