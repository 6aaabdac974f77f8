"""Lesson 01, task1_5 and task1_6: the replicas' gradients summed into the model
(reduce_gradients_into), and a whole data-parallel step that leaves the gradients and the loss
one device would (data_parallel_step), on even and uneven chunks.

    pytest lessons/01_data_parallel -m task1_5
    pytest lessons/01_data_parallel -m task1_6
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import task_of
from lesson01.common import TinyNet, chunk_sizes, clear_call_record, make_batch, seen_batch_sizes

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task1_5": {
        "add the sum of the replicas' gradients into master's gradients": [
            "test_reduce_gradients_sums_into_the_master"],
        "where a master parameter has no gradient yet it becomes the sum": [
            "test_reduce_gradients_sums_into_the_master"],
        "where it has one, the sum is added to it": ["test_reduce_gradients_sums_into_the_master"],
        "a parameter that no replica has a gradient for is left as it is": [
            "test_reduce_gradients_sums_into_the_master"],
        "do not change the replicas": ["test_reduce_gradients_sums_into_the_master"],
    },
    "task1_6": {
        "run replica i on chunk i (model itself never sees the whole batch)": [
            "test_data_parallel_step_equals_one_device"],
        "model's gradients are what loss_fn(model(inputs), targets).backward() would leave": [
            "test_data_parallel_step_equals_one_device"],
        "accumulated onto any gradients already there": [
            "test_data_parallel_step_accumulates_like_backward"],
        "its parameters are unchanged": ["test_data_parallel_step_equals_one_device"],
        "return the whole batch's loss as a float, even when the chunks are uneven": [
            "test_data_parallel_step_equals_one_device"],
    },
}


# --------------------------------------------------------------------------------------------
# task1_5: reduce_gradients_into


def diagnose_reduction(got, name, before, replica_grads, expected) -> None:
    """Fail with the mistake's name when ``got`` is what a common wrong reduction gives."""
    if torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        return
    start = 0 if before is None else before
    total = sum(replica_grads)
    n = len(replica_grads)
    mistakes = [
        (start + total / n, f"it is the mean of the {n} replicas' gradients, not their sum: "
                            "each replica's gradient is already its share of the whole batch's "
                            "loss, so DataParallel sums them"),
        (replica_grads[-1] if before is None else None,
         f"it is only replica {n - 1}'s gradient (the last one): each replica overwrote the "
         "previous one's; add every replica's gradient"),
        (before + replica_grads[-1] if before is not None else None,
         f"it is the gradient already there plus only replica {n - 1}'s gradient: add every "
         "replica's gradient"),
        (replica_grads[-1] if before is not None else None,
         f"it is only replica {n - 1}'s gradient (the last one): the master's own gradient and "
         "the other replicas' were overwritten; add every replica's gradient to it"),
        (total if before is not None else None,
         "it is the replicas' sum alone: the gradient already on the master was overwritten; "
         "add the sum to it (param.grad += total), as backward accumulates"),
    ]
    for wrong, why in mistakes:
        if wrong is not None and torch.allclose(got, wrong, rtol=1e-5, atol=1e-6):
            pytest.fail(f"master gradient of {name!r}: {why}")


@pytest.mark.task1_5
@pytest.mark.parametrize("already", [False, True],
                         ids=["master without grads", "master with grads"])
def test_reduce_gradients_sums_into_the_master(ex, already):
    """reduce_gradients_into adds the sum of 3 replicas' gradients to the model's, with and without
    gradients already on the model; a parameter that no replica has a gradient for is left as it was
    (None stays None), and the replicas' gradients are unchanged."""
    g = torch.Generator().manual_seed(5)
    master = TinyNet()
    replicas = [copy.deepcopy(master) for _ in range(3)]
    for replica in replicas:
        for name, p in replica.named_parameters():
            # 'out.bias' gets no gradient anywhere, like a parameter the forward never used.
            p.grad = None if name == "out.bias" else torch.randn(p.shape, generator=g)
    before = {name: None if p.grad is None else p.grad.clone()
              for name, p in master.named_parameters()}
    if already:
        for name, p in master.named_parameters():
            p.grad = torch.randn(p.shape, generator=g)
            before[name] = p.grad.clone()
    replica_grads = [{n: None if p.grad is None else p.grad.clone()
                      for n, p in r.named_parameters()} for r in replicas]

    try:
        ex.reduce_gradients_into(master, replicas)
    except Exception as err:
        if task_of(err):  # the untouched stub: reported as "not attempted yet"
            raise
        none = ("; in this test 'out.bias' has .grad None on every replica (a parameter the "
                "forward never used): skip the gradients that are None" if "None" in str(err)
                else "")
        pytest.fail(f"reduce_gradients_into raised {type(err).__name__}: "
                    f"{str(err).splitlines()[0]}{none}")

    for name, p in master.named_parameters():
        if name == "out.bias":
            if before[name] is None:
                assert p.grad is None, (
                    "'out.bias' has no gradient on any replica, so the master's must stay None "
                    "(as after a backward that never reached it), not become zeros"
                )
            else:
                assert_close(p.grad, before[name], "master gradient of 'out.bias' (no replica "
                             "has one, so it must be left as it was)")
            continue
        total = sum(grads[name] for grads in replica_grads)
        expected = total if before[name] is None else before[name] + total
        assert p.grad is not None, f"master {name!r} has no gradient after the reduction"
        diagnose_reduction(p.grad, name, before[name], [grads[name] for grads in replica_grads],
                           expected)
        assert_close(p.grad, expected,
                     f"master gradient of {name!r}: the sum of 3 replicas' gradients"
                     + (" added to the gradient already there" if already else ""))
    for i, replica in enumerate(replicas):
        for name, p in replica.named_parameters():
            if replica_grads[i][name] is not None:
                assert_close(p.grad, replica_grads[i][name],
                             f"replica {i}'s gradient of {name!r} (the reduction must not "
                             f"change the replicas; did the master's .grad alias one of them?)")


# --------------------------------------------------------------------------------------------
# task1_6: data_parallel_step: equal to one device


STEP_CASES = [
    pytest.param(12, 3, "mse", id="12 on 3 (even)"),
    pytest.param(10, 3, "mse", id="10 on 3 (4,4,2)"),
    pytest.param(10, 4, "mse", id="10 on 4 (3,3,3,1)"),
    pytest.param(5, 4, "mse", id="5 on 4 (2,2,1: a replica idle)"),
    pytest.param(8, 1, "mse", id="8 on 1"),
    pytest.param(10, 3, "cross_entropy", id="10 on 3 cross-entropy"),
]


def run_step_and_reference(ex, batch_size, num_replicas, loss_name, grads_before=None):
    """data_parallel_step on one model and a plain backward on an identical one."""
    model = TinyNet()
    reference = copy.deepcopy(model)
    if grads_before is not None:
        for net in (model, reference):
            for p in net.parameters():
                p.grad = torch.full_like(p, grads_before)
    inputs, targets = make_batch(batch_size, classes=loss_name == "cross_entropy")
    loss_fn = F.cross_entropy if loss_name == "cross_entropy" else F.mse_loss
    untouched = copy.deepcopy(model)

    loss = ex.data_parallel_step(model, inputs, targets, loss_fn, num_replicas)
    seen = seen_batch_sizes()
    runners = list(TinyNet.runners)
    clear_call_record()
    assert_the_replicas_did_the_work(model, seen, runners, chunk_sizes(batch_size, num_replicas),
                                     f"{batch_size} samples on {num_replicas} replicas")

    reference_loss = loss_fn(reference(inputs), targets)
    reference_loss.backward()
    return model, reference, untouched, loss, reference_loss.item(), seen


def assert_the_replicas_did_the_work(model, seen, runners, sizes, context: str) -> None:
    """Each chunk ran on its own copy of ``model``, once; ``model`` itself ran on nothing.

    Then the model's gradients can only have come from the replicas, summed back into it.
    """
    context = f"{context}, chunks {sizes}"
    by_model = [size for size, who in zip(seen, runners, strict=True) if who is model]
    if by_model:
        idle = len(sizes) - (len(seen) - len(by_model))
        pytest.fail(
            f"the model itself ran on batches of sizes {by_model} ({context}), and "
            f"{idle} of the {len(sizes)} chunks never reached a replica: the replicas were not "
            "used. Did you run the master model on a chunk? Run replica i (from replicate) on "
            "chunk i; the model gets its gradients only from reduce_gradients_into"
        )
    replicas: list[nn.Module] = []
    for who in runners:
        if not any(who is r for r in replicas):
            replicas.append(who)
    for i, replica in enumerate(replicas):  # numbered in the order they first ran
        sizes_run = [size for size, who in zip(seen, runners, strict=True) if who is replica]
        assert len(sizes_run) == 1, (
            f"replica {i} ran {len(sizes_run)} times, on batches of sizes {sizes_run} "
            f"({context}): make one replica per chunk and run each once, on its own chunk"
        )
    assert len(replicas) == len(sizes), (
        f"{len(replicas)} replica(s) ran, on batches of sizes {seen}, for {len(sizes)} chunks "
        f"({context}): each chunk runs on its own replica"
    )


def assert_gradients_equal(model, reference, context: str) -> None:
    wanted = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, (
            f"the model's {name!r} has no gradient after data_parallel_step ({context}): the "
            f"replicas' gradients must be summed back into the model (reduce_gradients_into, "
            f"after loss.backward() has computed them)"
        )
        assert_close(p.grad, wanted[name].grad, f"gradient of {name!r}, {context}, vs one device")


@pytest.mark.task1_6
@pytest.mark.parametrize("batch_size, num_replicas, loss_name", STEP_CASES)
def test_data_parallel_step_equals_one_device(ex, batch_size, num_replicas, loss_name):
    """data_parallel_step gives the loss (a float) and gradients of one plain backward on the whole
    batch, to fp32 tolerance on CPU, weights unchanged, each chunk run once on its own replica and
    none on the model: MSE for 12 on 3, 10 on 3, 10 on 4, 5 on 4 and 8 on 1 replicas, cross-entropy
    for 10 on 3.

    The uneven cases catch a plain mean of the chunks' mean losses, which weighs a short chunk as
    much as a full one."""
    model, reference, untouched, loss, reference_loss, seen = run_step_and_reference(
        ex, batch_size, num_replicas, loss_name)
    sizes = chunk_sizes(batch_size, num_replicas)
    context = f"{batch_size} samples on {num_replicas} replicas, chunks {sizes}"
    assert sorted(seen) == sorted(sizes), (
        f"the model (or its copies) ran on batches of sizes {seen}; with {context} each "
        f"replica should run once, on its own chunk"
    )
    assert isinstance(loss, float), (
        f"data_parallel_step returned {type(loss).__name__}; return the loss as a float "
        f"(loss.item())"
    )
    assert_close(loss, reference_loss,
                 f"loss ({context}) vs one device: it must be the mean over all {batch_size} "
                 f"samples, and a plain mean of the chunks' mean losses weighs a short chunk as "
                 f"much as a full one")
    assert_gradients_equal(model, reference, context)
    assert_parameters_close(model, untouched,
                            "parameter (data_parallel_step must not update the weights)")


@pytest.mark.task1_6
def test_data_parallel_step_accumulates_like_backward(ex):
    """data_parallel_step adds to gradients already there, as backward does: from gradients of 0.5
    everywhere, 10 samples on 3 replicas (MSE) leave one plain backward's loss and gradients."""
    model, reference, _, loss, reference_loss, _ = run_step_and_reference(
        ex, 10, 3, "mse", grads_before=0.5)
    assert_close(loss, reference_loss, "loss")
    assert_gradients_equal(model, reference,
                           "10 on 3 with gradients already there (backward adds to them)")
